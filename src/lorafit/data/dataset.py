"""A dataset on disk as a stream of checked records: every record comes out valid or with the problems that
rejected it, so nothing is dropped without a word.

The format is detected per file from its first records before streaming starts, so it is known up front.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from lorafit.data.formats import (
    DETECT_SAMPLE,
    Format,
    Messages,
    apply_mapping,
    check_format,
    detect_format,
    normalize,
    parse_mapping,
    unmatched_mapping,
)
from lorafit.data.problems import Problem
from lorafit.data.readers import data_files, file_kind, read_records
from lorafit.errors import DataError
from lorafit.messages import say


@dataclass(slots=True)
class Record:
    """One record: its place, its conversation (None if rejected) and its problems."""

    file: str
    line: int | None
    row: int | None  # None: a problem with the whole file, not a record
    messages: Messages | None
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.messages is not None


class Dataset:
    """A file or a directory of files, read record by record. Iterate it as often as needed."""

    def __init__(
        self,
        path: str | Path,
        format: str | None = None,
        mapping: Mapping[str, str] | Iterable[str] | None = None,
    ) -> None:
        self.path = Path(path)
        self.mapping = parse_mapping(mapping)
        self.files = data_files(self.path)
        forced = check_format(format)
        samples = {file: self._sample(file) for file in self.files}
        capped = any(len(sample) >= DETECT_SAMPLE for sample in samples.values())
        self._check_mapping([value for sample in samples.values() for value in sample], capped)
        self.file_formats: dict[str, Format | None] = {
            str(file): forced or self._detect(file, sample) for file, sample in samples.items()
        }
        found = {fmt for fmt in self.file_formats.values() if fmt is not None}
        if len(found) > 1:
            listing = ", ".join(f"{Path(name).name} is {fmt}" for name, fmt in self.file_formats.items() if fmt)
            raise DataError(f"{self.path} mixes formats ({listing}); convert them to one, or check them one by one")
        self.format: Format | None = found.pop() if found else None

    @staticmethod
    def _sample(file: Path) -> list[object]:
        """The first records that parse, as read (a text file's rows have no columns to look at)."""
        if file_kind(file) == "text":
            return []
        sample = []
        for record in read_records(file):
            if record.issue is None and record.counted:
                sample.append(record.value)
                if len(sample) >= DETECT_SAMPLE:
                    break
        return sample

    def _detect(self, file: Path, sample: list[object]) -> Format | None:
        if file_kind(file) == "text":
            return "text"
        if not sample:
            return None  # nothing parses: every record will be reported as it is read
        mapped = [apply_mapping(value, self.mapping) if isinstance(value, dict) else value for value in sample]
        return detect_format(mapped, source=str(file))

    def _check_mapping(self, sample: list[object], capped: bool) -> None:
        """Refuse a `--map` whose column the sampled records lack: a typo would otherwise be silently ignored.
        `capped`: the sample is the first records only, not the whole dataset."""
        if self.mapping and sample:
            source = f"{self.path} (its first {DETECT_SAMPLE} records)" if capped else str(self.path)
            if (problem := unmatched_mapping(self.mapping, sample, source)) is not None:
                raise DataError(problem)

    def __iter__(self) -> Iterator[Record]:
        row = 0
        for file in self.files:
            fmt = self.file_formats[str(file)] or self.format
            for raw in read_records(file):
                if not raw.counted:
                    yield Record(
                        raw.file,
                        raw.line,
                        None,
                        None,
                        [Problem(raw.issue.message, "error", raw.file, raw.line)],
                    )
                    continue
                if raw.issue is not None:
                    problem = Problem(raw.issue.message, raw.issue.severity, raw.file, raw.line, row, raw.issue.field)
                    yield Record(raw.file, raw.line, row, None, [problem])
                elif fmt is None:  # unreachable: a parsed record makes detection succeed or raise
                    yield Record(
                        raw.file,
                        raw.line,
                        row,
                        None,
                        [Problem("format unknown", "error", raw.file, raw.line, row)],
                    )
                else:
                    messages, issues = normalize(raw.value, fmt, self.mapping)
                    problems = [Problem(i.message, i.severity, raw.file, raw.line, row, i.field) for i in issues]
                    yield Record(raw.file, raw.line, row, messages, problems)
                row += 1


class Conversations(list):
    """The valid rows as conversations (a plain list of message lists), with the format they were read as."""

    def __init__(self, rows: Iterable[Messages], format: Format | None, source: str, warnings: int = 0) -> None:
        super().__init__(rows)
        self.format = format
        self.source = source
        self.warnings = warnings


def load_conversations(
    path: str | Path, format: str | None = None, mapping: Mapping[str, str] | Iterable[str] | None = None
) -> Conversations:
    """Every row of a dataset as a conversation, for the trainer. Raises DataError (one line: the first
    problem, how many rows have errors, and the command that lists them all) if any row is rejected;
    warnings such as duplicates do not stop it. `.format` on the result is the detected (or given) format."""
    dataset = Dataset(path, format, mapping)
    rows: list[Messages] = []
    first_error: Problem | None = None
    error_rows = 0
    warnings = 0
    for record in dataset:
        errors = [problem for problem in record.problems if problem.severity == "error"]
        warnings += len(record.problems) - len(errors)
        if errors or record.messages is None:
            error_rows += 1
            first_error = first_error or (errors[0] if errors else None)
        else:
            rows.append(record.messages)
    if first_error is not None:
        where, problem = first_error.where(), first_error.message
        raise DataError(
            say("data.bad_rows_more", where=where, problem=problem, more=error_rows - 1, path=path)
            if error_rows > 1
            else say("data.bad_rows", where=where, problem=problem, path=path)
        )
    if not rows:
        raise DataError(say("data.no_rows", path=path))
    return Conversations(rows, dataset.format, str(path), warnings)


def detect(path: str | Path, mapping: Mapping[str, str] | Iterable[str] | None = None) -> Format | None:
    """The format of a file or directory, from its first records (None if no record parses)."""
    return Dataset(path, None, mapping).format
