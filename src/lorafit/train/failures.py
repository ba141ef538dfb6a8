"""A failed write or an interrupt, told in one line: what a full, read-only or vanished disk comes down to in
words, and what a person does about it. The run folder, checkpoint saves and exports all read it from here.
Pure Python: no torch here.
"""

from __future__ import annotations

import errno
import re
import shutil
from pathlib import Path

ERRNO_WORDS = {
    errno.ENOSPC: "no space left on device (the disk is full)",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}
# torch's checkpoint writer reports a full disk without an errno ("unexpected pos 576 vs 534"); when it fails
# with less than this free on the file system, the disk is what ran out.
NEARLY_FULL_BYTES = 64 * 2**20


def free_bytes(path: Path) -> int | None:
    """Free space on the file system holding `path` (its nearest existing parent), None if unknown."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def write_failure(error: BaseException, where: Path) -> str | None:
    """What a failed write into `where` comes down to, in words; None if `error` is not a failed write.

    Three libraries write a run: Python (OSError with an errno), safetensors (SafetensorError, whose text
    ends in "(os error 28)") and torch's zip writer (a RuntimeError from inline_container.cc that names no
    errno, so a nearly full file system is taken as the cause)."""
    if isinstance(error, OSError):
        if error.errno in ERRNO_WORDS:
            return ERRNO_WORDS[error.errno]
        return (error.strerror or str(error) or type(error).__name__).lower()
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if type(error).__name__ == "SafetensorError":
        found = re.search(r"os error (\d+)", text)
        code = int(found[1]) if found else None
        return ERRNO_WORDS.get(code) if code in ERRNO_WORDS else f"safetensors: {text}"
    if isinstance(error, RuntimeError) and any(
        mark in text for mark in ("inline_container", "PytorchStreamWriter", "file write failed")
    ):
        free = free_bytes(where)
        if free is not None and free < NEARLY_FULL_BYTES:
            return ERRNO_WORDS[errno.ENOSPC]
        return f"torch could not write it: {text}"
    return None


def fix_for(reason: str) -> str:
    """What a person does about a failed write, given its reason in words ("" when nothing general helps)."""
    if reason.startswith(("no space", "disk quota")):
        return "free space"
    if reason.startswith(("read-only", "permission")):
        return "make it writable"
    return ""


class ReportedInterrupt(KeyboardInterrupt):
    """Ctrl-C, with where the run stopped already told (by the trainer, which knows the step)."""
