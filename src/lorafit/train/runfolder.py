"""The run folder: which run it holds, one run at a time in it, and the files a run writes there and leaves.

`begin` decides which run a folder holds (fresh, resumed or finished) and refuses a folder that holds something
else; the lock (`hold`) keeps a second run out while one writes it; the identity of a run (`fingerprint`) and the
files that let it resume or be reproduced (plan.json, plan.yaml, config.yaml, lorafit-run.json) are written
here, and the adapter's pointer to its base. `checkpoints` writes its checkpoints; `failures` words a failed
write. Pure Python: no torch here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, ParamSpec, TypeVar

from lorafit.errors import TrainError
from lorafit.files import write_atomic
from lorafit.schema import Plan
from lorafit.train import checkpoints
from lorafit.train.config import SETTINGS_KEYS, TrainConfig, portable_yaml
from lorafit.train.distributed import LAUNCH_KEYS
from lorafit.train.failures import ReportedInterrupt, fix_for, write_failure

METRICS = "metrics.jsonl"
RUN_FILE = "lorafit-run.json"  # which run a folder holds, and the settings it trains with now
RUN_FILE_VERSION = 1
LOCK = ".lorafit-lock"  # held by the run writing the folder (`hold`); not one of the run's files: `begin` looks past it
FINAL_WEIGHTS = ("adapter_model.safetensors", "model.safetensors")  # what a finished run leaves (LoRA / full)

_P = ParamSpec("_P")
_R = TypeVar("_R")


# --- one run per folder ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def hold(output_dir: Path) -> Iterator[None]:
    """Hold the run folder for one run: an exclusive `flock` on LOCK inside it, so that a second run into the
    same folder stops in one line naming the process that has it. The kernel lets go of the lock when its
    process ends, however it ends, so the file a killed run leaves blocks nothing. A path that is not a folder
    of a lorafit run (a file, someone's files) is not locked, nor written: `begin` refuses it; nor one that
    cannot be written, which `begin` names in one line. A folder made here and left empty (the run was refused
    before writing anything) is removed again."""
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
            pass  # cannot be written: `begin` says why
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
    return not others or read_run_file(output_dir) is not None


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
    return same_run | {"model": str(model_dir), "data_sha256": data_digest(data_files)}


def reads(model_dir: Path, data_path: Path, eval_path: Path | None, *, built: bool) -> tuple[Path, ...]:
    """What the run reads, which --overwrite must never delete (the demo's base is rebuilt, so not that)."""
    return tuple(path for path in (data_path, eval_path, None if built else model_dir) if path is not None)


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


# --- which run a folder holds ---------------------------------------------------------------------------------
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
        checkpoints.clean_partial(output_dir)
    checkpoint = checkpoints.latest_checkpoint(output_dir)
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


# --- before step 1 ----------------------------------------------------------------------------------------------
def start_fresh(output_dir: Path, fingerprint: dict[str, Any]) -> None:
    """The folder of a fresh run: made, no metrics of an earlier start, and the run file that claims it."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / METRICS).unlink(missing_ok=True)
    write_run_file(output_dir, {"fingerprint": fingerprint, "status": "started"})


def record_base(output_dir: Path, model_dir: Path) -> None:
    """What the adapter is trained against: `lorafit export` refuses another base."""
    saved = read_run_file(output_dir) or {}
    write_run_file(output_dir, saved | {"base_digest": model_digest(model_dir)})


def record_eval_before(output_dir: Path, eval_before: float) -> None:
    """The eval loss before step 1, which a resumed run reports as its own "before"."""
    saved = read_run_file(output_dir) or {}
    write_run_file(output_dir, saved | {"eval_before": eval_before})


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
    current = read_run_file(output_dir) or saved or {}
    kept = {key: value for key, value in current.items() if key in ("eval_before", "base_digest")}
    write_run_file(output_dir, kept | {"fingerprint": fingerprint, "status": status} | extra)


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


def shown_path(path: Path | str, output_dir: Path) -> str:
    """A path as the run folder's README shows it to whoever it is shared with: a file inside the run as
    `RUN/...`, a path the user gave relative as given, and an absolute one outside the run by its name."""
    given, run = Path(path).expanduser(), Path(output_dir).expanduser()
    if _inside(given, run):
        return str(Path(run.resolve().name) / given.resolve().relative_to(run.resolve()))
    return str(path) if not Path(path).is_absolute() else given.name


# --- a run that fails ----------------------------------------------------------------------------------------
def interrupted_note(output_dir: Path) -> str | None:
    """What to say after Ctrl-C outside the training loop: how to go on, or nothing when the folder holds no
    run yet or its finished one."""
    saved = read_run_file(output_dir)
    if saved is None or _finished(Path(output_dir), saved):
        return None
    return f"interrupted: {checkpoints.resume_hint(output_dir)}"


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
            hint = checkpoints.resume_hint(output_dir, fix_for(reason))
            raise TrainError(f"cannot {verb} {path}: {reason}; {hint}") from None

    return wrapper
