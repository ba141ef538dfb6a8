"""One run per run folder: a second `lorafit train` into a folder that a run is writing stops in one line that
names the folder and the process, and the lock file a killed run leaves behind blocks nothing."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorafit.train import runfolder
from test_train import lorafit, metrics, one_line, tiny, train_args  # noqa: F401 (tiny is a fixture)


def wait_for_training(run: subprocess.Popen[str], out: Path) -> None:
    """Until the run has logged a step: it holds its folder and is writing it."""
    deadline = time.monotonic() + 240
    while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
        assert run.poll() is None, run.stderr.read()[-2000:] if run.stderr else run.returncode
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.slow
def test_a_second_run_into_a_folder_in_use_is_refused_and_a_killed_runs_lock_blocks_nothing(
    tiny: dict[str, Path],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-m", "lorafit.cli", *train_args(tiny, out, "--max-steps", "1000", "--eval-split", "0")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_training(first, out)
        # --overwrite would delete the folder under the first run: it must not get that far
        second = train_args(tiny, out, "--max-steps", "1", "--eval-split", "0", "--overwrite")
        code, _, err = lorafit(second, capsys)
        assert code == 2 and one_line(err), err
        assert f"{out} is in use by another lorafit run (pid {first.pid})" in err
        assert first.poll() is None  # still training, its folder whole
        assert (runfolder.read_run_file(out) or {}).get("status") == "training"
    finally:
        first.kill()
        first.wait()

    assert (out / runfolder.LOCK).is_file()  # left by the killed run: its lock went with its process
    code, printed, err = lorafit(second, capsys)
    assert code == 0, err
    assert "--overwrite: deleted the previous run" in printed
    assert [line["step"] for line in metrics(out)] == [1]
    assert not (out / runfolder.LOCK).exists()  # let go at the end


def test_a_refused_run_leaves_no_folder_behind(
    tiny: dict[str, Path],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The lock is taken in the folder before the run decides anything; a run refused then leaves nothing."""
    out = tmp_path / "new" / "run"
    code, _, err = lorafit(train_args(tiny, out, "--resume"), capsys)
    assert code == 2 and "nothing to resume" in err, err
    assert not (tmp_path / "new").exists()
