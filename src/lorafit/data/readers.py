"""Read data files one record at a time, so a file larger than memory streams through in flat memory.

JSONL and plain text are read line by line (each line keeps its number and its own error); CSV goes through
the standard `csv` module fed with decoded lines, so a bad byte is pinned to its line; Parquet streams in
record batches through pyarrow. A JSON array is one document and is read whole: use JSONL for data larger
than memory.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, NamedTuple

from lorafit.data.formats import Issue
from lorafit.errors import DataError
from lorafit.messages import say

FileKind = Literal["jsonl", "json", "csv", "tsv", "parquet", "text"]
EXTENSIONS: dict[str, FileKind] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".csv": "csv",
    ".tsv": "tsv",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".txt": "text",
    ".text": "text",
}
PARQUET_BATCH_ROWS = 1024
COMPRESSED = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd", ".zip": "zip", ".tar": "tar"}
# What a text data file sometimes really is: the first bytes name it, so one line says so instead of an error
# on every line (the order matters: the UTF-32 marks begin with the UTF-16 ones).
SIGNATURES = (
    (b"\x00\x00\xfe\xff", "UTF-32 text"),
    (b"\xff\xfe\x00\x00", "UTF-32 text"),
    (b"\xfe\xff", "UTF-16 text"),
    (b"\xff\xfe", "UTF-16 text"),
    (b"\x1f\x8b", "gzip-compressed"),
    (b"\xfd7zXZ\x00", "xz-compressed"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed"),
    (b"PK\x03\x04", "a zip archive"),
    (b"PAR1", "a Parquet file"),
)
SNIFF_BYTES = 8192
SURROGATE_MESSAGE = say("row.surrogate")

# What the json module says it expected, declared in lorafit.messages (json.decoder's own words).
JSON_MESSAGES = (
    "json.expecting_value",
    "json.expecting_name",
    "json.expecting_comma",
    "json.expecting_colon",
    "json.extra_data",
    "json.unterminated",
    "json.control",
    "json.escape",
)


class RawRecord(NamedTuple):
    """One record as read, or why it could not be read. `counted` is False for a problem with the whole file,
    which has no row index."""

    file: str
    line: int | None
    value: Any
    issue: Issue | None = None
    counted: bool = True


def file_kind(path: Path) -> FileKind:
    kind = EXTENSIONS.get(path.suffix.lower())
    if kind is None:
        if path.suffix.lower() in COMPRESSED:
            raise DataError(
                f"{path}: a {COMPRESSED[path.suffix.lower()]} file; lorafit reads data uncompressed: extract it first"
            )
        known = ", ".join(sorted(EXTENSIONS))
        raise DataError(f"{path}: unknown file type {path.suffix or '(no extension)'!r}; expected one of {known}")
    return kind


def data_files(path: Path) -> list[Path]:
    """The file itself, or every data file under a directory (sorted, hidden files skipped). A name too long to
    exist is no file (os.path answers False where pathlib raises)."""
    path = Path(path)
    if os.path.isfile(path):
        file_kind(path)
        return [path]
    if os.path.isdir(path):
        try:
            candidates = [
                candidate
                for candidate in path.rglob("*")
                if candidate.is_file() and not any(part.startswith(".") for part in candidate.relative_to(path).parts)
            ]
        except OSError as error:
            raise DataError(f"cannot read the directory {path}: {error.strerror or error}") from None
        suffixes = {candidate.suffix.lower() for candidate in candidates}
        if ".arrow" in suffixes:
            raise DataError(
                f"{path} holds Arrow files (a `datasets` save_to_disk folder?); lorafit reads JSONL, JSON, CSV and "
                "Parquet: export it first, e.g. datasets.load_from_disk(DIR).to_json('train.jsonl')"
            )
        files = sorted(candidate for candidate in candidates if candidate.suffix.lower() in EXTENSIONS)
        if not files:
            compressed = sorted(suffixes & set(COMPRESSED))
            hint = f"; it holds compressed files ({', '.join(compressed)}): extract them first" if compressed else ""
            raise DataError(f"no data files in {path} (looked for {', '.join(sorted(EXTENSIONS))}){hint}")
        return files
    if os.path.exists(path):
        raise DataError(f"{path} is not a regular file or a directory (a pipe, device or socket); name a data file")
    raise DataError(f"no such file or directory: {path}")


def read_records(path: Path) -> Iterator[RawRecord]:
    """Every record of one file, in order."""
    kind = file_kind(path)
    try:
        if kind != "parquet" and (what := _foreign_content(path)) is not None:
            yield RawRecord(str(path), None, None, Issue(None, what), False)
            return
        if kind == "jsonl":
            yield from _read_jsonl(path)
        elif kind == "json":
            yield from _read_json(path)
        elif kind in ("csv", "tsv"):
            yield from _read_csv(path, delimiter="\t" if kind == "tsv" else ",")
        elif kind == "parquet":
            yield from _read_parquet(path)
        else:
            yield from _read_text(path)
    except OSError as error:
        raise DataError(f"cannot read {path}: {error.strerror or error}") from None


def _foreign_content(path: Path) -> str | None:
    """Why a text data file cannot be read as UTF-8 text at all, from its first bytes; None if it may be."""
    with path.open("rb") as handle:
        head = handle.read(SNIFF_BYTES)
    what = next((what for signature, what in SIGNATURES if head.startswith(signature)), None)
    if what == "a Parquet file" and b"\x00" not in head:
        what = None  # a text file that happens to begin with the letters PAR1
    if what is None and head and head.count(0) * 4 >= len(head):  # no UTF-8 text is a quarter NUL bytes
        utf16 = _utf16_without_mark(head)
        what = f"{utf16} text" if utf16 else "binary"
    if what is None:
        return None
    if what.endswith(" text"):
        encoding = what.split()[0]
        return say("row.encoding", what=what, encoding=encoding, name=path.name)
    if what == "binary":
        return say("row.binary")
    return say("row.compressed", what=what, suffix=path.suffix)


def _utf16_without_mark(head: bytes) -> str | None:
    """'UTF-16LE' or 'UTF-16BE' when ASCII-range text has a NUL beside every character, and only there."""

    def nul_share(half: bytes) -> float:
        return half.count(0) / max(1, len(half))

    odd, even = nul_share(head[1::2]), nul_share(head[::2])
    if odd >= 0.9 and even <= 0.1:
        return "UTF-16LE"
    if even >= 0.9 and odd <= 0.1:
        return "UTF-16BE"
    return None


def _decode(raw: bytes, first: bool) -> tuple[str | None, Issue | None]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        byte = raw[error.start : error.start + 1].hex()
        return None, Issue(None, say("row.non_utf8", byte=byte, offset=error.start + 1))
    if first and text.startswith("\ufeff"):
        text = text[1:]
    return text, None


def _read_jsonl(path: Path) -> Iterator[RawRecord]:
    name = str(path)
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue  # blank lines hold no record
            text, issue = _decode(raw, number == 1)
            if issue is not None:
                yield RawRecord(name, number, None, issue)
                continue
            text = text.strip()  # so an error's column is on this line, not on the newline after it
            try:
                value = json.loads(text)
            except (ValueError, RecursionError) as error:
                yield RawRecord(name, number, None, Issue(None, say("row.invalid_json", reason=_json_reason(error))))
                continue
            if _may_hold_surrogates(text) and not _valid_unicode(value):
                yield RawRecord(name, number, None, Issue(None, SURROGATE_MESSAGE))
                continue
            yield RawRecord(name, number, value)


def _read_json(path: Path) -> Iterator[RawRecord]:
    """A JSON array of records; a .json file that is really one record per line is read as JSONL."""
    name = str(path)
    with path.open("rb") as handle:
        head = handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if not head.startswith(b"["):
        first = next(_read_jsonl(path), None)
        if head.startswith(b"{") and first is not None and first.issue is not None and first.line == 1:
            # Line 1 alone is not JSON: perhaps a pretty-printed single object. Say what is expected.
            try:
                whole = _parse_whole(path)
            except _WholeFileError:
                whole = None
            if isinstance(whole, dict):
                keys = ", ".join(repr(key) for key in list(whole)[:5])
                message = say("row.one_object", keys=keys)
                yield RawRecord(name, None, None, Issue(None, message), False)
                return
        yield from _read_jsonl(path)
        return
    try:
        data = _parse_whole(path)
    except _WholeFileError as error:
        yield RawRecord(name, error.line, None, Issue(None, error.message), False)
        return
    if not isinstance(data, list):  # unreachable but for a trailing-garbage edge: json.loads saw '[' first
        yield RawRecord(name, None, None, Issue(None, say("row.not_array")), False)
        return
    for value in data:
        if not _valid_unicode(value):
            yield RawRecord(name, None, None, Issue(None, SURROGATE_MESSAGE))
            continue
        yield RawRecord(name, None, value)


class _WholeFileError(Exception):
    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.message, self.line = message, line


def _parse_whole(path: Path) -> Any:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise _WholeFileError(
            say("row.non_utf8_line", byte=raw[error.start : error.start + 1].hex(), line=line), line
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise _WholeFileError(
            say("row.invalid_json_at", reason=_json_message(error), line=error.lineno, column=error.colno),
            error.lineno,
        ) from None
    except (ValueError, RecursionError) as error:
        raise _WholeFileError(f"invalid JSON: {_json_reason(error)}") from None


def _may_hold_surrogates(text: str) -> bool:
    """A cheap pre-test: JSON can only produce a lone surrogate from a \\uD800-\\uDFFF escape."""
    return "\\ud" in text or "\\uD" in text


def _valid_unicode(value: Any) -> bool:
    """False if any string in a parsed record holds a lone surrogate (it could never be written as UTF-8)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    except (ValueError, RecursionError):
        return True
    return True


