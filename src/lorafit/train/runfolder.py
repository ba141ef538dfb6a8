"""The run folder: one run at a time in it, what the run writes there before step 1, and the files it leaves.

`checkpoints` decides which run a folder holds (`checkpoints.begin`) and writes its checkpoints; this module is
the rest of the folder's life: the lock (`hold`), the identity of a run (`fingerprint`), the files that let it
resume or be reproduced (plan.json, plan.yaml, config.yaml, lorafit-run.json) and the adapter's pointer to its
base. Pure Python: no torch here.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lorafit.errors import TrainError
from lorafit.files import write_atomic
from lorafit.schema import Plan
from lorafit.train import checkpoints
from lorafit.train.config import SETTINGS_KEYS, TrainConfig, portable_yaml
from lorafit.train.distributed import LAUNCH_KEYS

METRICS = "metrics.jsonl"
LOCK = checkpoints.LOCK  # inside the run folder while a run writes it; `checkpoints.begin` looks past it


# --- one run per folder ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def hold(output_dir: Path) -> Iterator[None]:
    """Hold the run folder for one run: an exclusive `flock` on LOCK inside it, so that a second run into the
    same folder stops in one line naming the process that has it. The kernel lets go of the lock when its
    process ends, however it ends, so the file a killed run leaves blocks nothing. A path that is not a folder
    of a lorafit run (a file, someone's files) is not locked, nor written: `checkpoints.begin` refuses it; nor
    one that cannot be written, which `begin` names in one line. A folder made here and left empty (the run was
    refused before writing anything) is removed again."""
    output_dir = Path(output_dir)
    if not _lockable(output_dir):
        yield
        return
    made = _missing(output_dir)
    fd = None
    try:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            fd = _take(output_dir / LOCK, output_dir)
        except OSError:
            pass  # cannot be written: `checkpoints.begin` says why
        yield
    finally:
        if fd is not None:
            _release(fd, output_dir / LOCK)
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if empty


def _lockable(output_dir: Path) -> bool:
    try:
        if not output_dir.is_dir():
            return not output_dir.exists() and not output_dir.is_symlink()
        others = [entry for entry in output_dir.iterdir() if entry.name != LOCK]
    except OSError:
        return False
    return not others or checkpoints.read_run_file(output_dir) is not None


def _missing(output_dir: Path) -> list[Path]:
    """The folders `mkdir(parents=True)` would make for `output_dir`, deepest first."""
    missing = []
    folder = output_dir.absolute()
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _take(path: Path, output_dir: Path) -> int:
    """The locked file descriptor of `path`, with this process's id written in it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise TrainError(
                f"{output_dir} is in use by another lorafit run ({holder}); wait for it to end, or pick another "
                "--output-dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)  # the holder let go and removed the file between the open and the lock: take the new one


def _holder(fd: int) -> str:
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return f"pid {text}" if text.isdigit() else "a process that is starting"


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _release(fd: int, path: Path) -> None:
    """Remove the lock file, then let go of the lock: a run waiting on it takes the next file (`_take`)."""
    try:
        if _same_file(fd, path):
            with contextlib.suppress(OSError):
                path.unlink()
    finally:
        os.close(fd)


# --- which run: what makes two runs the same ------------------------------------------------------------------
def fingerprint(config: TrainConfig, model_dir: Path, data_path: Path, eval_path: Path | None) -> dict[str, Any]:
    """What the same run has the same of: its config (but where it was launched from), model and data."""
    data_files = [data_path] + ([eval_path] if eval_path else [])
    same_run = {key: value for key, value in config.fingerprint().items() if key not in LAUNCH_KEYS}
    return same_run | {"model": str(model_dir), "data_sha256": checkpoints.data_digest(data_files)}


def reads(model_dir: Path, data_path: Path, eval_path: Path | None, *, built: bool) -> tuple[Path, ...]:
    """What the run reads, which --overwrite must never delete (the demo's base is rebuilt, so not that)."""
    return tuple(path for path in (data_path, eval_path, None if built else model_dir) if path is not None)


# --- before step 1 ----------------------------------------------------------------------------------------------
def start_fresh(output_dir: Path, fingerprint: dict[str, Any]) -> None:
    """The folder of a fresh run: made, no metrics of an earlier start, and the run file that claims it."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / METRICS).unlink(missing_ok=True)
    checkpoints.write_run_file(output_dir, {"fingerprint": fingerprint, "status": "started"})


def record_base(output_dir: Path, model_dir: Path) -> None:
    """What the adapter is trained against: `lorafit export` refuses another base."""
    saved = checkpoints.read_run_file(output_dir) or {}
    checkpoints.write_run_file(output_dir, saved | {"base_digest": checkpoints.model_digest(model_dir)})


def record_eval_before(output_dir: Path, eval_before: float) -> None:
    """The eval loss before step 1, which a resumed run reports as its own "before"."""
    saved = checkpoints.read_run_file(output_dir) or {}
    checkpoints.write_run_file(output_dir, saved | {"eval_before": eval_before})


def saved_plan(output_dir: Path) -> Plan | None:
    path = output_dir / "plan.json"
    return Plan.load(path) if path.is_file() else None


def save_plan(output_dir: Path, plan: Plan) -> None:
    write_atomic(output_dir / "plan.json", plan.to_json())
    write_atomic(output_dir / "plan.yaml", plan.to_yaml())


def resolved_config(config: TrainConfig, plan: Plan) -> TrainConfig:
    """The config with every setting filled in from the plan: rerunning it needs no planning."""
    settings = plan.settings.model_dump()
    return config.model_copy(update={key: settings[key] for key in SETTINGS_KEYS} | {"batch_size": plan.batch_size})


def save_run(
    output_dir: Path,
    config: TrainConfig,
    plan: Plan,
    fingerprint: dict[str, Any],
    saved: dict[str, Any] | None,
    status: str,
    **extra: Any,
) -> None:
    """plan.json, plan.yaml, the resolved config.yaml and the run file with `status`: what resumes or reproduces
    the run. The eval loss before training and the base's digest, once recorded, are kept."""
    save_plan(output_dir, plan)
    write_atomic(output_dir / "config.yaml", portable_yaml(resolved_config(config, plan), output_dir))
    current = checkpoints.read_run_file(output_dir) or saved or {}
    kept = {key: value for key, value in current.items() if key in ("eval_before", "base_digest")}
    checkpoints.write_run_file(output_dir, kept | {"fingerprint": fingerprint, "status": status} | extra)


# --- after the last step ------------------------------------------------------------------------------------------
def drop_empty_staging(output_dir: Path) -> None:
    with contextlib.suppress(OSError):
        checkpoints.staging_root(output_dir).rmdir()  # empty once every checkpoint is published


def point_adapter_at(output_dir: Path, model_dir: Path) -> None:
    """adapter_config.json names the base by absolute path, so PeftModel.from_pretrained finds it anywhere."""
    path = output_dir / "adapter_config.json"
    data = json.loads(path.read_text())
    data["base_model_name_or_path"] = str(model_dir)
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True))
