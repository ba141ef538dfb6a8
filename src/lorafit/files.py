"""Files that are never half written: a temporary sibling, fsync, rename over the target.

The one atomic writer of the project (reports, converted data, plans, run files, model cards). The file gets
the permissions an ordinary `open(path, "w")` would give it (0666 less the umask): a model trained for someone
else must be readable by them, and `tempfile` alone would leave it 0600.

The target must be a regular file or nothing: a symlink (even dangling or looping), a device, a pipe or a socket
is refused, never replaced by the rename nor written through (as root, `init /dev/null --force` once replaced
/dev/null). The temporary name is short (`.lorafit-HOST-PID-XXXXXXXX.tmp`), so that any name the file system
holds can be written, and names the process that writes it, so that what a killed process left behind is
removed by the next write into the same folder (`remove_stale_partials`, which export reuses for its folders).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import stat
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from lorafit.errors import LorafitError

NAME_MAX = 255  # bytes in one file or folder name: ext4, xfs, btrfs, APFS and NTFS all stop there

# The writer's temporary files; `host` and `pid` say which process on which machine writes each one.
TEMPORARY = re.compile(r"\.lorafit-(?P<host>[0-9a-f]{8})-(?P<pid>[0-9]+)-[a-z0-9_]+\.tmp")


def cache_folder() -> Path:
    """The user's cache for lorafit ($XDG_CACHE_HOME/lorafit, else ~/.cache/lorafit): `lorafit serve`'s uploads
    and `lorafit measure`'s measurements."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lorafit"


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


def name_problem(path: Path) -> str | None:
    """Whether a part of `path` is longer than a file system holds (where pathlib raises instead of answering),
    worded as `target_problem` words it."""
    for part in Path(path).parts:
        size = len(os.fsencode(part))
        if size > NAME_MAX:
            return f"has a name of {size:,} bytes; a file or folder name may have at most {NAME_MAX}"
    return None


def target_problem(path: Path) -> str | None:
    """Why a regular file cannot be written at `path`, worded to follow the path ("... is a symbolic link; ..."),
    or None. Checked before anything is read or written, so that a mistyped path fails at once, in one line."""
    problem = name_problem(path)
    if problem:
        return problem
    try:
        mode = os.lstat(path).st_mode
    except OSError:  # nothing there yet, or a parent missing or not a folder: the write says which
        return None
    if stat.S_ISLNK(mode):
        return "is a symbolic link; name the file itself, or a new name"
    if stat.S_ISDIR(mode):
        return "is a folder; name a file"
    if not stat.S_ISREG(mode):
        return "is not a regular file (a device, pipe or socket); name a file"
    return None


def host_tag() -> str:
    """8 hex digits for this machine: a process id says whether its process is alive only on the machine that
    gave it (two machines can write into one shared folder)."""
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def remove_stale_partials(folder: Path, pattern: re.Pattern[str]) -> list[Path]:
    """Remove what killed lorafit processes left in `folder`, and return the paths removed.

    An entry goes when its whole name matches `pattern`, whose group `pid` names the process that made it, and
    that process is no longer alive; where `pattern` has a group `host` too, only entries made on this machine
    (`host_tag()`) are judged. A file is unlinked, a folder removed with its contents, a symlink never followed.
    Best effort: what cannot be listed or removed stays."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    here = host_tag()
    removed: list[Path] = []
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or match.groupdict().get("host", here) != here or process_alive(int(match["pid"])):
            continue
        path = Path(entry.path)
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError:
            continue
        removed.append(path)
    return removed


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs on this machine (kept, when in doubt)."""
    if pid == os.getpid() or os.name != "posix":  # os.kill(pid, 0) would end the process on Windows
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's process, or a number no process has
        return True
    return True


@contextlib.contextmanager
def atomic_writer(path: Path, binary: bool = False) -> Iterator[IO[Any]]:
    """A text (or, `binary`, a bytes) handle on a temporary file beside `path`, renamed onto it only when the
    block ends without error; on any error the temporary file is removed and `path` is left as it was."""
    path = Path(path)
    problem = target_problem(path)
    if problem:
        raise LorafitError(f"cannot write {path}: it {problem}")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(path.parent, TEMPORARY)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".lorafit-{host_tag()}-{os.getpid()}-", suffix=".tmp")
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
