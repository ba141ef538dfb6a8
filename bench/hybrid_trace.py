"""make bench-hybrid: lorafit's closed-form estimate beside the `--exact` trace (the real transformers / peft /
bitsandbytes step on fake tensors at the real shapes) for the linear-attention hybrid presets (Qwen3.5, and the
hybrid MoE: Qwen3-Next, Qwen3.5 MoE).

Rows: Qwen3.5-27B, Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B, QLoRA, one row of 2048 tokens, LoRA on every
projection (`all`: both layer kinds' and, on the dense model, the MLP's; an MoE's `all` is its attention's), with
and without gradient checkpointing. The trace runs transformers' PyTorch DeltaNet path (no flash-linear-attention
or causal-conv1d kernels) at depths 4 and 8 (whole groups of three linear-attention layers and one full-attention
layer) and extrapolates to the full depth. These are check rows: no constant was fitted on them (the DeltaNet and
shared-expert terms are derived from the code, memory/linear_attention.py).

The time rows (--time) put the time model's closed form beside its roofline over the traced op list: the
closed form counts the chunked rule's matmul FLOPs (timing.deltanet_seconds) but not the PyTorch path's fp32
elementwise traffic and per-chunk kernels, which the op list shows to dominate (a known gap, printed as is).

    python bench/hybrid_trace.py [--models qwen3.5-27b,qwen3.5-35b-a3b,qwen3-next-80b-a3b] [--time]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lorafit import hardware  # noqa: E402
from lorafit.schema import Settings  # noqa: E402
from trace_rows import TIME_TITLE, main, micro_batch_times, peak_gib  # noqa: E402

MODELS = ("qwen3.5-27b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b")


def memory_rows(models: list[str]) -> None:
    print(f"{'model':19s} {'ckpt':5s} {'trace GiB':>10s} {'estimate GiB':>13s} {'diff':>7s}")
    for name in models:
        for ckpt in (True, False):
            settings = Settings(method="qlora", quant="nf4", seq_len=2048, grad_ckpt=ckpt, attn="sdpa")
            traced, analytic, diff = peak_gib(name, settings)
            print(f"{name:19s} {ckpt!s:5s} {traced:10.2f} {analytic:13.2f} {diff:+6.2f}%", flush=True)


def time_rows(models: list[str]) -> None:
    gpu = hardware.resolve("H100")
    print("\n" + TIME_TITLE.format(gpu=gpu.name))
    print(f"{'model':19s} {'part':12s} {'traced ms':>10s} {'closed ms':>10s}")
    for name in models:
        settings = Settings(method="qlora", quant="nf4", seq_len=2048, attn="sdpa")
        traced, closed = micro_batch_times(name, settings, gpu)
        for part in ("matmul", "attention", "elementwise"):
            print(f"{name:19s} {part:12s} {traced.seconds[part] * 1e3:10.0f} {getattr(closed, part) * 1e3:10.0f}")
        print(f"{name:19s} {'total':12s} {traced.total * 1e3:10.0f} {closed.total * 1e3:10.0f}", flush=True)


if __name__ == "__main__":
    main(__doc__, MODELS, memory_rows, time_rows)
