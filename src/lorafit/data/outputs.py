"""Where the data commands write: one rule for convert's OUT, `check --report` and `check --plot`.

- An existing directory gets the file inside it, named after the dataset (`train-lengths.png` for train.jsonl).
- Any other path must end in the suffix of what is written (`.png`, `.json`, `.jsonl`): a histogram asked for as
  `plot.jpg` or a report as `notes` is refused rather than silently renamed or mislabelled.
- Missing parent folders are created, as the atomic writer writes (`lorafit.files`).
- The path may not be an input file, nor a data file inside an input directory (the next check of that directory
  would read it as data), nor anything the writer refuses (`lorafit.files.target_problem`): a name longer than
  a file system holds, or an existing symlink, device, pipe or socket, which the writer's rename would replace.

Everything here is checked before the dataset is read, so a mistyped path fails at once, not after the scan.
"""

from __future__ import annotations

import os
from pathlib import Path

from lorafit.data.readers import EXTENSIONS, data_files
from lorafit.errors import DataError
from lorafit.files import name_problem, target_problem


def output_path(
    path: str | Path, source: str | Path, *, label: str, what: str, suffixes: tuple[str, ...], name_suffix: str
) -> Path:
    """The file to write for `label` (e.g. "--plot"): `path`, or a file inside it when it is a directory.

    `what` names the content for messages ("the histogram is a PNG"); `suffixes` are the accepted endings, the
    first one used for a name made inside a directory: `<dataset stem><name_suffix><suffixes[0]>`."""
    path, source = Path(path), Path(source)
    if os.path.isdir(path):  # False, not an error, for a name too long to exist
        path = path / f"{dataset_stem(source)}{name_suffix}{suffixes[0]}"
    elif path.suffix.lower() not in suffixes:
        endings = " or ".join(filter(None, [", ".join(suffixes[:-1]), suffixes[-1]]))
        raise DataError(f"{label} {path}: {what}; name a {endings} file, or an existing directory to write it in")
    shown = f"{label} {path}"
    problem = name_problem(path)
    if problem:
        raise DataError(f"{shown} {problem}")
    _check_parents(path, shown)
    if path.exists() and any(_same_file(file, path) for file in data_files(source)):
        raise DataError(f"{shown} is the input; write to another file")
    problem = target_problem(path)
    if problem:
        raise DataError(f"{shown} {problem}")
    if os.path.isdir(source) and path.suffix.lower() in EXTENSIONS and path.resolve().is_relative_to(source.resolve()):
        raise DataError(f"{shown} is inside the input directory {source}, where it would be read as data")
    return path


def dataset_stem(source: Path) -> str:
    """'train' for train.jsonl, 'data' for a directory data/ (the current directory's own name for '.')."""
    resolved = source.resolve()
    return (resolved.name if os.path.isdir(resolved) else resolved.stem) or "data"


def _check_parents(path: Path, shown: str) -> None:
    """A parent that exists must be a directory; missing ones are created when the file is written."""
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise DataError(f"{shown}: {parent} is a file, not a folder")
            return


def _same_file(first: Path, second: Path) -> bool:
    try:
        return first.samefile(second)
    except OSError:
        return False