def _json_reason(error: Exception) -> str:
    if isinstance(error, json.JSONDecodeError):
        return say("row.json_column", reason=_json_message(error), column=error.colno)
    if isinstance(error, RecursionError):
        return say("row.nested")
    return str(error).splitlines()[0][:200]


def _json_message(error: json.JSONDecodeError) -> str:
    """The json module's words for what it expected, as the catalog declares them (so a page can translate them)."""
    return next((say(key) for key in JSON_MESSAGES if say(key) == error.msg), error.msg)


def _read_text(path: Path) -> Iterator[RawRecord]:
    """One record per non-blank line, as the `datasets` text loader does."""
    name = str(path)
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            text, issue = _decode(raw, number == 1)
            if issue is not None:
                yield RawRecord(name, number, None, issue)
                continue
            text = text.rstrip("\r\n")
            if text.strip():
                yield RawRecord(name, number, {"text": text})


def _read_csv(path: Path, delimiter: str) -> Iterator[RawRecord]:
    """Header row, then one record per CSV row; quoted fields may span lines, so a row spans a line range."""
    name = str(path)
    bad_lines: dict[int, Issue] = {}

    def decoded_lines() -> Iterator[str]:
        with path.open("rb") as handle:
            for number, raw in enumerate(handle, start=1):
                text, issue = _decode(raw, number == 1)
                if issue is not None:
                    bad_lines[number] = issue
                    text = raw.decode("utf-8", errors="replace")
                yield text

    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    reader = csv.reader(decoded_lines(), delimiter=delimiter)
    header: list[str] | None = None
    last_line = 0
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as error:
            issue = Issue(None, say("row.invalid_csv", reason=error))
            yield RawRecord(name, last_line + 1, None, issue, header is not None)
            last_line = reader.line_num
            continue
        first_line, last_line = last_line + 1, reader.line_num
        bad = next((bad_lines[n] for n in range(first_line, last_line + 1) if n in bad_lines), None)
        if header is None:
            if not cells:
                continue
            if bad is not None:
                yield RawRecord(name, first_line, None, Issue(None, say("row.header", problem=bad.message)), False)
                return
            header = [cell.strip() for cell in cells]
            continue
        if not cells or (len(cells) == 1 and not cells[0].strip() and len(header) > 1):
            continue  # blank line
        if bad is not None:
            yield RawRecord(name, first_line, None, bad)
        elif len(cells) != len(header):
            message = say("row.fields", cells=len(cells), header=len(header))
            yield RawRecord(name, first_line, None, Issue(None, message))
        else:
            yield RawRecord(name, first_line, dict(zip(header, cells, strict=True)))


def _read_parquet(path: Path) -> Iterator[RawRecord]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    name = str(path)
    try:
        parquet = pq.ParquetFile(path)
        batches = parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS)
        for batch in batches:
            for value in batch.to_pylist():
                yield RawRecord(name, None, value)
    except (pa.ArrowException, ValueError) as error:
        message = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        yield RawRecord(name, None, None, Issue(None, say("row.parquet", reason=message)), False)
