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

import argparse
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lorafit import hardware, memory, timing  # noqa: E402
from lorafit.models import resolve  # noqa: E402
from lorafit.schema import Settings  # noqa: E402

MODELS = ("qwen3.5-27b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b")


def memory_rows(models: list[str]) -> None:
    from lorafit.trace import exact_estimate

    print(f"{'model':19s} {'ckpt':5s} {'trace GiB':>10s} {'estimate GiB':>13s} {'diff':>7s}")
    for name in models:
        for ckpt in (True, False):
            settings = Settings(method="qlora", quant="nf4", seq_len=2048, grad_ckpt=ckpt, attn="sdpa")
            traced = exact_estimate(resolve(name), settings).peak_allocated_gib
            analytic = memory.estimate(resolve(name), settings).peak_allocated_gib
            diff = 100 * (analytic / traced - 1)
            print(f"{name:19s} {ckpt!s:5s} {traced:10.2f} {analytic:13.2f} {diff:+6.2f}%", flush=True)


def time_rows(models: list[str]) -> None:
    from lorafit.trace.optime import trace_micro_batch

    gpu = hardware.resolve("H100")
    print(f"\none micro-batch on an {gpu.name}: the closed form beside the roofline over the traced op list")
    print(f"{'model':19s} {'part':12s} {'traced ms':>10s} {'closed ms':>10s}")
    for name in models:
        settings = Settings(method="qlora", quant="nf4", seq_len=2048, attn="sdpa")
        traced = trace_micro_batch(resolve(name), settings).time(gpu)
        closed = timing.micro_batch_time(resolve(name), settings, gpu)
        for part in ("matmul", "attention", "elementwise"):
            print(f"{name:19s} {part:12s} {traced.seconds[part] * 1e3:10.0f} {getattr(closed, part) * 1e3:10.0f}")
        print(f"{name:19s} {'total':12s} {traced.total * 1e3:10.0f} {closed.total * 1e3:10.0f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--time", action="store_true", help="also the time model against the traced op list")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    memory_rows(args.models.split(","))
    if args.time:
        time_rows(args.models.split(","))


if __name__ == "__main__":
    main()
