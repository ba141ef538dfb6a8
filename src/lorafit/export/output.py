"""The folder an export writes: checked before anything is written, filled under a hidden name beside it, marked as
an export, and renamed onto its name only when complete.

`--overwrite` replaces only a folder an earlier `lorafit export` of the same kind wrote (it carries MARKER): never
a folder of other files, never the run being exported or its base model, nor a folder holding either (`.`, `..`).
A killed export leaves its hidden `.NAME.partial-PID` folder; the next export beside it removes those whose
process is gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from lorafit.errors import ExportError
from lorafit.files import fsync_dir, process_alive, remove_stale_partials, write_atomic
from lorafit.train import failures

MARKER = ".lorafit-export"  # {"kind": "merged" | "gguf"}: what --overwrite may replace
NAME_MAX_BYTES = 255  # the longest file name Linux, macOS and Windows file systems take
DISK_MARGIN_BYTES = 64 * 2**20  # kept free beyond the export's own size (metadata, the tokenizer, the file system)


def size_text(count: float) -> str:
    """Bytes in the unit that shows them: 1.2 MB, 340 MB, 14.50 GB."""
    if count >= 1e9:
        return f"{count / 1e9:.2f} GB"
    if count >= 1e6:
        return f"{count / 1e6:.1f} MB"
    return f"{count / 1e3:.0f} kB"


def export_kind(folder: Path) -> str | None:
    """The kind of export `folder` holds by its marker, None if it is not one."""
    try:
        return str(json.loads((folder / MARKER).read_text()).get("kind"))
    except (OSError, ValueError, AttributeError):
        return None


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _first_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output(
    output: Path, *, kind: str, overwrite: bool, needed_bytes: int, keep: Mapping[Path, str] | None = None
) -> None:
    """Refuse, before anything is written: the run or base (or a folder holding them, the current folder), a path
    under a file, an existing output without --overwrite or that no export of this kind wrote, too little disk."""
    absolute = Path(os.path.abspath(output))
    resolved = absolute.resolve()
    for protected, what in {Path.cwd(): "the current folder", **(keep or {})}.items():
        if _inside(Path(protected).resolve(), resolved):
            raise ExportError(f"--output {output} would replace {what}; choose a new folder for the export")
    if absolute.name == "":
        raise ExportError(f"--output {output} names no folder; choose a new folder for the export")
    if len(os.fsencode(absolute.name)) > NAME_MAX_BYTES:
        raise ExportError(
            f"--output's folder name is {len(os.fsencode(absolute.name))} bytes; file systems allow "
            f"{NAME_MAX_BYTES}: choose a shorter name"
        )
    parent = absolute.parent.resolve()  # where the staging folder goes, beside the output
    try:
        existing = _first_existing(parent)
        if not existing.is_dir():
            raise ExportError(f"cannot write {output}: {existing} is a file, not a folder")
        if output.exists() or output.is_symlink():
            _check_replaceable(output, kind, overwrite)
        parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryDirectory(dir=parent).cleanup()
    except OSError as error:
        raise ExportError(f"cannot write in {parent}: {failures.write_failure(error, parent)}") from None
    free = failures.free_bytes(parent)
    if free is not None and free < needed_bytes + DISK_MARGIN_BYTES:
        raise ExportError(
            f"not enough disk space in {parent}: the export needs {size_text(needed_bytes)} plus a "
            f"{size_text(DISK_MARGIN_BYTES)} margin, {size_text(free)} are free; free some space or choose another "
            "--output"
        )


def _check_replaceable(output: Path, kind: str, overwrite: bool) -> None:
    """An existing output may be replaced with --overwrite, and only when an export of this kind wrote it."""
    if not overwrite:
        raise ExportError(f"{output} exists; pass --overwrite to replace it, or choose another --output")
    if not output.is_dir():
        raise ExportError(f"{output} is a file; --output names a folder")
    if any(output.iterdir()) and export_kind(output) != kind:
        raise ExportError(
            f"{output} is not the output of an earlier `lorafit export --to {kind}` (it has no {MARKER} of that "
            "kind); --overwrite replaces only those: choose another --output"
        )


def remove_stale(output: Path) -> tuple[list[Path], list[Path]]:
    """Remove what killed exports to `output` left beside it: `.NAME.partial-PID` folders whose process is gone, and
    `.NAME.retired-PID` ones (an earlier output moved aside) once `output` is there again. The ones removed, and the
    retired ones kept because they may be the only copy of an earlier output."""
    stem = re.escape(_stem(output))
    retired = re.compile(rf"\.{stem}\.retired-(?P<pid>\d+)")
    removed = remove_stale_partials(output.parent, re.compile(rf"\.{stem}\.partial-(?P<pid>\d+)"))
    if output.exists():
        return removed + remove_stale_partials(output.parent, retired), []
    with contextlib.suppress(OSError):
        kept = [
            path
            for path in sorted(output.parent.iterdir())
            if (found := retired.fullmatch(path.name)) and path.is_dir() and not process_alive(int(found["pid"]))
        ]
        return removed, kept
    return removed, []


def _stem(output: Path) -> str:
    """The output's name in its hidden folders' names: itself, or for a name too long to take the prefix and
    suffix, its start and a digest of the whole (still one name per output)."""
    name = output.name
    if len(os.fsencode(name)) <= NAME_MAX_BYTES - 32:
        return name
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:12]
    return os.fsencode(name)[: NAME_MAX_BYTES - 48].decode(errors="ignore") + "~" + digest


def _hidden(output: Path, state: str) -> Path:
    return output.with_name(f".{_stem(output)}.{state}-{os.getpid()}")


def publish(staging: Path, output: Path) -> None:
    """Rename the complete staging folder onto `output`; an old output is moved aside first and removed after (put
    back if the rename fails)."""
    retired = _hidden(output, "retired")
    if output.exists() or output.is_symlink():
        output.replace(retired)
    try:
        staging.replace(output)
    except OSError:
        if retired.exists() or retired.is_symlink():
            retired.replace(output)
        raise
    fsync_dir(output.parent)
    if retired.is_dir() and not retired.is_symlink():
        shutil.rmtree(retired, ignore_errors=True)
    else:
        retired.unlink(missing_ok=True)


@contextlib.contextmanager
def staged(output: Path, kind: str, notes: list[str] | None = None) -> Iterator[Path]:
    """A hidden staging folder beside `output` to write into; published as `output` (with the marker) when the
    block ends, removed when it fails. A failed write or Ctrl-C ends in one line that says what was left."""
    output = Path(output)
    removed, kept = remove_stale(output)
    if removed and notes is not None:
        notes.append(f"removed {len(removed)} folder(s) killed exports left beside {output}")
    if kept and notes is not None:
        notes.append(f"an earlier output moved aside by a killed export is kept at {kept[0]}; remove it when done")
    staging = _hidden(output, "partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
        write_atomic(staging / MARKER, json.dumps({"kind": kind}) + "\n")
        publish(staging, output)
    except KeyboardInterrupt as interrupt:
        shutil.rmtree(staging, ignore_errors=True)
        sys.stderr.write(f"lorafit: export interrupted: its partial files were removed; {output} is as it was\n")
        raise failures.ReportedInterrupt from interrupt
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        reason = failures.write_failure(error, output.parent)
        if reason is None:
            raise
        fix = failures.fix_for(reason)
        raise ExportError(
            f"could not write {output}: {reason}; the partial export was removed{'; ' + fix if fix else ''}"
        ) from None
