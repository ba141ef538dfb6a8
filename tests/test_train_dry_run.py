"""`lorafit train --dry-run`: every check and automatic choice of a run, printed, with nothing written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from lorafit.options import STEP_KEYS, TrainConfig
from lorafit.train.config import PATH_KEYS
from test_train import lorafit, tiny, train_args  # noqa: F401 (tiny is a fixture)


def listing(folder: Path) -> dict[str, int]:
    return {str(path.relative_to(folder)): path.stat().st_size for path in sorted(folder.rglob("*"))}


def printed_config(out: str) -> dict:
    """The YAML `--dry-run` prints after 'resolved config'."""
    text = out.split("exactly this):", 1)[1].split("dry run:", 1)[0]
    return yaml.safe_load(text)


@pytest.mark.slow
def test_a_dry_run_writes_nothing_and_prints_the_config_the_run_then_saves(
    tiny: dict[str, Path],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "run"
    code, printed, err = lorafit(train_args(tiny, out, "--max-steps", "1", "--dry-run"), capsys)
    assert code == 0, err
    assert not out.exists()
    assert "nothing was written" in printed
    # every automatic choice is made and said: the device, the precision on a CPU, the batching
    assert "precision fp32: no GPU, training on the CPU" in printed
    assert "batching length_grouped" in printed
    resolved = printed_config(printed)
    assert all(resolved[key] is not None for key in STEP_KEYS if key in TrainConfig.model_fields)
    assert resolved["precision"] == "fp32" and resolved["micro_batch"] == 4 and resolved["grad_accum"] == 2

    code, _, err = lorafit(train_args(tiny, out, "--max-steps", "1"), capsys)
    assert code == 0, err
    kept = yaml.safe_load((out / "config.yaml").read_text())
    # the run folder names its paths from itself (it is shared); they are the same files
    paths = {key: os.path.normpath(out / kept[key]) for key in PATH_KEYS if kept.get(key) is not None}
    assert kept | paths == resolved | {key: os.path.normpath(resolved[key]) for key in paths}
    saved = yaml.safe_load((out / "plan.yaml").read_text())
    assert (saved["device"], saved["batching"], saved["gpu"]) == ("cpu", "length_grouped", None)

    # a dry run over the finished run, even with --overwrite, deletes nothing
    before = listing(out)
    code, printed, err = lorafit(train_args(tiny, out, "--max-steps", "1", "--overwrite", "--dry-run"), capsys)
    assert code == 0, err
    assert "--overwrite would delete the previous run" in printed
    assert listing(out) == before


@pytest.mark.slow
def test_the_demo_dry_run_builds_its_model_where_nothing_stays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo"
    code, printed, err = lorafit(["train", "--demo", "--dry-run", "--output-dir", str(out)], capsys)
    assert code == 0, err
    assert not out.exists()
    resolved = printed_config(printed)
    assert resolved["max_steps"] == 300 and resolved["method"] == "qlora"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--data", "/nonexistent/data.jsonl"], "no dataset at /nonexistent/data.jsonl"),
        (["--output-dir", "/proc/lorafit-run"], "cannot write to --output-dir /proc/lorafit-run"),
        (["--precision", "fp16"], "precision fp16 needs a CUDA GPU"),
        (["--micro-batch", "3"], "micro_batch 3 does not divide batch_size 16"),
        (["--eval-split", "1000"], "eval_split 1000"),
    ],
)
def test_a_dry_run_refuses_what_the_run_would_refuse(
    extra: list[str],
    message: str,
    tiny: dict[str, Path],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = train_args(tiny, tmp_path / "run", "--dry-run")
    if "--micro-batch" in extra:
        args[args.index("--micro-batch") : args.index("--micro-batch") + 4] = []  # drop --micro-batch 4 --grad-accum 2
    code, out, err = lorafit([*args, *extra], capsys)
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "run").exists()
