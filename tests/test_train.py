"""`lorafit train` end to end on a tiny random Llama (2 layers, width 64, vocab 512) built here, on the CPU.

The runs are real: bitsandbytes NF4 base, peft adapters, transformers' Trainer. Step counts are small; the
kill-and-resume test runs real subprocesses and kills one with SIGKILL.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli
from lorafit.models import ModelSpec
from lorafit.schema import Plan, Settings
from lorafit.train import checkpoints

WORDS = [
    "the",
    "keeper",
    "paints",
    "a",
    "tower",
    "red",
    "blue",
    "green",
    "every",
    "spring",
    "while",
    "otters",
    "steal",
    "fish",
    "from",
    "nets",
    "and",
    "herons",
    "wait",
    "in",
    "salt",
    "pans",
    "tide",
    "turn",
]


def sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def write_alpaca(path: Path, rows: int, seed: int = 0) -> Path:
    """Questions and answers of very different lengths, so that batching and padding matter."""
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for _ in range(rows):
            handle.write(
                json.dumps({"instruction": sentence(rng, 2, 30), "input": "", "output": sentence(rng, 2, 40)}) + "\n"
            )
    return path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny model with its BPE tokenizer (trained on the bundled demo text) and a 48-row dataset."""
    from lorafit.train.demo import build_model, build_tokenizer, corpus, tiny_spec

    root = tmp_path_factory.mktemp("tiny")
    tokenizer = build_tokenizer(corpus(), vocab_size=512)
    build_model(root / "model", tokenizer, tiny_spec(len(tokenizer), hidden_size=64), seed=0)
    return {"root": root, "model": root / "model", "data": write_alpaca(root / "data.jsonl", 48)}


