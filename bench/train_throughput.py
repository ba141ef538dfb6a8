"""`make bench-train`: lorafit's trainer against the plain QLoRA script a user would write, on the CPU.

Both train the same tiny Llama (the demo's shape: 2 layers, width 128, vocab 1024) with 4-bit NF4 double-quantised
base weights and the same LoRA adapters, on the same variable-length dataset, at the same micro-batch, for the
same number of steps, with the same learning rate and schedule. The plain script is the Hugging Face QLoRA
recipe (`prepare_model_for_kbit_training`, `get_peft_model`, `Trainer` with `DataCollatorForSeq2Seq` padding to
the longest row in each random batch, default arguments); lorafit runs `lorafit train` with the plan's settings
and only the batch pinned. Each side runs in its own process (for its peak RSS) and reports:

- useful tokens/s: real (non-pad) tokens trained per second after the first WARMUP_STEPS steps, as lorafit's
  metrics.jsonl counts them (the plain side's count runs one batch ahead: accelerate prefetches one; over 148
  steps that shifts the window by under 1%),
- seconds per optimizer step,
- final eval loss on held-out rows (answer tokens, computed by one function here for both),
- peak RSS of the process.

Both flush denormal floats (lorafit does so on the CPU; without it a random tiny model trains ~100x slower, which
would hide everything else).

The real-shape case: random weights with SmolLM2-135M's shapes (30 layers, width 576, 9 heads / 3 KV heads,
vocab 49152, tied embeddings; built here, nothing downloaded) and rows of exactly ROW_TOKENS tokens, so both sides
train the same 4 x 66 tokens each step with no padding. QLoRA and LoRA are each trained by `lorafit train` and by
the plain Trainer + peft script with the settings pinned the same (micro-batch 4, checkpointing, optimizer,
precision, steps), the two interleaved (plain, lorafit, plain, lorafit ...). One clock serves both: a callback
appended to transformers' default callbacks stamps the end of every step; tokens/s is every token (prompt and
answer) of a step over the median time of steps 2..N (step 1 is warm-up; the median shrugs off a step that
another process slowed). Each side runs on THREADS torch threads (default 1): on a shared machine, more threads
than free cores make every step wait for descheduled threads, and that swamps any difference between trainers.
The ratio is the median of the per-round ratios.

Run:  python bench/train_throughput.py [--case tiny|real|both] [--steps 150] [--real-steps 5] [--rounds 2]
       [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out" / "train_throughput"
MICRO_BATCH = 8
LEARNING_RATE = 1e-3
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05}


# --- the shared set-up ------------------------------------------------------------------------------------------
def make_data(folder: Path, rows: int, eval_rows: int, seed: int = 0) -> tuple[Path, Path]:
    """Alpaca rows whose answers follow a word-bigram chain of the demo's text (learnable), with lengths from
    a few to a few hundred tokens, as instruction data has."""
    from lorafit.train.demo import demo_file

    words = demo_file("lantern_isles.md").read_text().replace("\n", " ").split()
    following: dict[str, list[str]] = {}
    for first, second in zip(words, words[1:], strict=False):
        following.setdefault(first, []).append(second)
    rng = random.Random(seed)

    def chain(length: int) -> str:
        word = rng.choice(words)
        out = [word]
        for _ in range(length - 1):
            word = rng.choice(following.get(word) or words)
            out.append(word)
        return " ".join(out)

    def row() -> str:
        answer_words = max(2, min(300, int(rng.lognormvariate(math.log(40), 0.9))))
        return json.dumps({"instruction": chain(rng.randint(4, 24)), "input": "", "output": chain(answer_words)})

    train, held = folder / "train.jsonl", folder / "eval.jsonl"
    train.write_text("".join(row() + "\n" for _ in range(rows)))
    held.write_text("".join(row() + "\n" for _ in range(eval_rows)))
    return train, held


def make_model(folder: Path) -> Path:
    from lorafit.train.demo import build_model, build_tokenizer, corpus, tiny_spec

    tokenizer = build_tokenizer(corpus(), vocab_size=1024)
    build_model(folder / "model", tokenizer, tiny_spec(len(tokenizer)), seed=0)
    return folder / "model"


def encode_rows(tokenizer, path: Path) -> list[tuple[list[int], list[int]]]:  # noqa: ANN001
    """Chat template applied, labels on the answer only: what both sides train on and are evaluated on."""
    rows = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        prompt = [{"role": "user", "content": record["instruction"]}]
        full = prompt + [{"role": "assistant", "content": record["output"]}]
        prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = tokenizer.apply_chat_template(full, tokenize=True, return_dict=False)
        rows.append((ids, [-100] * len(prompt_ids) + ids[len(prompt_ids) :]))
    return rows


def eval_loss(model, rows: list[tuple[list[int], list[int]]]) -> float:  # noqa: ANN001
    """Mean cross-entropy over every answer token of the held-out rows, one row at a time (no padding)."""
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels in rows:
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
            target = torch.tensor(labels[1:])
            mask = target != -100
            total += torch.nn.functional.cross_entropy(logits[mask], target[mask], reduction="sum").item()
            count += int(mask.sum())
    return total / count


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- the plain script -----------------------------------------------------------------------------------------
def nf4_base(model_dir: Path):  # noqa: ANN201 - a transformers model
    """The base as the peft / transformers QLoRA examples load it: NF4 with double quantisation, fp32 compute
    (the CPU's dtype)."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    return AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quantization, dtype=torch.float32)


def plain(model_dir: Path, train_path: Path, eval_path: Path, steps: int, output: Path) -> dict:
    """The Hugging Face QLoRA recipe as a user writes it from the peft / transformers examples."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import (
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    from lorafit.train.progress import WARMUP_STEPS

    torch.set_flush_denormal(True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = prepare_model_for_kbit_training(nf4_base(model_dir))
    set_seed(0)
    model = get_peft_model(model, LoraConfig(target_modules="all-linear", task_type="CAUSAL_LM", **LORA))
    train = [{"input_ids": ids, "labels": labels} for ids, labels in encode_rows(tokenizer, train_path)]
    seen = {"tokens": 0}  # real tokens of every batch the training loop draws

    def collate(features: list[dict]) -> dict:
        seen["tokens"] += sum(len(feature["input_ids"]) for feature in features)
        return padder(features)

    padder = DataCollatorForSeq2Seq(tokenizer, padding="longest")
    arguments = TrainingArguments(
        output_dir=str(output),
        per_device_train_batch_size=MICRO_BATCH,
        max_steps=steps,
        learning_rate=LEARNING_RATE,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        remove_unused_columns=False,
    )
    marks: list[tuple[float, int]] = []  # (time, tokens drawn) at the end of each step

    class Marks(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            marks.append((time.perf_counter(), seen["tokens"]))

    trainer = Trainer(model=model, args=arguments, train_dataset=train, data_collator=collate, callbacks=[Marks()])
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    (warm, warm_tokens), (end, end_tokens) = marks[WARMUP_STEPS - 1], marks[-1]
    return {
        "tokens_per_s": (end_tokens - warm_tokens) / (end - warm),
        "seconds_per_step": seconds / steps,
        "eval_loss": eval_loss(model, encode_rows(tokenizer, eval_path)),
        "peak_rss_mib": peak_rss_mib(),
    }


# --- lorafit --------------------------------------------------------------------------------------------------
def with_lorafit(model_dir: Path, train_path: Path, eval_path: Path, steps: int, output: Path) -> dict:
    from io import StringIO

    from rich.console import Console

    from lorafit.train.config import load_config
    from lorafit.train.recipe import run

    config = load_config(
        None,
        {
            "model": str(model_dir),
            "data": str(train_path),
            "eval_split": 0,
            "output_dir": str(output),
            "method": "qlora",
            "micro_batch": MICRO_BATCH,
            "grad_accum": 1,
            "batch_size": MICRO_BATCH,
            "max_steps": steps,
            "learning_rate": LEARNING_RATE,
            "lr_scheduler": "linear",
            "warmup_ratio": 0.0,
            "lora_r": LORA["r"],
            "lora_alpha": LORA["lora_alpha"],
            "lora_dropout": LORA["lora_dropout"],
            "lora_targets": "all",
            "seed": 0,
            "logging_steps": 10,
            "save_steps": steps,
        },
    )
    result = run(config, overwrite=True, console=Console(file=StringIO()))
    last = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()][-1]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    settings = result.plan.settings
    return {
        "tokens_per_s": last["tokens_per_s"],
        "seconds_per_step": last["elapsed_s"] / result.steps,
        "eval_loss": eval_loss(result.model, encode_rows(tokenizer, eval_path)),
        "peak_rss_mib": peak_rss_mib(),
        "settings": f"micro-batch {settings.micro_batch} x accumulation {settings.grad_accum}, checkpointing "
        f"{'on' if settings.grad_ckpt else 'off'}, {settings.optimizer}, {settings.precision}",
    }


# --- the real-shape case -------------------------------------------------------------------------------------
REAL_MICRO_BATCH = 4
ROW_TOKENS = 66  # every row, prompt and answer, as in the 4 x 66-token steps of issue 26
# Pinned on both sides (lorafit's CPU plan for this model chooses the same: fp32, fused AdamW, checkpointing).
REAL_SETTINGS = {"grad_ckpt": True, "optimizer": "adamw", "precision": "fp32"}


def make_real_model(folder: Path) -> Path:
    """SmolLM2-135M's shapes from the catalog with random weights, and the demo's small BPE tokenizer (1,024
    tokens; the model keeps its vocabulary of 49,152 rows, so the embedding and the LM head are full size)."""
    from lorafit.models import catalog
    from lorafit.train.demo import build_model, build_tokenizer, corpus

    tokenizer = build_tokenizer(corpus(), vocab_size=1024)
    build_model(folder / "real-model", tokenizer, catalog()["smollm2-135m"], seed=0)
    return folder / "real-model"


def make_real_data(folder: Path, model_dir: Path, rows: int = 64, seed: int = 0) -> Path:
    """Alpaca rows whose chat-template encoding is exactly ROW_TOKENS tokens, about a third of them answer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = Path(folder / "train.jsonl").read_text().split()  # any text: the tiny case's rows
    rng = random.Random(seed)
    path, kept = folder / "real-train.jsonl", []
    scratch = folder / "real-candidate.jsonl"
    while len(kept) < rows:
        record = {
            "instruction": " ".join(rng.choices(words, k=rng.randint(14, 20))),
            "input": "",
            "output": " ".join(rng.choices(words, k=rng.randint(8, 14))),
        }
        scratch.write_text(json.dumps(record) + "\n")
        if len(encode_rows(tokenizer, scratch)[0][0]) == ROW_TOKENS:
            kept.append(json.dumps(record))
    scratch.unlink()
    path.write_text("".join(line + "\n" for line in kept))
    return path


class StepClock:
    """Stamps the end of every optimizer step; one instance per process, appended to transformers' default
    callbacks so that the plain Trainer and lorafit's are timed by the same code."""

    stamps: list[tuple[int, float]] = []

    @classmethod
    def install(cls) -> None:
        from transformers import TrainerCallback, trainer

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
                cls.stamps.append((state.global_step, time.perf_counter()))

        trainer.DEFAULT_CALLBACKS.append(Callback)

    @classmethod
    def tokens_per_s(cls, tokens_per_step: int) -> float:
        """A step's tokens over the median time of steps 2..N."""
        times = [later - earlier for (_, earlier), (_, later) in zip(cls.stamps, cls.stamps[1:], strict=False)]
        return tokens_per_step / statistics.median(times)


def plain_real(model_dir: Path, data: Path, method: str, steps: int, output: Path) -> dict:
    """The plain script with lorafit's settings: fp32, NF4 double-quantised base for QLoRA (peft's
    prepare_model_for_kbit_training, which also turns checkpointing on), non-reentrant checkpointing, fused
    AdamW, LoRA r 16 on every linear layer, DataCollatorForSeq2Seq."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainingArguments,
        set_seed,
    )

    torch.set_flush_denormal(True)
    StepClock.install()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    checkpointing = {"use_reentrant": False}
    if method == "qlora":
        model = prepare_model_for_kbit_training(
            nf4_base(model_dir),
            use_gradient_checkpointing=REAL_SETTINGS["grad_ckpt"],
            gradient_checkpointing_kwargs=checkpointing,
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    set_seed(0)
    model = get_peft_model(model, LoraConfig(target_modules="all-linear", task_type="CAUSAL_LM", **LORA))
    rows = encode_rows(tokenizer, data)
    assert all(len(ids) == ROW_TOKENS for ids, _ in rows)
    arguments = TrainingArguments(
        output_dir=str(output),
        per_device_train_batch_size=REAL_MICRO_BATCH,
        max_steps=steps,
        learning_rate=LEARNING_RATE,
        gradient_checkpointing=REAL_SETTINGS["grad_ckpt"],
        gradient_checkpointing_kwargs=checkpointing,
        optim="adamw_torch_fused",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        remove_unused_columns=False,
    )
    train = [{"input_ids": ids, "labels": labels} for ids, labels in rows]
    padder = DataCollatorForSeq2Seq(tokenizer, padding="longest")
    Trainer(model=model, args=arguments, train_dataset=train, data_collator=padder).train()
    return {"tokens_per_s": StepClock.tokens_per_s(REAL_MICRO_BATCH * ROW_TOKENS)}


def lorafit_real(model_dir: Path, data: Path, method: str, steps: int, output: Path) -> dict:
    """`lorafit train` (recipe.run, as the CLI calls it) with the same settings pinned."""
    from io import StringIO

    from rich.console import Console

    from lorafit.train.config import load_config
    from lorafit.train.recipe import run

    StepClock.install()
    overrides = {
        "model": str(model_dir),
        "data": str(data),
        "eval_split": 0,
        "output_dir": str(output),
        "method": method,
        "micro_batch": REAL_MICRO_BATCH,
        "grad_accum": 1,
        "batch_size": REAL_MICRO_BATCH,
        "max_steps": steps,
        "learning_rate": LEARNING_RATE,
        "lora_r": LORA["r"],
        "lora_alpha": LORA["lora_alpha"],
        "lora_dropout": LORA["lora_dropout"],
        "lora_targets": "all",
        "seed": 0,
        "logging_steps": 1,
        "save_steps": steps,
        **REAL_SETTINGS,
    }
    console = Console(file=StringIO(), width=200)
    result = run(load_config(None, overrides), overwrite=True, console=console)
    settings = result.plan.settings
    return {
        "tokens_per_s": StepClock.tokens_per_s(REAL_MICRO_BATCH * ROW_TOKENS),
        "settings": f"micro-batch {settings.micro_batch} x accumulation {settings.grad_accum}, checkpointing "
        f"{'on' if settings.grad_ckpt else 'off'}, {settings.optimizer}, {settings.precision}",
        "progress": [line for line in console.file.getvalue().splitlines() if line.startswith("step ")][-1:],
    }


def real_case(steps: int, rounds: int, threads: int) -> None:
    """Interleaved runs of both sides for QLoRA and LoRA; the median tokens/s of each and the median ratio."""
    model_dir = make_real_model(OUT)
    make_real_data(OUT, model_dir)
    print(
        f"CPU ({threads} thread(s) a side), SmolLM2-135M shapes (random weights), micro-batch {REAL_MICRO_BATCH} x "
        f"{ROW_TOKENS} tokens, {steps} steps (step 1 untimed), {rounds} rounds interleaved"
    )
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    for method in ("qlora", "lora"):
        speeds: dict[str, list[float]] = {"plain": [], "lorafit": []}
        last: dict = {}
        for _ in range(rounds):
            for name in speeds:
                last = worker(f"{name}-real", steps, method, environment)
                speeds[name].append(last["tokens_per_s"])
        ratio = statistics.median(ours / plain for ours, plain in zip(speeds["lorafit"], speeds["plain"], strict=True))
        runs = {name: ", ".join(f"{value:.1f}" for value in values) for name, values in speeds.items()}
        for name in speeds:
            print(f"{method:6} {name:8} {statistics.median(speeds[name]):6.1f} tok/s (all tokens; runs {runs[name]})")
        print(f"{method:6} lorafit / plain = {ratio:.2f}x (median of rounds; target >= 1.0); {last['settings']}")
        if last["progress"]:
            print(f"{method:6} lorafit's last progress line: {last['progress'][0]}")


# --- the comparison -------------------------------------------------------------------------------------------
def worker(name: str, steps: int, method: str = "qlora", environment: dict[str, str] | None = None) -> dict:
    command = [sys.executable, __file__, "--worker", name, "--steps", str(steps), "--method", method]
    done = subprocess.run(command, capture_output=True, text=True, env=environment)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=["tiny", "real", "both"], default="both")
    parser.add_argument("--steps", type=int, default=150, help="steps of the tiny case")
    parser.add_argument("--real-steps", type=int, default=5, help="steps of each real-shape run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each real-shape run")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the real-shape case")
    parser.add_argument("--worker", choices=["plain", "lorafit", "plain-real", "lorafit-real"])
    parser.add_argument("--method", choices=["qlora", "lora"], default="qlora")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.worker in ("plain-real", "lorafit-real"):
        work_real = plain_real if args.worker == "plain-real" else lorafit_real
        output = OUT / f"run-{args.worker}-{args.method}"
        print(json.dumps(work_real(OUT / "real-model", OUT / "real-train.jsonl", args.method, args.steps, output)))
        return
    if args.worker:
        model_dir, train_path, eval_path = OUT / "model", OUT / "train.jsonl", OUT / "eval.jsonl"
        work = plain if args.worker == "plain" else with_lorafit
        print(json.dumps(work(model_dir, train_path, eval_path, args.steps, OUT / f"run-{args.worker}")))
        return

    make_model(OUT)
    make_data(OUT, rows=2000, eval_rows=64)
    if args.case in ("tiny", "both"):
        results = {name: worker(name, args.steps) for name in ("plain", "lorafit")}
        report(results, args.steps)
    if args.case in ("real", "both"):
        real_case(args.real_steps, args.rounds, args.threads)


def report(results: dict[str, dict], steps: int) -> None:
    plain_result, ours = results["plain"], results["lorafit"]
    print(f"CPU, tiny Llama (2 x 128, vocab 1024), QLoRA NF4, micro-batch {MICRO_BATCH}, {steps} steps")
    print(f"{'':10} {'useful tok/s':>13} {'s/step':>8} {'eval loss':>10} {'peak RSS':>12}")
    for name, result in results.items():
        print(
            f"{name:10} {result['tokens_per_s']:13,.0f} {result['seconds_per_step']:8.3f} "
            f"{result['eval_loss']:10.4f} {result['peak_rss_mib']:8.0f} MiB"
        )
    ratio = ours["tokens_per_s"] / plain_result["tokens_per_s"]
    loss_gap = ours["eval_loss"] / plain_result["eval_loss"] - 1
    print(f"lorafit settings: {ours['settings']}")
    print(f"useful tokens/s: lorafit / plain = {ratio:.2f}x (target >= 1.5x)")
    print(
        f"seconds per step at equal micro-batch: lorafit / plain = "
        f"{ours['seconds_per_step'] / plain_result['seconds_per_step']:.2f} (target <= 1)"
    )
    print(f"final eval loss: lorafit vs plain {loss_gap:+.1%} (target within +-2%)")


if __name__ == "__main__":
    main()
