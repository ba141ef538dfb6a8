"""The run folder: which run it holds, its checkpoints, and files written so that a kill never breaks them.

A checkpoint is written into `checkpoints/.staging/checkpoint-N`, flushed to disk, marked complete, and only
then renamed to `checkpoints/checkpoint-N` (a rename within one file system is atomic). A kill or a full disk
during the save leaves at most a staging folder, which the next run deletes; the newest complete checkpoint
is untouched. Pure Python: no torch here.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, ParamSpec, TypeVar

from lorafit.errors import TrainError
from lorafit.files import fsync_dir, ordinary_mode, write_atomic

CHECKPOINTS = "checkpoints"
STAGING = ".staging"
PREFIX = "checkpoint-"
COMPLETE = "lorafit-checkpoint.json"  # written last: a checkpoint without it is not one
RUN_FILE = "lorafit-run.json"  # which run a folder holds, and the settings it trains with now
RUN_FILE_VERSION = 1
LOCK = ".lorafit-lock"  # held by the run writing the folder (`runfolder.hold`); not one of the run's files
FINAL_WEIGHTS = ("adapter_model.safetensors", "model.safetensors")  # what a finished run leaves (LoRA / full)
# torch's checkpoint writer reports a full disk without an errno ("unexpected pos 576 vs 534"); when it fails
# with less than this free on the file system, the disk is what ran out.
NEARLY_FULL_BYTES = 64 * 2**20

_P = ParamSpec("_P")
_R = TypeVar("_R")


# --- files that never end up half written (lorafit.files writes single files) --------------------------
def _fsync_tree(folder: Path) -> None:
    ordinary_mode(folder)
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    fsync_dir(folder)


# --- writes that fail ---------------------------------------------------------------------------------------
ERRNO_WORDS = {
    errno.ENOSPC: "no space left on device (the disk is full)",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}


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


def resume_hint(output_dir: Path, first: str = "") -> str:
    """What the folder holds to go on from, and the command that does (after `first`: "free space")."""
    newest = latest_checkpoint(output_dir)
    rerun = f"{first} and rerun the same command" if first else "rerun the same command"
    if newest is None:
        return f"there is no checkpoint yet: {rerun} to start over"
    return f"{newest.name} is intact: {rerun} to resume from it"


def fix_for(reason: str) -> str:
    """What a person does about a failed write, given its reason in words ("" when nothing general helps)."""
    if reason.startswith(("no space", "disk quota")):
        return "free space"
    if reason.startswith(("read-only", "permission")):
        return "make it writable"
    return ""


class ReportedInterrupt(KeyboardInterrupt):
    """Ctrl-C, with where the run stopped already told (by the trainer, which knows the step)."""


def interrupted_note(output_dir: Path) -> str | None:
    """What to say after Ctrl-C outside the training loop: how to go on, or nothing when the folder holds no
    run yet or its finished one."""
    saved = read_run_file(output_dir)
    if saved is None or _finished(Path(output_dir), saved):
        return None
    return f"interrupted: {resume_hint(output_dir)}"


def one_line_run_errors(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """A run whose folder cannot be written (full disk, read-only, gone) ends in one line that names the path
    and what to do, and Ctrl-C says how to go on (and stays an interrupt: exit code 130).
    `config.output_dir` of the first argument is the run folder; `console=` is where the note goes."""

    @functools.wraps(function)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        output_dir = Path(getattr(args[0], "output_dir", ".")).expanduser() if args else Path(".")
        try:
            return function(*args, **kwargs)
        except TrainError:
            raise
        except ReportedInterrupt:
            raise
        except KeyboardInterrupt:
            note = interrupted_note(output_dir)
            if note:
                from rich.console import Console

                console = kwargs.get("console") or Console(highlight=False)
                console.print(note)
            raise
        except Exception as error:
            reason = write_failure(error, output_dir)
            if reason is None:
                raise
            path = Path(getattr(error, "filename", None) or output_dir)
            verb = "write" if _inside(path, output_dir) else "use"  # a model or data file can fail to read too
            hint = resume_hint(output_dir, fix_for(reason))
            raise TrainError(f"cannot {verb} {path}: {reason}; {hint}") from None

    return wrapper


def check_link(output_dir: Path) -> None:
    """A symbolic link on the way to the output folder that loops or points nowhere: say which, and what to do
    (pathlib reports both as "does not exist", and creating the folder then fails with "file exists")."""
    try:
        os.path.realpath(output_dir, strict=True)
    except FileNotFoundError:
        pass  # nothing there yet: unless a link points nowhere, the folder is created
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise TrainError(
                f"--output-dir {output_dir}: a symbolic link on the way loops back on itself; remove the link or "
                "pick another --output-dir"
            ) from None
        return  # unreadable: the write probe says why
    existing = Path(output_dir)
    while not existing.is_symlink() and existing != existing.parent and not existing.exists():
        existing = existing.parent
    if existing.is_symlink() and not existing.exists():
        raise TrainError(
            f"--output-dir {output_dir}: the symbolic link {existing} points to {os.readlink(existing)}, which does "
            f"not exist; create that folder, remove the link, or pick another --output-dir"
        )


def check_writable(output_dir: Path) -> None:
    """The output folder, or the nearest folder above it that exists, must take a new file: probed with a
    temporary file that never shows in the listing (permission bits say nothing for root, or under /proc), so
    that a read-only or impossible folder is one line before a model is loaded, not a traceback later."""
    existing = Path(output_dir).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        reason = write_failure(error, existing)
        where = "" if existing == Path(output_dir).absolute() else f" (in {existing})"
        raise TrainError(f"cannot write to --output-dir {output_dir}{where}: {reason}; pick another folder") from None


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


def model_digest(model_dir: Path) -> str:
    """sha256 over a model folder's config.json and the headers and sizes of its safetensors files: names,
    shapes, dtypes and offsets of every tensor, read in milliseconds, so that an export can tell that the base
    a run trained on was replaced (a full hash of 15 GB would take minutes)."""
    digest = hashlib.sha256()
    model_dir = Path(model_dir)
    config = model_dir / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as handle:
            head = handle.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else 0
            digest.update(path.name.encode() + head + handle.read(min(length, 100 * 2**20)))
        digest.update(str(path.stat().st_size).encode())
    return digest.hexdigest()


def shown_path(path: Path | str, output_dir: Path) -> str:
    """A path as the run folder's README shows it to whoever it is shared with: a file inside the run as
    `RUN/...`, a path the user gave relative as given, and an absolute one outside the run by its name."""
    given, run = Path(path).expanduser(), Path(output_dir).expanduser()
    if _inside(given, run):
        return str(Path(run.resolve().name) / given.resolve().relative_to(run.resolve()))
    return str(path) if not Path(path).is_absolute() else given.name


def read_run_file(output_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((Path(output_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_run_file(output_dir: Path, data: dict[str, Any]) -> None:
    if "fingerprint" in data:
        data = data | {"fingerprint": portable(data["fingerprint"])}
    write_atomic(Path(output_dir) / RUN_FILE, json.dumps({"version": RUN_FILE_VERSION} | data, indent=2))


@dataclass(frozen=True)
class RunStart:
    """How a run begins in its folder: fresh, or from a checkpoint (with the saved run's settings)."""

    mode: Literal["fresh", "resume", "finished"]
    checkpoint: Path | None = None
    saved: dict[str, Any] | None = None
    note: str | None = None


def _saved_settings(output_dir: Path) -> dict[str, Any]:
    """The settings the run in `output_dir` trains with (its plan.json), as plain values."""
    try:
        settings = json.loads((Path(output_dir) / "plan.json").read_text()).get("settings", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return settings if isinstance(settings, dict) else {}


def _differences(saved: dict[str, Any], current: dict[str, Any], resolved: dict[str, Any]) -> list[str]:
    """Keys whose values differ. A setting that the saved run left to the plan (or the out-of-memory guard
    changed) matches when it is now given as the value the run uses: its resolved config.yaml, rerun into
    its own folder, is the same run."""
    keys = sorted(set(saved) | set(current))
    return [
        key
        for key in keys
        if saved.get(key) != current.get(key) and not (key in resolved and current.get(key) == resolved[key])
    ]


PATH_KEYS = ("model", "data", "eval_data")


def portable(fingerprint: Any) -> dict[str, Any]:
    """A fingerprint as the run file keeps it: the model and data by their names, not by paths of this machine
    (the run folder is shared, and its config.yaml names them from the folder). Which files they are,
    `base_digest` and `data_sha256` say."""
    if not isinstance(fingerprint, dict):
        return {}
    named = {key: Path(str(fingerprint[key])).name for key in PATH_KEYS if fingerprint.get(key)}
    return fingerprint | named


def _changed(saved: dict[str, Any], fingerprint: dict[str, Any], output_dir: Path) -> list[str]:
    """The keys in which this run differs from the saved one. A run file of an earlier lorafit names its model
    by absolute path, compared as such; a newer one by name, and the model's digest then tells a base
    replaced or another one of the same name."""
    found = saved.get("fingerprint")
    saved_fingerprint: dict[str, Any] = found if isinstance(found, dict) else {}
    if os.path.isabs(str(saved_fingerprint.get("model", ""))):
        return _differences(saved_fingerprint, fingerprint, _saved_settings(output_dir))
    changed = _differences(portable(saved_fingerprint), portable(fingerprint), _saved_settings(output_dir))
    model, digest = Path(str(fingerprint.get("model", ""))), saved.get("base_digest")
    if "model" not in changed and digest and (model / "config.json").is_file() and model_digest(model) != digest:
        changed = sorted([*changed, "model"])
    return changed


def _finished(output_dir: Path, saved: dict[str, Any]) -> bool:
    return saved.get("status") == "finished" and any((output_dir / name).is_file() for name in FINAL_WEIGHTS)


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def _delete_run(output_dir: Path, entries: list[Path]) -> None:
    """Delete a run's files, its run file last: an interrupted delete leaves a folder that is still a run,
    which the next --overwrite finishes deleting, never one lorafit no longer recognises."""
    run_file = output_dir / RUN_FILE
    for entry in sorted(entries, key=lambda path: path == run_file):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def begin(
    output_dir: Path,
    fingerprint: dict[str, Any],
    *,
    resume: bool,
    overwrite: bool,
    inputs: tuple[Path, ...] = (),
    dry_run: bool = False,
) -> RunStart:
    """Decide fresh, resume or finished, refusing to touch a folder that holds something else.

    Same run (same fingerprint): finished if it wrote its outputs (nothing is changed), else resume from its
    newest checkpoint, as `--resume` does. Another run: refuse unless `--resume` (continue it with this
    command's settings) or `--overwrite` (delete it). A folder with files that are not a lorafit run is never
    deleted, nor one that holds `inputs` (the model or data this run reads). `dry_run`: the same decision, with
    nothing deleted or cleaned."""
    output_dir = Path(output_dir)
    if resume and overwrite:
        raise TrainError("--resume continues the run in the output dir and --overwrite deletes it; pick one")
    check_link(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise TrainError(f"--output-dir {output_dir} is a file, not a folder")
    entries = [entry for entry in output_dir.iterdir() if entry.name != LOCK] if output_dir.is_dir() else []
    saved = read_run_file(output_dir)
    if not entries:
        if resume:
            raise TrainError(f"nothing to resume: {output_dir} holds no run")
        check_writable(output_dir)
        return RunStart("fresh")
    if saved is None:
        raise TrainError(
            f"{output_dir} holds files that are not a lorafit run; lorafit will not write into or delete it, "
            "pick another --output-dir"
        )
    changed = _changed(saved, fingerprint, output_dir)
    if not changed and not overwrite and _finished(output_dir, saved):
        steps = saved.get("steps")
        return RunStart(
            "finished",
            saved=saved,
            note=f"{output_dir} holds this run, finished{f' after {steps} steps' if steps else ''}: its outputs "
            "(adapter or model, metrics.jsonl, loss.png, README.md) are there and nothing was changed; pass "
            "--overwrite to train it again from the start",
        )
    check_writable(output_dir)
    if overwrite:
        kept = [path for path in inputs if _inside(path, output_dir)]
        if kept:
            raise TrainError(
                f"--overwrite would delete {kept[0]}, which this run reads; move it out of {output_dir} first"
            )
        if dry_run:
            return RunStart("fresh", note=f"--overwrite would delete the previous run in {output_dir}")
        _delete_run(output_dir, entries)
        return RunStart("fresh", note=f"--overwrite: deleted the previous run in {output_dir}")
    if not dry_run:
        clean_partial(output_dir)
    checkpoint = latest_checkpoint(output_dir)
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
