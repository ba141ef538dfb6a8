"""The time model's structure checked on real training steps on this machine's CPU.

The CPU is the "card" (lorafit.hostcard.cpu_card: its fp32 matmul rate and copy bandwidth measured here), and a
real-shape small model (SmolLM2-135M's shapes, random weights) is trained the way `lorafit train` builds it on the
CPU: `build.load_model` (fp32, bitsandbytes 4-bit for QLoRA), `build.checked_prepare` (checkpointing, LoRA
adapters) and `build.build_optimizer`; one step is the Trainer's: forward with labels, backward, gradient clipping,
the optimizer step, zero_grad. Five configurations run one step each in turn, round after round (interleaved,
medians), and four ratios of their step times are set beside the ratios `timing.step_time` predicts on the
CPU card:

    QLoRA / LoRA, micro-batch 8 / 1, sequence 1024 / 256, checkpointing on / off

The acceptance of issue 26: each predicted ratio within 25 % of the measured one. Nothing here is fitted: the card's
rates are micro-benchmarks, the ratios are only checked. On a 2-core AMD EPYC (Zen 4), 1 thread, 10 layers
(bench/results/time-structure-cpu.json): QLoRA/LoRA 1.04 measured, 1.08 predicted; micro-batch 8.25 / 7.92; sequence
4.46 / 4.54; checkpointing 1.35 / 1.28. All 30 layers (--layers 30 --rounds 3, 3.7 minutes): 1.07 / 1.06, 7.84 /
7.91, 4.40 / 4.67, 1.45 / 1.38; the steps themselves 3-20 % longer than predicted. The step's profile (--profile) is
three quarters aten::mm; the QLoRA step runs the same aten::mm time as LoRA plus bitsandbytes' dequantisation, which
is why the card carries its own measured dequantisation rate and 4-bit matmul slowdown (the GPU's
QUANT_MATMUL_SLOWDOWN would predict 1.18). Dropout's random numbers (aten::bernoulli_, about 9 % of a step) run far
below the copy rate the LoRA path's bytes are timed at; they scale with the tokens, as the LoRA term does, so the
ratios hardly feel it.

    python bench/time_structure_cpu.py                 # the table; writes bench/results/time-structure-cpu.json
    python bench/time_structure_cpu.py --profile qlora # the ops that dominate one step of a configuration
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lorafit import models, timing  # noqa: E402
from lorafit.hardware import GpuSpec  # noqa: E402
from lorafit.models import ModelSpec  # noqa: E402
from lorafit.schema import Settings  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "time-structure-cpu.json"
MODEL = "smollm2-135m"  # hidden 576, 30 layers, 9 heads of 64, 3 kv heads, intermediate 1536, vocab 49152, tied
TOLERANCE = 0.25  # issue 26: predicted within 25 % of measured
# One thread by default: on a host whose cores other processes share, a team of OpenMP threads waits at every
# barrier for its slowest member, and steps of one configuration measured 1.2-13 s apart with two threads on this
# two-core machine under a load of 5-7; one thread slows with the load but evenly.
THREADS = 1
# Decoder layers built: SmolLM2-135M has 30; 10 of its real-shape layers keep a round of the five steps near 15 s
# on one core (the head and loss, as large as 8 layers, weigh more than in the full model; the prediction counts
# the same layers).
LAYERS = 10

# LoRA r16 on every linear, fp32 (lorafit's precision on the CPU), checkpointing, one row of 256 tokens.
BASE = Settings(method="lora", quant="none", precision="fp32", micro_batch=1, seq_len=256, grad_ckpt=True)
CONFIGS: dict[str, Settings] = {
    "lora": BASE,
    "qlora": BASE.model_copy(update={"method": "qlora", "quant": "nf4"}),
    "micro-batch 8": BASE.model_copy(update={"micro_batch": 8}),
    "sequence 1024": BASE.model_copy(update={"seq_len": 1024}),
    "no checkpointing": BASE.model_copy(update={"grad_ckpt": False}),
}
# (pair, numerator, denominator): each ratio is the numerator's step time over the denominator's.
PAIRS = [
    ("QLoRA / LoRA", "qlora", "lora"),
    ("micro-batch 8 / 1", "micro-batch 8", "lora"),
    ("sequence 1024 / 256", "sequence 1024", "lora"),
    ("checkpointing on / off", "lora", "no checkpointing"),
]


# --- the prediction half (pure: no torch) -------------------------------------------------------------------
def predicted_seconds(spec: ModelSpec, card: GpuSpec) -> dict[str, dict[str, float]]:
    """Each configuration's step as timing.step_time predicts it on `card`: the total and its ops."""
    out = {}
    for name, settings in CONFIGS.items():
        step = timing.step_time(spec, settings, card)
        ops = timing.micro_batch_time(spec, settings, card)
        out[name] = {"total": step.total, "optimizer": step.optimizer} | {
            op: getattr(ops, op) for op in ("matmul", "attention", "dequant", "lora", "elementwise", "loss", "launches")
        }
    return out


def ratios(seconds: dict[str, float]) -> dict[str, float]:
    """The four pairs' ratios of step times."""
    return {pair: seconds[top] / seconds[bottom] for pair, top, bottom in PAIRS}


