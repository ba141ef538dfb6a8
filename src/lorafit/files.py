"""Files that are never half written: a temporary sibling, fsync, rename over the target.

The one atomic writer of the project (reports, converted data, plans, run files, model cards). The file gets
the permissions an ordinary `open(path, "w")` would give it (0666 less the umask): a model trained for someone
else must be readable by them, and `tempfile` alone would leave it 0600.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def default_mode() -> int:
    """0666 less the process umask (read without changing it for good)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def ordinary_mode(folder: Path) -> None:
    """Give the files in `folder` (not below) the mode an ordinary write would: safetensors writes its files 0600,
    and a model trained for someone else must be readable by them."""
    for path in Path(folder).iterdir():
        if path.is_file() and not path.is_symlink():
            os.chmod(path, default_mode())


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: Path, binary: bool = False) -> Iterator[IO[Any]]:
    """A text (or, `binary`, a bytes) handle on a temporary file beside `path`, renamed onto it only when the
    block ends without error; on any error the temporary file is removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, default_mode())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_atomic(path: Path, text: str) -> None:
    """Write a whole text file or nothing."""
    with atomic_writer(path) as handle:
        handle.write(text)