def lorafit(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run the CLI in this process: (exit code, stdout, stderr)."""
    from lorafit.train.guard import reset_injected_oom

    reset_injected_oom()
    return run_cli(args, capsys)


def train_args(tiny: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--model",
        str(tiny["model"]),
        "--data",
        str(tiny["data"]),
        "--output-dir",
        str(out),
        "--micro-batch",
        "4",
        "--grad-accum",
        "2",
        "--seed",
        "3",
        *extra,
    ]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def adapter_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def finished_run(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One QLoRA run of 6 steps with an eval split, shared by the tests that read its output folder."""
    out = tmp_path_factory.mktemp("runs") / "qlora"
    from io import StringIO

    from rich.console import Console

    from lorafit.train.config import load_config
    from lorafit.train.guard import reset_injected_oom
    from lorafit.train.recipe import run

    reset_injected_oom()
    args = {
        "model": str(tiny["model"]),
        "data": str(tiny["data"]),
        "output_dir": str(out),
        "micro_batch": 4,
        "grad_accum": 2,
        "seed": 3,
        "max_steps": 6,
        "save_steps": 3,
        "eval_split": 0.2,
    }
    text = StringIO()
    result = run(load_config(None, args), console=Console(file=text, width=120))
    return {"dir": out, "result": result, "output": text.getvalue(), "args": args}


# --- the output folder ----------------------------------------------------------------------------------------
def test_a_run_leaves_adapter_metrics_curve_plan_and_card(finished_run: dict, tiny: dict[str, Path]) -> None:
    run = finished_run["dir"]
    for name in (
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
        "plan.json",
        "plan.yaml",
        "config.yaml",
        "metrics.jsonl",
        "loss.png",
        "README.md",
    ):
        assert (run / name).is_file(), name
    lines = metrics(run)
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert all(isinstance(line["loss"], float) for line in lines)
    assert [line["step"] for line in lines if "eval_loss" in line] == [3, 6]
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    adapter = json.loads((run / "adapter_config.json").read_text())
    assert Path(adapter["base_model_name_or_path"]) == tiny["model"].resolve()
    plan = Plan.load(run / "plan.json")
    assert (plan.settings.method, plan.settings.quant, plan.settings.double_quant) == ("qlora", "nf4", True)
    assert (plan.settings.micro_batch, plan.settings.grad_accum) == (4, 2)
    assert plan.gpu is None  # this machine has no GPU: the plan's settings are used as they are
    assert "lorafit chat" in (run / "README.md").read_text()
    assert "no GPU" in finished_run["output"] and "done" in finished_run["output"]
    kept = [path.name for path in checkpoints.good_checkpoints(run)]
    assert kept == ["checkpoint-3", "checkpoint-6"]


def test_the_resolved_config_reruns_with_every_setting_filled(finished_run: dict) -> None:
    from lorafit.train.config import load_config

    config = load_config(finished_run["dir"] / "config.yaml", {})
    plan = Plan.load(finished_run["dir"] / "plan.json")
    assert config.lora_r == plan.settings.lora_r and config.seq_len == plan.settings.seq_len
    assert config.precision == "fp32"  # the CPU path


def test_training_lowered_the_held_out_loss(finished_run: dict) -> None:
    result = finished_run["result"]
    assert result.eval_after < result.eval_before


def test_chat_and_generate_answer_a_prompt(finished_run: dict, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = lorafit(
        ["chat", str(finished_run["dir"]), "--prompt", "the keeper paints", "--max-new-tokens", "8"], capsys
    )
    assert code == 0, err
    assert out.strip()
    code, again, _ = lorafit(
        ["generate", str(finished_run["dir"]), "-p", "the keeper paints", "--max-new-tokens", "8"], capsys
    )
    assert code == 0 and again == out  # greedy: the same answer


def test_the_adapter_loads_with_peft_alone(finished_run: dict) -> None:
    """PeftModel.from_pretrained on the output folder, in a process that never imports lorafit."""
    script = f"""
import json, sys, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
run = {str(finished_run["dir"])!r}
base_path = json.load(open(run + "/adapter_config.json"))["base_model_name_or_path"]
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), run)
tokenizer = AutoTokenizer.from_pretrained(run)
ids = tokenizer("the keeper paints a tower", return_tensors="pt")["input_ids"]
with torch.no_grad():
    tuned = model(input_ids=ids).logits
    with model.disable_adapter():
        base = model(input_ids=ids).logits
print(json.dumps({{"lorafit": "lorafit" in sys.modules, "changed": (tuned - base).abs().max().item()}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["lorafit"] is False
    assert answer["changed"] > 1e-4  # the trained adapter changes the logits


# --- the output folder is never clobbered -------------------------------------------------------------------
def test_another_run_in_the_same_folder_is_refused(
    finished_run: dict, tiny: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    before = (finished_run["dir"] / "adapter_model.safetensors").stat().st_mtime_ns
    code, _, err = lorafit(train_args(tiny, finished_run["dir"], "--max-steps", "6", "--lr", "0.001"), capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert "holds another run" in err and "learning_rate" in err
    assert (finished_run["dir"] / "adapter_model.safetensors").stat().st_mtime_ns == before


def test_a_folder_that_is_not_a_run_is_never_written(
    tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "thesis.txt").write_text("years of work")
    for flag in ([], ["--overwrite"]):
        code, _, err = lorafit(train_args(tiny, tmp_path, "--max-steps", "1", *flag), capsys)
        assert code == 2 and "not a lorafit run" in err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["thesis.txt"]


# --- exact resume after SIGKILL ---------------------------------------------------------------------------------
def test_a_killed_run_resumes_to_the_same_weights_and_curve(tiny: dict[str, Path], tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "lorafit.cli",
        *train_args(tiny, tmp_path / "run"),
        "--max-steps",
        "16",
        "--save-steps",
        "4",
        "--eval-split",
        "4",
        "--lora-dropout",
        "0.1",
    ]
    reference = [part if part != str(tmp_path / "run") else str(tmp_path / "reference") for part in command]
    done = subprocess.run(reference, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

    victim = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    marker = tmp_path / "run" / "checkpoints" / "checkpoint-8" / checkpoints.COMPLETE
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert victim.poll() is None, victim.stderr.read()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert not (tmp_path / "run" / "adapter_model.safetensors").exists()  # killed mid-training
    newest = checkpoints.latest_checkpoint(tmp_path / "run")
    assert newest is not None and checkpoints.checkpoint_step(newest) < 16

    resumed = subprocess.run(command, capture_output=True, text=True, timeout=300)  # the same command again
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from checkpoint-" in resumed.stdout

    ours, theirs = adapter_weights(tmp_path / "run"), adapter_weights(tmp_path / "reference")
    assert ours.keys() == theirs.keys()
    assert max((ours[name] - theirs[name]).abs().max().item() for name in ours) <= 1e-6
    curve = [(line["step"], line.get("loss"), line.get("eval_loss")) for line in metrics(tmp_path / "run")]
    assert curve == [
        (line["step"], line.get("loss"), line.get("eval_loss")) for line in metrics(tmp_path / "reference")
    ]
    assert [step for step, _, _ in curve] == list(range(1, 17))


# --- out of memory ----------------------------------------------------------------------------------------------
def test_out_of_memory_halves_the_micro_batch_and_gives_the_same_run(
    tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
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
        "0",
        "--eval-split",
        "0",
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
    assert [line["step"] for line in oom] == [1, 2, 3, 4, 5, 6]
    assert [line["loss"] for line in oom] == pytest.approx([line["loss"] for line in plain], rel=1e-5)
    ours, theirs = adapter_weights(tmp_path / "oom"), adapter_weights(tmp_path / "plain")
    assert max((ours[name] - theirs[name]).abs().max().item() for name in ours) < 1e-5


def test_out_of_memory_at_micro_batch_1_is_one_line(
    tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAFIT_FAULT_OOM_AT_STEP", "1")
    code, _, err = lorafit(
        [
            "train",
            "--model",
            str(tiny["model"]),
            "--data",
            str(tiny["data"]),
            "--output-dir",
            str(tmp_path / "run"),
            "--micro-batch",
            "1",
            "--grad-accum",
            "4",
            "--max-steps",
            "2",
        ],
        capsys,
    )
    assert code == 2
    assert err.count("\n") == 1 and "out of memory in step 1 at micro-batch 1" in err


# --- a full disk during a checkpoint -------------------------------------------------------------------------
def test_a_full_disk_keeps_the_previous_checkpoint_and_the_rerun_resumes(
    tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    real_save = torch.save

    def save(obj: object, path: object, *args: object, **kwargs: object) -> None:
        if "checkpoint-4" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_save(obj, path, *args, **kwargs)

    run = tmp_path / "run"
    args = train_args(tiny, run, "--max-steps", "6", "--save-steps", "2", "--save-total-limit", "5")
    monkeypatch.setattr(torch, "save", save)
    code, _, err = lorafit(args, capsys)
    assert code == 2
    assert err.count("\n") == 1
    assert "no space left on device" in err and "checkpoint-2 is intact" in err
    assert [path.name for path in checkpoints.good_checkpoints(run)] == ["checkpoint-2"]
    assert not list((run / "checkpoints").glob("**/checkpoint-4"))  # nothing half written

    monkeypatch.setattr(torch, "save", real_save)
    code, out, err = lorafit(args, capsys)  # space freed: the same command goes on
    assert code == 0, err
    assert "resuming from checkpoint-2" in out
    assert [line["step"] for line in metrics(run)] == [1, 2, 3, 4, 5, 6]


# --- bad input: one line, exit 2, nothing written -----------------------------------------------------------
def _pickle_only(tiny: dict[str, Path], folder: Path) -> Path:
    import shutil

    shutil.copytree(tiny["model"], folder)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    return folder


BAD_INPUTS = {
    "missing model": (lambda tiny, tmp: ["--model", str(tmp / "nowhere")], "no model directory"),
    "corrupt config": (lambda tiny, tmp: ["--model", str(_corrupt(tiny, tmp / "corrupt"))], "not valid JSON"),
    "pickle only": (lambda tiny, tmp: ["--model", str(_pickle_only(tiny, tmp / "pickled"))], "--allow-pickle"),
    "rejected data": (lambda tiny, tmp: ["--data", str(_bad_data(tmp / "bad.jsonl"))], "lorafit data check"),
    "missing data": (lambda tiny, tmp: ["--data", str(tmp / "none.jsonl")], "no dataset"),
    "bad value": (lambda tiny, tmp: ["--method", "qlorra"], "method"),
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
    args = [
        "train",
        "--model",
        str(tiny["model"]),
        "--data",
        str(tiny["data"]),
        "--output-dir",
        str(out),
        "--max-steps",
        "1",
        *make(tiny, tmp_path),
    ]
    code, _, err = lorafit(args, capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("lorafit: error:")
    assert expected in err
    assert not out.exists()  # refused before anything was written


# --- methods ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["lora", "full"])
def test_lora_and_full_fine_tuning(
    method: str, tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = lorafit(
        train_args(tiny, tmp_path / method, "--method", method, "--max-steps", "2", "--eval-split", "0"), capsys
    )
    assert code == 0, err
    plan = Plan.load(tmp_path / method / "plan.json")
    assert (plan.settings.method, plan.settings.quant) == (method, "none")
    weights = "adapter_model.safetensors" if method == "lora" else "model.safetensors"
    assert (tmp_path / method / weights).is_file()
    code, out, err = lorafit(["chat", str(tmp_path / method), "-p", "a tower", "--max-new-tokens", "4"], capsys)
    assert code == 0, err


# --- components -------------------------------------------------------------------------------------------------
def test_loss_is_on_the_answer_tokens_only(tiny: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    from lorafit.train.examples import IGNORE_INDEX, encode

    tokenizer = AutoTokenizer.from_pretrained(tiny["model"])
    conversation = [
        {"role": "user", "content": "red tower"},
        {"role": "assistant", "content": "blue fish"},
        {"role": "user", "content": "salt pans"},
        {"role": "assistant", "content": "the tide"},
    ]
    encoded = encode([conversation], tokenizer)
    ids, labels = encoded.input_ids[0], encoded.labels[0]
    trained = tokenizer.decode([token for token, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])
    assert trained == "blue fish<|end|>the tide<|end|>"
    everything = encode([conversation], tokenizer, train_on_prompt=True)
    assert IGNORE_INDEX not in everything.labels[0]


def test_a_template_less_tokenizer_gets_role_turns(tiny: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    from lorafit.train.examples import ensure_chat_template, render

    tokenizer = AutoTokenizer.from_pretrained(tiny["model"])
    tokenizer.chat_template = None
    assert ensure_chat_template(tokenizer)
    text = render(tokenizer, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], False)
    assert text == "user: q\n\nassistant: a<|end|>"


def test_length_grouping_pads_less_and_the_order_depends_only_on_seed_and_epoch() -> None:
    from lorafit.train.trainer import EpochSampler

    rng = random.Random(0)
    lengths = [rng.randint(8, 512) for _ in range(800)]

    def padding(sampler: EpochSampler, batch: int = 8) -> int:
        order = list(sampler)
        chunks = [order[i : i + batch] for i in range(0, len(order), batch)]
        return sum(max(lengths[i] for i in chunk) * len(chunk) - sum(lengths[i] for i in chunk) for chunk in chunks)

    grouped, plain = EpochSampler(lengths, seed=1, group_size=8), EpochSampler(lengths, seed=1, group_size=None)
    assert padding(grouped) < padding(plain) / 5
    assert sorted(grouped) == list(range(800))
    assert list(grouped) == list(EpochSampler(lengths, seed=1, group_size=8))
    first = list(grouped)
    grouped.set_epoch(1)
    assert list(grouped) != first


def test_settings_map_onto_training_arguments() -> None:
    from transformers import TrainingArguments

    from lorafit.train import hf_args
    from lorafit.train.config import TrainConfig

    settings = Settings(micro_batch=3, grad_accum=5, precision="bf16", optimizer="paged_adamw_8bit")
    config = TrainConfig(learning_rate=1e-3, warmup_ratio=0.1, save_steps=7, seed=11, max_steps=40)
    arguments = TrainingArguments(
        **hf_args.training_kwargs(config, settings, output_dir="unused", on_cuda=False, eval_steps=7)
    )
    assert (arguments.per_device_train_batch_size, arguments.gradient_accumulation_steps) == (3, 5)
    assert arguments.bf16 and not arguments.fp16
    assert arguments.optim == "paged_adamw_8bit"
    assert (arguments.learning_rate, arguments.save_steps, arguments.seed, arguments.max_steps) == (1e-3, 7, 11, 40)
    assert arguments.get_warmup_steps(40) == 4
    assert hf_args.optimizer_name(Settings(optimizer="adamw")) == "adamw_torch_fused"


def test_preflight_halves_until_the_worst_batch_fits(tiny: dict[str, Path]) -> None:
    """The CUDA probe stood in for by one whose peak grows with the tokens of the micro-batch."""
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from lorafit.errors import TrainError
    from lorafit.train import build, guard

    settings = Settings(
        method="lora", quant="none", precision="fp32", micro_batch=8, grad_accum=2, grad_ckpt=False, lora_dropout=0.0
    )
    model = build.prepare(build.load_model(tiny["model"], settings), _spec(tiny), settings)
    tokenizer = AutoTokenizer.from_pretrained(tiny["model"])
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=str(tiny["root"] / "unused"), use_cpu=True, report_to="none", learning_rate=0.1
        ),
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding="longest"),
    )
    longest = {"input_ids": list(range(5, 105)), "labels": list(range(5, 105))}
    before = {name: value.clone() for name, value in model.named_parameters() if value.requires_grad}

    class Probe:
        batch_tokens = 0

        def reset(self) -> None: ...

        def peak_bytes(self) -> int:
            return self.batch_tokens * 1000

        def budget_bytes(self) -> int:
            return 250_000

    probe = Probe()
    real_measure = guard._measure

    def measure(trainer: object, longest: dict, micro_batch: int, probe: Probe, steps: int) -> int:
        probe.batch_tokens = micro_batch * len(longest["input_ids"])
        return real_measure(trainer, longest, micro_batch, probe, steps)

    guard._measure = measure
    try:
        result = guard.preflight(trainer, longest, settings, probe)
        assert (result.settings.micro_batch, result.settings.grad_accum, result.halvings) == (2, 8, 2)
        after = dict(model.named_parameters())
        assert all((after[name] - value).abs().max() == 0 for name, value in before.items())  # lr 0: unchanged
        assert not trainer.optimizer.state  # and no optimizer state left behind
        probe.budget_bytes = lambda: 10  # type: ignore[method-assign]
        with pytest.raises(TrainError, match="does not fit"):
            guard.preflight(trainer, longest, settings, probe)
    finally:
        guard._measure = real_measure


def _spec(tiny: dict[str, Path]) -> ModelSpec:
    from lorafit.models import from_config_json

    return from_config_json(tiny["model"])


def test_only_complete_checkpoints_count(tmp_path: Path) -> None:
    root = checkpoints.checkpoint_root(tmp_path)
    for step in (2, 4):
        (root / f"checkpoint-{step}").mkdir(parents=True)
        checkpoints.write_atomic(root / f"checkpoint-{step}" / checkpoints.COMPLETE, json.dumps({"step": step}))
    (root / "checkpoint-6").mkdir()  # a folder without its marker: not a checkpoint
    (root / checkpoints.STAGING / "checkpoint-8").mkdir(parents=True)  # a save the kill interrupted
    assert checkpoints.latest_checkpoint(tmp_path).name == "checkpoint-4"
    checkpoints.clean_partial(tmp_path)
    assert sorted(path.name for path in root.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    checkpoints.rotate(tmp_path, keep=1)
    assert [path.name for path in checkpoints.good_checkpoints(tmp_path)] == ["checkpoint-4"]
