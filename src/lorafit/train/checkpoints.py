"""The run folder: which run it holds, its checkpoints, and files written so that a kill never breaks them.

A checkpoint is written into `checkpoints/.staging/checkpoint-N`, flushed to disk, marked complete, and only
then renamed to `checkpoints/checkpoint-N` (a rename within one file system is atomic). A kill or a full disk
during the save leaves at most a staging folder, which the next run deletes; the newest complete checkpoint
is untouched. Pure Python: no torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lorafit.errors import TrainError
from lorafit.files import fsync_dir, write_atomic

CHECKPOINTS = "checkpoints"
STAGING = ".staging"
PREFIX = "checkpoint-"
COMPLETE = "lorafit-checkpoint.json"  # written last: a checkpoint without it is not one
RUN_FILE = "lorafit-run.json"  # which run a folder holds, and the settings it trains with now
RUN_FILE_VERSION = 1


# --- files that never end up half written (lorafit.files writes single files) --------------------------
def _fsync_tree(folder: Path) -> None:
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


def clean_partial(output_dir: Path) -> None:
    """Remove what an interrupted save left: the staging folder and any incomplete checkpoint folder."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return
    shutil.rmtree(root / STAGING, ignore_errors=True)
    for path in root.iterdir():
        if path.name.startswith(".retired-") or (checkpoint_step(path) is not None and not is_complete(path)):
            shutil.rmtree(path, ignore_errors=True)


# --- which run a folder holds ---------------------------------------------------------------------------------
def data_digest(paths: list[Path]) -> str:
    """sha256 over the data files, so that rerunning on changed data is not mistaken for the same run."""
    digest = hashlib.sha256()
    for path in paths:
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            digest.update(file.name.encode())
            with open(file, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def read_run_file(output_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((Path(output_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_run_file(output_dir: Path, data: dict[str, Any]) -> None:
    write_atomic(Path(output_dir) / RUN_FILE, json.dumps({"version": RUN_FILE_VERSION} | data, indent=2))


@dataclass(frozen=True)
class RunStart:
    """How a run begins in its folder: fresh, or from a checkpoint (with the saved run's settings)."""

    mode: Literal["fresh", "resume"]
    checkpoint: Path | None = None
    saved: dict[str, Any] | None = None
    note: str | None = None


def _differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    keys = sorted(set(saved) | set(current))
    return [key for key in keys if saved.get(key) != current.get(key)]


def begin(
    output_dir: Path, fingerprint: dict[str, Any], *, resume: bool, overwrite: bool, dry_run: bool = False
) -> RunStart:
    """Decide fresh or resume, refusing to touch a folder that holds something else.

    Same run (same fingerprint) with a checkpoint: resume, as `--resume` does. Another run: refuse unless
    `--resume` (continue it with this command's settings) or `--overwrite` (delete it). A folder with files
    that are not a lorafit run is never deleted. `dry_run`: the same decision, with nothing deleted."""
    output_dir = Path(output_dir)
    if resume and overwrite:
        raise TrainError("--resume continues the run in the output dir and --overwrite deletes it; pick one")
    if output_dir.exists() and not output_dir.is_dir():
        raise TrainError(f"--output-dir {output_dir} is a file, not a folder")
    entries = list(output_dir.iterdir()) if output_dir.is_dir() else []
    saved = read_run_file(output_dir)
    if not entries:
        if resume:
            raise TrainError(f"nothing to resume: {output_dir} holds no run")
        return RunStart("fresh")
    if saved is None:
        raise TrainError(
            f"{output_dir} holds files that are not a lorafit run; lorafit will not write into or delete it, "
            "pick another --output-dir"
        )
    if overwrite and dry_run:
        return RunStart("fresh", note=f"--overwrite would delete the previous run in {output_dir}")
    if overwrite:
        for entry in entries:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        return RunStart("fresh", note=f"--overwrite: deleted the previous run in {output_dir}")
    if not dry_run:
        clean_partial(output_dir)
    checkpoint = latest_checkpoint(output_dir)
    changed = _differences(saved.get("fingerprint", {}), fingerprint)
    if changed and not resume and checkpoint is None and saved.get("status") != "finished":
        return RunStart("fresh", note=f"{output_dir} holds a run that never reached a checkpoint: starting over")
    if changed and not resume:
        raise TrainError(
            f"{output_dir} holds another run (it differs in {', '.join(changed)}); pass --resume to continue it "
            "with these settings, --overwrite to replace it, or another --output-dir"
        )
    if checkpoint is None:
        if resume:
            raise TrainError(
                f"nothing to resume: {output_dir} has no complete checkpoint yet; rerun without --resume to start over"
            )
        return RunStart("fresh", saved=saved, note=f"{output_dir} has no checkpoint yet: starting over")
    note = f"resuming from {checkpoint.name}"
    if changed:
        note += f" (with changed {', '.join(changed)})"
    return RunStart("resume", checkpoint=checkpoint, saved=saved, note=note)


def keep_metrics_until(path: Path, step: int) -> None:
    """Drop the metrics lines past the checkpoint a run resumes from: those steps are trained again."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by the kill
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line)
    write_atomic(path, "".join(f"{line}\n" for line in kept))
