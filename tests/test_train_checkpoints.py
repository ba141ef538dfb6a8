"""The run folder without training: which run it holds (`runfolder`), how failed writes read (`failures`), and
deletes that a Ctrl-C cuts."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest

from lorafit.errors import TrainError
from lorafit.train import checkpoints, failures, runfolder

FINGERPRINT = {"method": "qlora", "micro_batch": None, "learning_rate": 0.0002, "data_sha256": "abc"}


def make_run(folder: Path, status: str = "finished", steps: int = 6, micro_batch: int = 4) -> Path:
    """A run folder as `lorafit train` leaves it: run file, plan, final adapter, one complete checkpoint."""
    folder.mkdir(parents=True)
    runfolder.write_run_file(folder, {"fingerprint": FINGERPRINT, "status": status, "steps": steps})
    (folder / "plan.json").write_text(json.dumps({"settings": {"method": "qlora", "micro_batch": micro_batch}}))
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    checkpoint = checkpoints.checkpoint_root(folder) / f"checkpoint-{steps}"
    checkpoint.mkdir(parents=True)
    (checkpoint / checkpoints.COMPLETE).write_text(json.dumps({"step": steps}))
    return folder


def listing(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


# --- which run a folder holds -------------------------------------------------------------------------------
def test_a_finished_run_is_reported_and_left_as_it_is(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    before = listing(run)
    for resume in (False, True):
        start = runfolder.begin(run, FINGERPRINT, resume=resume, overwrite=False)
        assert start.mode == "finished"
        assert str(run) in start.note and "finished after 6 steps" in start.note and "--overwrite" in start.note
    assert listing(run) == before


def test_a_finished_run_without_its_weights_resumes_from_its_last_checkpoint(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    (run / "adapter_model.safetensors").unlink()  # the final save never happened (killed, disk full)
    start = runfolder.begin(run, FINGERPRINT, resume=False, overwrite=False)
    assert start.mode == "resume" and start.checkpoint.name == "checkpoint-6"


def test_settings_given_as_the_values_the_run_uses_are_the_same_run(tmp_path: Path) -> None:
    """The resolved config.yaml pins what the plan chose: rerun into its own folder, it is the same run."""
    run = make_run(tmp_path / "run", micro_batch=4)
    assert runfolder.begin(run, FINGERPRINT | {"micro_batch": 4}, resume=False, overwrite=False).mode == "finished"
    with pytest.raises(TrainError, match="differs in micro_batch"):
        runfolder.begin(run, FINGERPRINT | {"micro_batch": 8}, resume=False, overwrite=False)


def test_overwrite_refuses_to_delete_what_the_run_reads(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    data = run / "my-data.jsonl"
    data.write_text('{"instruction": "q", "output": "a"}\n')
    before = listing(run)
    with pytest.raises(TrainError, match="which this run reads"):
        runfolder.begin(run, FINGERPRINT, resume=False, overwrite=True, inputs=(data,))
    assert listing(run) == before


def test_an_overwrite_cut_short_leaves_a_folder_the_next_overwrite_can_delete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C in the middle of --overwrite: the run file goes last, so the folder is still a run."""
    run = make_run(tmp_path / "run")
    for name in ("metrics.jsonl", "loss.png", "README.md"):
        (run / name).write_text(name)
    real_unlink, real_iterdir = Path.unlink, Path.iterdir
    deleted: list[str] = []

    def run_file_first(path: Path):  # noqa: ANN202 - the order a file system may list them in
        return iter(sorted(real_iterdir(path), key=lambda entry: entry.name != runfolder.RUN_FILE))

    def unlink(path: Path, missing_ok: bool = False) -> None:
        if len(deleted) == 2:
            raise KeyboardInterrupt
        deleted.append(path.name)
        real_unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    monkeypatch.setattr(Path, "iterdir", run_file_first)
    with pytest.raises(KeyboardInterrupt):
        runfolder.begin(run, FINGERPRINT, resume=False, overwrite=True)
    monkeypatch.setattr(Path, "unlink", real_unlink)
    assert runfolder.RUN_FILE not in deleted and (run / runfolder.RUN_FILE).is_file()
    start = runfolder.begin(run, FINGERPRINT, resume=False, overwrite=True)
    assert start.mode == "fresh" and list(run.iterdir()) == []


def test_an_output_folder_that_cannot_be_written_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TrainError, match="cannot write to --output-dir /proc/lorafit-run"):
        runfolder.begin(Path("/proc/lorafit-run"), FINGERPRINT, resume=False, overwrite=False)

    def read_only(*args: object, **kwargs: object) -> None:  # what the OS answers on a read-only mount
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path))

    monkeypatch.setattr(runfolder.tempfile, "TemporaryFile", read_only)
    with pytest.raises(TrainError, match="read-only file system"):
        runfolder.begin(tmp_path / "run", FINGERPRINT, resume=False, overwrite=False)
    assert not (tmp_path / "run").exists()


# --- how a failed write reads -------------------------------------------------------------------------------
def test_a_full_disk_reads_the_same_from_python_safetensors_and_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors import SafetensorError

    full = "no space left on device (the disk is full)"
    assert failures.write_failure(OSError(errno.ENOSPC, "No space left on device"), tmp_path) == full
    text = "Error while serializing: I/O error: No space left on device (os error 28)"  # safetensors 0.7, measured
    assert failures.write_failure(SafetensorError(text), tmp_path) == full
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")  # measured
    monkeypatch.setattr(failures, "free_bytes", lambda path: 4096)
    assert failures.write_failure(torch_error, tmp_path) == full
    monkeypatch.setattr(failures, "free_bytes", lambda path: 100 * 2**30)  # not the disk: torch's words
    assert "unexpected pos 576" in failures.write_failure(torch_error, tmp_path)
    assert failures.write_failure(ValueError("a bug"), tmp_path) is None  # not a write: not hidden


def test_a_failed_run_says_which_checkpoint_it_can_resume_from(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")

    class Config:
        output_dir = str(run)

    @runfolder.one_line_run_errors
    def fails(config: Config) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(run / "adapter_model.safetensors"))

    with pytest.raises(TrainError) as raised:
        fails(Config())
    message = str(raised.value)
    assert message.startswith(f"cannot write {run / 'adapter_model.safetensors'}: no space left on device")
    assert "checkpoint-6 is intact: free space and rerun the same command to resume from it" in message
    shutil.rmtree(checkpoints.checkpoint_root(run))
    with pytest.raises(TrainError, match="no checkpoint yet: free space and rerun the same command to start over"):
        fails(Config())
