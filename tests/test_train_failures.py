"""`lorafit train` when things go wrong, on the tiny random Llama of test_train.py: out of memory (the micro-batch
halved, the same run), a full disk (the previous checkpoint kept, the rerun resumes) and bad input (one line,
exit 2, nothing written).
"""

from __future__ import annotations

import errno
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import test_train
from lorafit.schema import Plan
from lorafit.train import checkpoints, failures
from test_train import adapter_weights, lorafit, metrics, one_line, run_args, train_args

tiny = test_train.tiny  # the tiny model and data of test_train.py, a session fixture


# --- out of memory ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_out_of_memory_halves_the_micro_batch_and_gives_the_same_run(
    dropout: float,
    tiny: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Step 4 runs out of memory; the run goes on from step 3 at half the micro-batch. Without dropout the
    training loss (logged every 2 steps, so one line averages a step before and one after the retry), the
    eval loss (whose batches halve too) and the weights are those of a run without the error, to float
    rounding; with dropout the steps after the retry draw other masks, so they differ a little."""
    common = [
        "--micro-batch",
        "4",
        "--grad-accum",
        "1",
        "--max-steps",
        "6",
        "--save-steps",
        "100",
        "--lora-dropout",
        str(dropout),
        "--eval-split",
        "8",
        "--eval-steps",
        "2",
        "--logging-steps",
        "2",
    ]
    code, _, err = lorafit(train_args(tiny, tmp_path / "plain", *common), capsys)
    assert code == 0, err
    monkeypatch.setenv("LORAFIT_FAULT_OOM_AT_STEP", "4")
    code, out, err = lorafit(train_args(tiny, tmp_path / "oom", *common), capsys)
    assert code == 0, err
    assert "out of memory in step 4 at micro-batch 4" in out
    assert "continuing from step 3 with micro-batch 2 x grad-accum 2" in out
    settings = Plan.load(tmp_path / "oom" / "plan.json").settings
    assert (settings.micro_batch, settings.grad_accum) == (2, 2)
    assert settings.effective_batch == 4

    plain, oom = metrics(tmp_path / "plain"), metrics(tmp_path / "oom")
    assert [line["step"] for line in oom] == [line["step"] for line in plain] == [2, 4, 6]
    assert all("eval_loss" in line for line in oom)
    assert oom[0]["loss"] == plain[0]["loss"] and oom[0]["eval_loss"] == plain[0]["eval_loss"]  # before it
    ours, theirs = adapter_weights(tmp_path / "oom"), adapter_weights(tmp_path / "plain")
    difference = max((ours[name] - theirs[name]).abs().max().item() for name in ours)
    for key in ("loss", "eval_loss"):
        after, reference = [line[key] for line in oom[1:]], [line[key] for line in plain[1:]]
        if dropout == 0:
            assert after == pytest.approx(reference, rel=1e-5), key
        else:
            assert after == pytest.approx(reference, rel=0.05), key
    if dropout:
        assert [line["loss"] for line in oom[1:]] != pytest.approx([line["loss"] for line in plain[1:]], rel=1e-5)
    if dropout == 0:
        assert difference < 1e-5
    else:
        assert difference > 1e-5


def test_out_of_memory_at_micro_batch_1_is_one_line(
    tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAFIT_FAULT_OOM_AT_STEP", "1")
    args = run_args(tiny, tmp_path / "run", "--micro-batch", "1", "--grad-accum", "4", "--max-steps", "2")
    code, _, err = lorafit(args, capsys)
    assert code == 2
    assert err.count("\n") == 1 and "out of memory in step 1 at micro-batch 1" in err
    plan = Plan.load(tmp_path / "run" / "plan.json").settings
    assert plan.method == "qlora" and "--method qlora" not in err  # it is QLoRA already
    assert f"a shorter --seq-len (now {plan.seq_len})" in err
    assert ("--grad-ckpt" in err) != plan.grad_ckpt  # suggested only when it is off


# --- a full disk ------------------------------------------------------------------------------------------------
SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"  # measured, 0.7
TORCH_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"  # measured on a full tmpfs


def _full_disk(kind: str, path: object) -> Exception:
    """What each writer raises when the disk fills up under it (torch's names no errno)."""
    from safetensors import SafetensorError

    if kind == "python":
        return OSError(errno.ENOSPC, "No space left on device", str(path))
    return RuntimeError(TORCH_FULL) if kind == "torch" else SafetensorError(SAFETENSORS_FULL)


@pytest.mark.parametrize("kind", ["python", "torch", "safetensors"])
def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one_and_the_rerun_resumes(
    kind: str,
    tiny: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import peft.peft_model
    import torch

    real_save, real_safe_save = torch.save, peft.peft_model.safe_save_file

    def save(obj: object, path: object, *args: object, **kwargs: object) -> None:
        if "checkpoint-4" in str(path):
            raise _full_disk(kind, path)
        real_save(obj, path, *args, **kwargs)

    def safe_save(tensors: object, path: object, *args: object, **kwargs: object) -> None:
        if "checkpoint-4" in str(path):
            raise _full_disk(kind, path)
        real_safe_save(tensors, path, *args, **kwargs)

    run = tmp_path / "run"
    args = train_args(tiny, run, "--max-steps", "6", "--save-steps", "2", "--save-total-limit", "5")
    if kind == "safetensors":
        monkeypatch.setattr(peft.peft_model, "safe_save_file", safe_save)  # the adapter in the checkpoint
    else:
        monkeypatch.setattr(torch, "save", save)  # the optimizer state in the checkpoint
    monkeypatch.setattr(failures, "free_bytes", lambda path: 0, raising=False)  # full after the failed write
    code, _, err = lorafit(args, capsys)
    assert code == 2 and one_line(err)
    assert "cannot write checkpoint-4" in err and "no space left on device" in err
    assert "checkpoint-2 is intact: free space and rerun the same command to resume from it" in err
    assert [path.name for path in checkpoints.good_checkpoints(run)] == ["checkpoint-2"]
    assert not (run / "checkpoints" / checkpoints.STAGING).exists()  # nothing half written takes space

    monkeypatch.undo()  # space freed: the same command goes on
    code, out, err = lorafit(args, capsys)
    assert code == 0, err
    assert "resuming from checkpoint-2" in out
    assert [line["step"] for line in metrics(run)] == [1, 2, 3, 4, 5, 6]


def test_a_full_disk_during_the_final_save_is_one_line_and_the_rerun_finishes(
    tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import peft.peft_model

    run = tmp_path / "run"
    real_safe_save = peft.peft_model.safe_save_file

    def safe_save(tensors: object, path: object, *args: object, **kwargs: object) -> None:
        if Path(str(path)).parent == run:  # the adapter in the run folder, not in a checkpoint
            raise _full_disk("safetensors", path)
        real_safe_save(tensors, path, *args, **kwargs)

    args = train_args(tiny, run, "--max-steps", "4", "--save-steps", "2", "--eval-split", "0")
    monkeypatch.setattr(peft.peft_model, "safe_save_file", safe_save)
    code, _, err = lorafit(args, capsys)
    assert code == 2 and one_line(err)
    assert f"cannot write {run}: no space left on device" in err
    assert "checkpoint-4 is intact: free space and rerun the same command to resume from it" in err

    monkeypatch.undo()
    code, out, err = lorafit(args, capsys)
    assert code == 0, err
    assert "resuming from checkpoint-4" in out and "step 5" not in out
    assert (run / "adapter_model.safetensors").is_file()
    assert json.loads((run / "lorafit-run.json").read_text())["status"] == "finished"


# --- bad input: one line, exit 2, nothing written -----------------------------------------------------------
def _pickle_only(tiny: dict[str, Path], folder: Path) -> Path:
    import shutil

    shutil.copytree(tiny["model"], folder)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    return folder


def _changed_model(tiny: dict[str, Path], folder: Path, name: str, change: Callable[[Path], None]) -> Path:
    """A copy of the tiny model with one of its files changed."""
    shutil.copytree(tiny["model"], folder)
    change(folder / name)
    return folder


def _edit_json(**changes: object) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        path.write_text(json.dumps(json.loads(path.read_text()) | changes))

    return edit


def _edit_tensors(change: Callable[[dict], object]) -> Callable[[Path], None]:
    """A change to a safetensors file's tensors (a dict by name), written back in place."""

    def edit(path: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(path)
        change(tensors)
        save_file(tensors, path, metadata={"format": "pt"})

    return edit


def _cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _unknown_tokenizer(path: Path) -> None:
    """A tokenizer_config.json naming a class transformers does not have, and no tokenizer.json to fall back on."""
    settings = json.loads(path.read_text())
    settings.pop("backend", None)
    path.write_text(json.dumps(settings | {"tokenizer_class": "FlorpTokenizer"}))
    (path.parent / "tokenizer.json").unlink()


UP_PROJ = "model.layers.0.mlp.up_proj.weight"
QUANTISED = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
BAD_MODELS = {
    "missing tensor": (
        "model.safetensors",
        _edit_tensors(lambda tensors: tensors.pop("model.layers.1.mlp.down_proj.weight")),
        "lacks tensor model.layers.1.mlp.down_proj.weight in its weights",
    ),
    "tensor of another shape": (
        "model.safetensors",
        _edit_tensors(lambda tensors: tensors.update({UP_PROJ: tensors[UP_PROJ][:, :32].contiguous()})),
        f"tensor {UP_PROJ} has shape",
    ),
    "weights cut short": ("model.safetensors", _cut_in_half, "model.safetensors is cut short"),
    "quantization_config over 16-bit weights": (
        "config.json",
        _edit_json(quantization_config=QUANTISED),
        "config.json has a quantization_config (bitsandbytes) but the weights are unquantised",
    ),
    "unknown activation": (
        "config.json",
        _edit_json(hidden_act="florp"),
        "config.json: transformers cannot build this model: it names 'florp'",
    ),
    "unknown tokenizer class": ("tokenizer_config.json", _unknown_tokenizer, "tokenizer_class 'FlorpTokenizer'"),
    "tokenizer not JSON": ("tokenizer.json", lambda path: path.write_text("{ not json"), "tokenizer.json is not valid"),
}


BAD_INPUTS = {
    "missing model": (lambda tiny, tmp: ["--model", str(tmp / "nowhere")], "no model directory"),
    "corrupt config": (lambda tiny, tmp: ["--model", str(_corrupt(tiny, tmp / "corrupt"))], "not valid JSON"),
    "pickle only": (lambda tiny, tmp: ["--model", str(_pickle_only(tiny, tmp / "pickled"))], "--allow-pickle"),
    "rejected data": (lambda tiny, tmp: ["--data", str(_bad_data(tmp / "bad.jsonl"))], "lorafit data check"),
    "missing data": (lambda tiny, tmp: ["--data", str(tmp / "none.jsonl")], "no dataset"),
    "bad value": (lambda tiny, tmp: ["--method", "qlorra"], "method"),
    "batch larger than the data": (lambda tiny, tmp: ["--batch-size", "1000"], "more than the 46 training rows"),
    **{
        case: (
            lambda tiny, tmp, case=case: ["--model", str(_changed_model(tiny, tmp / "bad", *BAD_MODELS[case][:2]))],
            BAD_MODELS[case][2],
        )
        for case in BAD_MODELS
    },
}


def _corrupt(tiny: dict[str, Path], folder: Path) -> Path:
    import shutil

    shutil.copytree(tiny["model"], folder)
    (folder / "config.json").write_text("{ not json")
    return folder


def _bad_data(path: Path) -> Path:
    path.write_text('{"instruction": "hi", "output": "there"}\n{"instruction": "no answer"\n')
    return path


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(
    case: str, tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make, expected = BAD_INPUTS[case]
    out = tmp_path / "run"
    code, _, err = lorafit(run_args(tiny, out, "--max-steps", "1", *make(tiny, tmp_path)), capsys)
    assert code == 2 and one_line(err), err
    assert expected in err
    assert not out.exists()  # refused before anything was written
