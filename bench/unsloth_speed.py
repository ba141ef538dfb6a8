"""`make bench-unsloth-speed`: lorafit's time model for `--stack unsloth` against Unsloth's own published speed-ups.

Unsloth needs a GPU to import, so its step is timed by the model (src/lorafit/timing.py with the stack's Runtime:
its compiled-style fused kernels, its checkpoints copied to host memory and back). Its README of 2023-12-15
(@9c6803a5, 'Full benchmarking tables'; rows US-01..07 of bench/calibration/measured_memory.csv) gives the
seconds of the same benchmark run under Hugging Face (HF + PEFT QLoRA), HF with Flash Attention 2 and Unsloth:
the ratio of two of them is the published speed-up. None of these was used to fit or choose anything (check).

What the table does not state is filled in and printed: the step's shape (the HF blog unsloth-trl.md: QLoRA r16
on all linear layers, checkpointing on; the T4 tables: bsz 2, adamw_8bit; sequence length 2048 assumed), the
baseline's stack (peft-kbit: prepare_model_for_kbit_training under the HF Trainer, the HF blog's recipe). The
ratio is what is compared, so the assumed shape matters less than it would for seconds.

    python bench/unsloth_speed.py
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from lorafit import hardware, models, timing
from lorafit.schema import Settings

SEQ_LEN = 2048  # assumed: not stated by the table


@dataclass(frozen=True)
class Pair:
    """Two runs of one published benchmark: the baseline's and Unsloth's seconds."""

    rows: str
    model: str
    gpu: str
    precision: str
    baseline_attn: str  # Hugging Face: sdpa (transformers 4.36, per the HF blog); FA2: flash
    baseline_seconds: float
    unsloth_seconds: float


PAIRS = (
    Pair("US-01 / US-03", "mistral-7b-v0.1", "A100 40GB", "bf16", "sdpa", 1813, 842),
    Pair("US-02 / US-03", "mistral-7b-v0.1", "A100 40GB", "bf16", "flash", 1571, 842),
    Pair("US-06 / US-07", "llama-2-7b", "T4", "fp16", "sdpa", 2640, 1355),
)


def step(model: str, gpu: str, precision: str, stack: str, attn: str) -> float:
    settings = Settings(
        method="qlora",
        stack=stack,
        micro_batch=2,
        seq_len=SEQ_LEN,
        lora_r=16,
        lora_targets="all",
        lora_dropout=0.0,
        optimizer="adamw_8bit",
        precision=precision,
        attn=attn,
        grad_ckpt=True,
    )
    return timing.step_seconds(models.resolve(model), settings, hardware.resolve(gpu))


def main() -> None:
    errors = []
    print(f"{'rows':14} {'model':16} {'gpu':10} {'published':>9} {'lorafit':>8} {'error':>7}")
    for pair in PAIRS:
        published = pair.baseline_seconds / pair.unsloth_seconds
        baseline = step(pair.model, pair.gpu, pair.precision, "peft-kbit", pair.baseline_attn)
        ours = baseline / step(pair.model, pair.gpu, pair.precision, "unsloth", "flash")
        error = 100 * (ours - published) / published
        errors.append(abs(error))
        print(f"{pair.rows:14} {pair.model:16} {pair.gpu:10} {published:8.2f}x {ours:7.2f}x {error:+6.1f}%")
    print(
        f"check rows: median |error| of the speed-up {statistics.median(errors):.1f} %, worst {max(errors):.1f} % "
        f"({len(errors)} pairs; baseline peft-kbit, micro-batch 2 x {SEQ_LEN} tokens assumed)"
    )


if __name__ == "__main__":
    main()
