"""`lorafit train` end to end on a tiny random Llama (2 layers, width 64, vocab 512) built here, on the CPU.

The runs are real: bitsandbytes NF4 base, peft adapters, transformers' Trainer. Step counts are small; the
kill-and-resume test runs real subprocesses and kills one with SIGKILL.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli
from lorafit.models import ModelSpec
from lorafit.schema import Plan, Settings
from lorafit.train import checkpoints, runfolder

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


def run_args(tiny: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """`lorafit train` on the tiny model and data into `out`, with `extra` options."""
    return ["train", "--model", str(tiny["model"]), "--data", str(tiny["data"]), "--output-dir", str(out), *extra]


def train_args(tiny: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return run_args(tiny, out, "--micro-batch", "4", "--grad-accum", "2", "--seed", "3", *extra)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def adapter_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run / "adapter_model.safetensors")


def folder_bytes(folder: Path) -> dict[str, bytes]:
    """Every file of a folder, by relative path: the listing and the contents."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def one_line(err: str) -> bool:
    return err.count("\n") == 1 and err.startswith("lorafit: error:")


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


def test_chat_on_the_last_checkpoint_loads_and_answers_as_the_run_folder(
    finished_run: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    import bitsandbytes as bnb
    import torch

    from lorafit.train.chat import load

    run = finished_run["dir"]
    checkpoint = run / "checkpoints" / "checkpoint-6"
    replies = [
        lorafit(["chat", str(folder), "-p", "the keeper paints", "--max-new-tokens", "12"], capsys)
        for folder in (run, checkpoint)
    ]
    assert replies[0][0] == replies[1][0] == 0, replies
    assert replies[0][1] == replies[1][1]
    (model, tokenizer), (reference, _) = load(checkpoint), load(run)
    assert any(isinstance(module, bnb.nn.Linear4bit) for module in model.modules())  # the QLoRA base, in 4 bits
    ids = tokenizer("the keeper paints a tower", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


@pytest.mark.parametrize(
    ("option", "words"),
    [
        (["--max-new-tokens", "0"], "--max-new-tokens 0: must be greater than 0"),
        (["--max-new-tokens", "-3"], "--max-new-tokens -3: must be greater than 0"),
        (["--temperature", "-1"], "--temperature -1: must be at least 0"),
        (["--temperature", "nan"], "--temperature nan: must be a finite number"),
        (["-p", " ".join(["tower"] * 600)], "the model reads at most 512 positions"),
    ],
)
def test_chat_refuses_what_it_cannot_generate_in_one_line(
    option: list[str], words: str, finished_run: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = lorafit(["chat", str(finished_run["dir"]), "-p", "the keeper", *option], capsys)
    assert code == 2 and one_line(err), err
    assert words in err and out == ""


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


def finished_run_args(finished_run: dict) -> list[str]:
    """The flags that train the `finished_run` fixture's run."""
    args = finished_run["args"]
    flags = [f"--{key.replace('_', '-')}" for key in args]
    return ["train", *[part for flag, value in zip(flags, args.values(), strict=True) for part in (flag, str(value))]]


def test_rerunning_a_finished_run_says_so_and_changes_nothing(
    finished_run: dict, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same command again, and its resolved config.yaml (which pins what the plan chose), into the same folder;
    the config names its paths from the run folder, so it reruns from another working directory too."""
    run = finished_run["dir"]
    before = folder_bytes(run)
    for args in (finished_run_args(finished_run), ["train", str(run / "config.yaml")]):
        monkeypatch.chdir(tmp_path)  # the second: elsewhere than the run was started from
        code, out, err = lorafit(args, capsys)
        assert (code, err) == (0, "")
        (line,) = out.strip().splitlines()
        assert str(run) in line and "finished after 6 steps" in line and "--overwrite" in line
        assert folder_bytes(run) == before  # no step 7, no new checkpoint, the same adapter bytes


def test_a_run_stopped_after_its_last_checkpoint_writes_its_outputs_without_training_further(
    finished_run: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Killed (or out of disk) between the checkpoint of the last step and the final save: the rerun writes
    the outputs from that checkpoint; the Trainer alone would train one step past the end."""
    run = tmp_path / "qlora"
    shutil.copytree(finished_run["dir"], run)
    for name in ("adapter_model.safetensors", "adapter_config.json", "README.md", "loss.png"):
        (run / name).unlink()
    runfolder.write_run_file(run, (runfolder.read_run_file(run) or {}) | {"status": "training"})
    args = finished_run_args(finished_run)
    args[args.index("--output-dir") + 1] = str(run)
    code, out, err = lorafit(args, capsys)
    assert code == 0, err
    assert "resuming from checkpoint-6" in out and "step 7" not in out
    assert [path.name for path in checkpoints.good_checkpoints(run)] == ["checkpoint-3", "checkpoint-6"]
    assert [line["step"] for line in metrics(run)] == [1, 2, 3, 4, 5, 6]
    ours, theirs = adapter_weights(run), adapter_weights(finished_run["dir"])
    assert all((ours[name] == theirs[name]).all() for name in theirs)


def test_an_output_dir_that_cannot_be_written_is_one_line(
    tiny: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = lorafit(train_args(tiny, Path("/proc/lorafit-run"), "--max-steps", "1"), capsys)
    assert code == 2 and one_line(err)
    assert "cannot write to --output-dir /proc/lorafit-run" in err


# --- Ctrl-C -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("step", "said", "rerun"),
    [
        (5, "interrupted after step 5 of 6: rerun the same command to resume from checkpoint-4", "resuming from"),
        (1, "interrupted after step 1 of 6, before the first checkpoint: rerunning starts over", "no checkpoint yet"),
    ],
)
def test_ctrl_c_says_where_the_run_stopped_and_the_same_command_goes_on(
    step: int,
    said: str,
    rerun: str,
    tiny: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lorafit.train.trainer import RunCallback

    real_step_end = RunCallback.on_step_end

    def interrupt_at_step(self: RunCallback, args: object, state: object, control: object, **kwargs: object) -> None:
        real_step_end(self, args, state, control, **kwargs)
        if state.global_step == step:
            raise KeyboardInterrupt  # what Ctrl-C raises, at the end of step `step`

    run = tmp_path / "run"
    args = train_args(tiny, run, "--max-steps", "6", "--save-steps", "2", "--eval-split", "0")
    monkeypatch.setattr(RunCallback, "on_step_end", interrupt_at_step)
    code, out, err = lorafit(args, capsys)
    assert code == 130, err
    assert said in out
    assert not list(run.glob("checkpoints/.staging/*"))

    monkeypatch.setattr(RunCallback, "on_step_end", real_step_end)
    code, out, err = lorafit(args, capsys)
    assert code == 0, err
    assert rerun in out
    assert [line["step"] for line in metrics(run)] == [1, 2, 3, 4, 5, 6]


def test_ctrl_c_while_the_outputs_are_written_says_how_to_finish(
    tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lorafit.train import report

    real_plot = report.plot_loss

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    run = tmp_path / "run"
    args = train_args(tiny, run, "--max-steps", "4", "--save-steps", "2", "--eval-split", "0")
    monkeypatch.setattr(report, "plot_loss", interrupted)
    code, out, _ = lorafit(args, capsys)
    assert code == 130
    assert "interrupted: checkpoint-4 is intact: rerun the same command to resume from it" in out
    monkeypatch.setattr(report, "plot_loss", real_plot)
    code, out, err = lorafit(args, capsys)
    assert code == 0, err
    assert "resuming from checkpoint-4" in out and "step 5" not in out and (run / "loss.png").is_file()


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

    every_warning = os.environ | {"PYTHONWARNINGS": "always"}  # what a user with warnings on would see
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=300, env=every_warning)  # again
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from checkpoint-" in resumed.stdout
    assert "Warning" not in resumed.stderr and "warn" not in resumed.stderr, resumed.stderr[-2000:]

    ours, theirs = adapter_weights(tmp_path / "run"), adapter_weights(tmp_path / "reference")
    assert ours.keys() == theirs.keys()
    assert max((ours[name] - theirs[name]).abs().max().item() for name in ours) <= 1e-6
    curve = [(line["step"], line.get("loss"), line.get("eval_loss")) for line in metrics(tmp_path / "run")]
    assert curve == [
        (line["step"], line.get("loss"), line.get("eval_loss")) for line in metrics(tmp_path / "reference")
    ]
    assert [step for step, _, _ in curve] == list(range(1, 17))


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

    from lorafit.data.chat_text import ensure_chat_template, render

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


def test_the_python_api_refuses_chat_options_as_the_flags_do() -> None:
    from lorafit.errors import InvalidConfig
    from lorafit.train.chat import check_generation

    with pytest.raises(InvalidConfig, match="--max-new-tokens 0: must be greater than 0"):
        check_generation(0, 0.0)
    with pytest.raises(InvalidConfig, match="--temperature nan: must be a finite number"):
        check_generation(8, float("nan"))


def test_every_file_of_a_run_has_the_mode_an_ordinary_write_gives(finished_run: dict, tmp_path: Path) -> None:
    """safetensors writes 0600; the adapter a run leaves must be readable by whoever may read the folder."""
    import stat

    (tmp_path / "plain").write_text("x")
    ordinary = stat.S_IMODE((tmp_path / "plain").stat().st_mode)
    run = finished_run["dir"]
    for path in [run / "adapter_model.safetensors", *run.glob("checkpoints/checkpoint-*/*")]:
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == ordinary, path


def test_the_demo_base_model_has_the_mode_an_ordinary_write_gives(tmp_path: Path) -> None:
    import stat

    from lorafit.train.demo import build_demo_base

    (tmp_path / "plain").write_text("x")
    ordinary = stat.S_IMODE((tmp_path / "plain").stat().st_mode)
    build_demo_base(tmp_path / "base-model", hidden_size=64)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in (tmp_path / "base-model").iterdir()}
    assert modes["model.safetensors"] == ordinary and set(modes.values()) == {ordinary}, modes


# --- what a run says ----------------------------------------------------------------------------------------
def test_the_parameter_count_of_a_4bit_base_is_its_real_count(finished_run: dict, tiny: dict[str, Path]) -> None:
    """bitsandbytes packs two 4-bit values a byte; the count is that of the model, as its weights file holds it."""
    import re

    from safetensors.torch import load_file

    base = sum(tensor.numel() for tensor in load_file(tiny["model"] / "model.safetensors").values())
    adapters = sum(tensor.numel() for tensor in adapter_weights(finished_run["dir"]).values())
    said = re.search(r"model: \S+, ([\d,]+) parameters, ([\d,]+) trained", finished_run["output"])
    assert said is not None, finished_run["output"]
    assert (int(said[1].replace(",", "")), int(said[2].replace(",", ""))) == (base + adapters, adapters)


def test_the_progress_says_the_last_step_once(finished_run: dict) -> None:
    lines = [line for line in finished_run["output"].splitlines() if line.startswith("step 6/6")]
    assert len(lines) == 1, finished_run["output"]


def test_speed_says_which_tokens_it_counts_and_the_eta_which_speed_it_uses(finished_run: dict) -> None:
    """All tokens (what other trainers report) and trained tokens (the answers the loss sees), both labelled, in
    the progress lines, metrics.jsonl and the model card; the ETA is measured once the warm-up steps are over."""
    output = finished_run["output"]
    assert "time: no planned speed for this device" in output  # the time model has no CPU
    progress = [line for line in output.splitlines() if line.startswith("step ")]
    assert re.search(r"[\d,]+ tok/s \(all\), [\d,]+ tok/s \(trained\)", progress[-1]), progress
    assert progress[0].startswith("step 1/6") and progress[0].endswith("eta ?")  # step 1: nothing measured yet
    assert progress[-1].startswith("step 6/6") and progress[-1].endswith("eta 0s (measured)")
    lines = metrics(finished_run["dir"])
    for line in lines:
        assert 0 < line["tokens_per_s_trained"] < line["tokens_per_s_all"]
        assert line["tokens_per_s"] == line["tokens_per_s_all"]  # the key earlier versions wrote
    assert [line["eta_basis"] for line in lines] == ["estimate"] * 2 + ["measured"] * 4
    assert "tok/s (all)" in (finished_run["dir"] / "README.md").read_text()


def test_the_token_counts_are_every_real_token_and_the_scored_answer_tokens() -> None:
    from lorafit.train.trainer import TokenCountingCollator, pop_counts

    features = [
        {"input_ids": [1, 2, 3, 4, 5], "labels": [-100, -100, 3, 4, 5]},
        {"input_ids": [1, 2, 3], "labels": [1, 2, 3]},  # position 0 predicts nothing: its label is never scored
    ]
    batch = TokenCountingCollator(lambda rows: {"rows": len(rows)})(features)
    assert pop_counts(batch) == (8, 5)
    assert batch == {"rows": 2}


def test_the_files_a_run_folder_shares_name_no_absolute_path(finished_run: dict, tiny: dict[str, Path]) -> None:
    """The model card, the plan and the run file travel with the folder: no path of this machine in them, and
    the run is still the same run (test_rerunning_a_finished_run_says_so_and_changes_nothing)."""
    run = finished_run["dir"]
    machine = [str(tiny["root"].resolve()), str(run.resolve().parent)]
    for name in ("README.md", "plan.json", "plan.yaml", "lorafit-run.json", "config.yaml"):
        text = (run / name).read_text()
        assert not any(path in text for path in machine), name
    card = (run / "README.md").read_text()
    assert f"# {run.name}" in card and f'PeftModel.from_pretrained(base, "{run.name}")' in card
    assert "base model | `model` |" in card and "data | `data.jsonl`" in card


def test_a_run_file_of_an_earlier_lorafit_with_an_absolute_model_path_is_the_same_run(
    finished_run: dict, tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "qlora"
    shutil.copytree(finished_run["dir"], run)
    saved = runfolder.read_run_file(run) or {}
    saved["fingerprint"] |= {"model": str(tiny["model"].resolve()), "data": str(tiny["data"])}  # as it saved them
    (run / runfolder.RUN_FILE).write_text(json.dumps(saved))
    args = finished_run_args(finished_run)
    args[args.index("--output-dir") + 1] = str(run)
    code, out, err = lorafit(args, capsys)
    assert (code, err) == (0, "") and "finished after 6 steps" in out


def test_a_loss_that_becomes_nan_stops_the_run_in_one_line(
    tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """From step 3 the loss is NaN (as a learning rate far too high makes it): the run stops there, says so,
    keeps the checkpoint before it, and is not marked finished."""
    from lorafit.train.trainer import LorafitTrainer

    real_loss = LorafitTrainer.compute_loss

    def diverging(self: LorafitTrainer, *args: object, **kwargs: object) -> object:
        loss = real_loss(self, *args, **kwargs)
        return loss * float("nan") if self.state.global_step >= 2 else loss

    monkeypatch.setattr(LorafitTrainer, "compute_loss", diverging)
    out = tmp_path / "run"
    args = train_args(tiny, out, "--max-steps", "6", "--save-steps", "2", "--logging-steps", "5", "--eval-split", "0")
    code, printed, err = lorafit(args, capsys)
    assert code == 2 and one_line(err), err
    assert "the training loss became nan at step 3" in err and "lower the learning rate" in err
    assert "done" not in printed
    assert (runfolder.read_run_file(out) or {}).get("status") != "finished"
    assert not (out / "adapter_model.safetensors").exists()
    assert [path.name for path in checkpoints.good_checkpoints(out)] == ["checkpoint-2"]


def test_library_notices_stay_silent() -> None:
    """DeepSpeed's accelerator notice (it resets its own logger's level when imported) and bitsandbytes'
    kernel notice, in a fresh process as `lorafit train` starts."""
    script = """
from lorafit.train.build import quiet_libraries
quiet_libraries()
import bitsandbytes
from deepspeed.accelerator import get_accelerator
get_accelerator()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Setting accelerator" not in done.stdout + done.stderr
    assert "gemm_4bit" not in done.stdout + done.stderr


@pytest.mark.parametrize("link", ["loop", "dangling"])
def test_an_output_dir_that_is_a_broken_link_is_one_line_that_says_so(
    link: str, tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    if link == "loop":
        (tmp_path / "other").symlink_to(out)
        out.symlink_to(tmp_path / "other")
    else:
        out.symlink_to(tmp_path / "gone")
    for dry in ([], ["--dry-run"]):
        code, _, err = lorafit(train_args(tiny, out, "--max-steps", "1", *dry), capsys)
        assert code == 2 and one_line(err), err
        assert "loops back on itself" in err if link == "loop" else "which does not exist" in err
        assert "rerun" not in err
    assert not (tmp_path / "gone").exists()