def compare(measured: dict[str, float], predicted: dict[str, float]) -> list[dict[str, Any]]:
    """One row per pair: measured and predicted ratio, the prediction's relative error, and the verdict."""
    rows = []
    for pair in measured:
        error = predicted[pair] / measured[pair] - 1
        rows.append(
            {
                "pair": pair,
                "measured": round(measured[pair], 3),
                "predicted": round(predicted[pair], 3),
                "error": round(error, 3),
                "passes": abs(error) <= TOLERANCE,
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'pair':<26}{'measured':>10}{'predicted':>11}{'error':>9}  within 25 %"]
    for row in rows:
        verdict = "pass" if row["passes"] else "FAIL"
        lines.append(
            f"{row['pair']:<26}{row['measured']:>10.2f}{row['predicted']:>11.2f}{row['error']:>+9.0%}  {verdict}"
        )
    return "\n".join(lines)


# --- the measurement half -----------------------------------------------------------------------------------
def build_models(spec: ModelSpec, folder: Path) -> dict[str, Callable[[], float]]:
    """A stepper per configuration: random weights saved once, loaded, prepared and given an optimizer as
    `lorafit train` does on the CPU. The LoRA configurations that differ only in their batch share one model."""
    import torch
    from transformers import AutoModelForCausalLM

    from lorafit.train import build

    build.quiet_libraries()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build.hf_config(spec, BASE), dtype=torch.bfloat16).save_pretrained(folder)
    prepared: dict[tuple, tuple[Any, Any]] = {}
    steppers = {}
    for name, settings in CONFIGS.items():
        key = (settings.method, settings.grad_ckpt)
        if key not in prepared:
            torch.manual_seed(0)
            model = build.checked_prepare(build.load_model(folder, settings), spec, settings)
            model.train()
            prepared[key] = (model, build.build_optimizer(model, settings))
        steppers[name] = stepper(*prepared[key], spec, settings)
    return steppers


def stepper(model: Any, optimizer: Any, spec: ModelSpec, settings: Settings) -> Callable[[], float]:
    """One training step as transformers' Trainer runs it (loss, backward, clipping at max_grad_norm 1.0, the
    optimizer step, zero_grad) on a random micro-batch; returns its seconds."""
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (settings.micro_batch, settings.seq_len), generator=generator)
    trained = [p for p in model.parameters() if p.requires_grad]

    def step() -> float:
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return step


def measure(steppers: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """One untimed step of each, then `rounds` rounds of one step of each, the order rotated every round so
    that no configuration always follows the same one."""
    names = list(steppers)
    warm = {name: steppers[name]() for name in names}
    print("warm-up: " + ", ".join(f"{n} {warm[n]:.2f} s" for n in names), flush=True)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        order = names[index % len(names) :] + names[: index % len(names)]
        for name in order:
            seconds[name].append(steppers[name]())
        print(f"round {index + 1}/{rounds}: " + ", ".join(f"{n} {seconds[n][-1]:.2f} s" for n in names), flush=True)
    return seconds


def profile(step: Callable[[], float], top: int = 15) -> str:
    """The ops that take one step's time on the CPU, by self time (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed steps of each configuration")
    parser.add_argument("--layers", type=int, default=LAYERS, help="decoder layers (the model has 30)")
    parser.add_argument("--profile", choices=list(CONFIGS), help="profile one step of this configuration instead")
    parser.add_argument("--threads", type=int, default=THREADS, help="torch threads for the card and the steps")
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args()

    import torch

    from lorafit import hostcard

    torch.set_num_threads(args.threads)

    spec = models.resolve(MODEL)
    if args.layers:
        spec = spec.scaled(num_hidden_layers=args.layers)
    card = hostcard.cpu_card()
    print(
        f"{card.name}: fp32 matmul {timing.achievable_matmul_flops(card, 'fp32') / 1e9:.0f} GFLOP/s, "
        f"copy {timing.achievable_bytes_per_second(card) / 1e9:.1f} GB/s; "
        f"{spec.name}, {spec.num_hidden_layers} layers, random weights",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        steppers = build_models(spec, Path(folder))
        print(f"models built in {time.perf_counter() - start:.0f} s", flush=True)
        if args.profile:
            print(profile(steppers[args.profile]))
            return
        seconds = measure(steppers, args.rounds)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    predicted = predicted_seconds(spec, card)
    rows = compare(ratios(medians), ratios({name: p["total"] for name, p in predicted.items()}))
    print(table(rows))
    result = {
        "card": card.model_dump(mode="json", exclude={"aliases"}),
        "achievable_fp32_flops": timing.achievable_matmul_flops(card, "fp32"),
        "achievable_bytes_per_second": timing.achievable_bytes_per_second(card),
        "threads": torch.get_num_threads(),
        "model": spec.name,
        "layers": spec.num_hidden_layers,
        "configs": {name: settings.model_dump(mode="json") for name, settings in CONFIGS.items()},
        "measured_seconds": seconds,
        "predicted_seconds": predicted,
        "pairs": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json.relative_to(ROOT) if args.json.is_relative_to(ROOT) else args.json}")


if __name__ == "__main__":
    main()
