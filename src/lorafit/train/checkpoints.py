"""A run's checkpoints, written so that a kill never breaks them, and the newest intact one to resume from.

A checkpoint is written into `checkpoints/.staging/checkpoint-N`, flushed to disk, marked complete, and only
then renamed to `checkpoints/checkpoint-N` (a rename within one file system is atomic). A kill or a full disk
during the save leaves at most a staging folder, which the next run deletes; the newest complete checkpoint
is untouched. Which run the folder holds, and its other files, are `runfolder`'s. Pure Python: no torch here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from lorafit.files import fsync_dir, ordinary_mode, write_atomic

CHECKPOINTS = "checkpoints"
STAGING = ".staging"
PREFIX = "checkpoint-"
COMPLETE = "lorafit-checkpoint.json"  # written last: a checkpoint without it is not one


# --- files that never end up half written (lorafit.files writes single files) --------------------------
def _fsync_tree(folder: Path) -> None:
    ordinary_mode(folder)
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    fsync_dir(folder)


# --- checkpoints --------------------------------------------------------------------------------------------
def checkpoint_root(output_dir: Path) -> Path:
    return Path(output_dir) / CHECKPOINTS


def staging_root(output_dir: Path) -> Path:
    """Where the Trainer writes a checkpoint before it is published (its TrainingArguments.output_dir)."""
    return checkpoint_root(output_dir) / STAGING


def checkpoint_step(path: Path) -> int | None:
    name = path.name
    if not name.startswith(PREFIX) or not name[len(PREFIX) :].isdigit():
        return None
    return int(name[len(PREFIX) :])


def is_complete(path: Path) -> bool:
    try:
        marker = json.loads((path / COMPLETE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("step") == checkpoint_step(path)


def good_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [(checkpoint_step(path), path) for path in root.iterdir() if path.is_dir()]
    return [path for step, path in sorted((s, p) for s, p in found if s is not None) if is_complete(path)]


def latest_checkpoint(output_dir: Path) -> Path | None:
    checkpoints = good_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def resume_hint(output_dir: Path, first: str = "") -> str:
    """What the folder holds to go on from, and the command that does (after `first`: "free space")."""
    newest = latest_checkpoint(output_dir)
    rerun = f"{first} and rerun the same command" if first else "rerun the same command"
    if newest is None:
        return f"there is no checkpoint yet: {rerun} to start over"
    return f"{newest.name} is intact: {rerun} to resume from it"


def publish(staged: Path, output_dir: Path, step: int, keep: int) -> Path:
    """Flush a staged checkpoint, mark it complete, rename it into place, then drop the oldest beyond `keep`."""
    _fsync_tree(staged)
    write_atomic(staged / COMPLETE, json.dumps({"step": step}))
    final = checkpoint_root(output_dir) / f"{PREFIX}{step}"
    if final.exists():  # a step saved again (after an out-of-memory retry): the new copy replaces it
        retired = final.with_name(f".retired-{final.name}")
        shutil.rmtree(retired, ignore_errors=True)
        os.replace(final, retired)
        os.replace(staged, final)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staged, final)
    fsync_dir(final.parent)
    rotate(output_dir, keep)
    return final


def rotate(output_dir: Path, keep: int) -> None:
    for old in good_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def discard_staged(staged: Path) -> None:
    """Delete a checkpoint whose save failed (and the staging folder once empty), to give the space back."""
    shutil.rmtree(staged, ignore_errors=True)
    with contextlib.suppress(OSError):  # other staged saves, or already gone
        staged.parent.rmdir()


def clean_partial(output_dir: Path) -> None:
    """Remove what an interrupted save left: the staging folder and any incomplete checkpoint folder."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return
    shutil.rmtree(root / STAGING, ignore_errors=True)
    for path in root.iterdir():
        if path.name.startswith(".retired-") or (checkpoint_step(path) is not None and not is_complete(path)):
            shutil.rmtree(path, ignore_errors=True)
