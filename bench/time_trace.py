"""make bench-time-trace: the time model's closed form against its own roofline run over the traced op list.

`lorafit.timing.micro_batch_time` counts a micro-batch's FLOPs, bytes and kernels by formula; the `--exact`
trace runs the real code path (transformers, peft, bitsandbytes, autocast, checkpointing) on fake tensors and
lists every op it launches. `lorafit.trace.optime` times that list op by op with the same rates and roofline,
so where the two disagree it is a count of the closed form (bytes per element, passes, kernels) that the code
path does not bear out - the way the allocator's reserve was checked against its simulation. No GPU and no
throughput measurement is involved: this checks the model's counts, not its rates.

Per configuration and card: each category's seconds, closed form beside trace, the relative difference, and
the kernel counts. Writes bench/results/time-trace.json.

    python bench/time_trace.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lorafit import hardware, timing  # noqa: E402
from lorafit.models import resolve  # noqa: E402
from lorafit.schema import Settings  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "time-trace.json"
CARDS = ("RTX 4090", "L4")
MODEL = "llama-3.1-8b"
BASE = {"seq_len": 2048, "micro_batch": 1}
CASES = [  # (label, settings beyond BASE)
    ("qlora mb1 ckpt sdpa", {"method": "qlora"}),
    ("qlora mb4 ckpt sdpa", {"method": "qlora", "micro_batch": 4}),
    ("qlora mb1 ckpt eager", {"method": "qlora", "attn": "eager"}),
    ("qlora mb1 no-ckpt sdpa", {"method": "qlora", "grad_ckpt": False}),
    ("lora mb1 ckpt sdpa", {"method": "lora", "quant": "none"}),
    ("lora mb4 no-ckpt sdpa", {"method": "lora", "quant": "none", "micro_batch": 4, "grad_ckpt": False}),
    ("full mb1 ckpt sdpa", {"method": "full", "quant": "none", "optimizer": "adamw_8bit"}),
]
QUICK = {"qlora mb1 ckpt sdpa", "lora mb1 ckpt sdpa"}
CATEGORIES = ("matmul", "attention", "dequant", "lora", "elementwise", "loss", "launches")
FLAG = 0.10  # a category whose closed form and trace differ by more than this is listed at the end


def relative(closed: float, traced: float) -> float | None:
    """(closed - traced) / traced; None where the trace has nothing to compare with."""
    return None if traced == 0 else (closed - traced) / traced


def compare(label: str, settings: Settings, traced, gpu_name: str) -> dict:  # noqa: ANN001
    spec, gpu = resolve(MODEL), hardware.resolve(gpu_name)
    closed = timing.micro_batch_time(spec, settings, gpu)
    ops = traced.time(gpu)
    rows = {}
    for category in CATEGORIES:
        traced_s = ops.launches if category == "launches" else ops.seconds[category]
        closed_s = getattr(closed, category)
        rows[category] = {"closed_s": closed_s, "traced_s": traced_s, "relative": relative(closed_s, traced_s)}
    total = sum(ops.seconds.values()) + ops.launches
    closed_total = closed.total - closed.host_copies
    return {
        "case": label,
        "gpu": gpu_name,
        "categories": rows,
        "total": {"closed_s": closed_total, "traced_s": total, "relative": relative(closed_total, total)},
        "kernels": {"closed": timing.kernel_count(spec, settings), "traced": round(sum(ops.kernels.values()))},
        "traced_kernels": {c: round(n) for c, n in ops.kernels.items()},
        "traced_flops": ops.flops,
        "traced_bytes": ops.moved_bytes,
    }


def layer_profile(traced, tokens: int) -> dict:  # noqa: ANN001
    """What one decoder layer adds (the deeper trace less the shallower): per category and pass, kernels and
    bytes per token - the units of the closed form's per-layer counts. Plus the loss's bytes per logit."""
    (a, small), (b, large) = traced.traces
    profile: dict = {}
    for sign, ops in ((-1, small), (1, large)):
        for op in ops:
            cell = profile.setdefault(op.category, {}).setdefault("backward" if op.backward else "forward", [0, 0.0])
            cell[0] += sign / (b - a)
            cell[1] += sign * op.moved_bytes / tokens / (b - a)
    loss = sum(op.moved_bytes for op in large if op.category == "loss")
    return {
        "per_layer": {
            category: {pass_: {"kernels": round(k), "bytes_per_token": round(m)} for pass_, (k, m) in passes.items()}
            for category, passes in profile.items()
            if category != "loss"
        },
        "loss_bytes_per_logit": loss / tokens / resolve(MODEL).vocab_size,
    }


def show_profile(profile: dict) -> None:
    print("  one decoder layer, traced (kernels, bytes per token), forward | backward (recomputation included):")
    for category, passes in profile["per_layer"].items():
        cells = [passes.get(p, {"kernels": 0, "bytes_per_token": 0}) for p in ("forward", "backward")]
        print(f"    {category:<12}" + " | ".join(f"{c['kernels']:>4} {c['bytes_per_token']:>10,}" for c in cells))
    print(f"  loss: {profile['loss_bytes_per_logit']:.1f} bytes per logit")


def show(row: dict) -> None:
    print(f"\n{row['case']} on {row['gpu']}")
    print(f"  {'category':<12} {'closed ms':>10} {'trace ms':>10} {'diff':>8} {'trace kernels':>14}")
    for category, cell in row["categories"].items():
        kernels = row["traced_kernels"].get(category, sum(row["traced_kernels"].values()))
        print(
            f"  {category:<12} {cell['closed_s'] * 1e3:>10.2f} {cell['traced_s'] * 1e3:>10.2f}"
            f" {percent(cell['relative']):>8} {kernels:>14}"
        )
    total = row["total"]
    print(
        f"  {'total':<12} {total['closed_s'] * 1e3:>10.2f} {total['traced_s'] * 1e3:>10.2f}"
        f" {percent(total['relative']):>8}"
    )
    print(f"  kernels: closed form {row['kernels']['closed']}, trace {row['kernels']['traced']}")


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two configurations only")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from lorafit.train.build import quiet_libraries

    quiet_libraries()
    from lorafit.trace.optime import trace_micro_batch

    rows = []
    for label, changes in CASES:
        if args.quick and label not in QUICK:
            continue
        settings = Settings(**(BASE | changes))
        started = time.perf_counter()
        traced = trace_micro_batch(resolve(MODEL), settings)
        print(f"\n[{label}: traced in {time.perf_counter() - started:.0f} s]")
        profile = layer_profile(traced, settings.tokens_per_micro_batch)
        show_profile(profile)
        for gpu_name in CARDS:
            rows.append(compare(label, settings, traced, gpu_name) | {"traced_layer": profile})
            show(rows[-1])
    flagged = [
        (row["case"], row["gpu"], category, cell["relative"])
        for row in rows
        for category, cell in row["categories"].items()
        if cell["relative"] is not None and abs(cell["relative"]) > FLAG
    ]
    print(f"\ncategories where the closed form and the trace differ by more than {FLAG:.0%}:")
    for case, gpu, category, rel in flagged:
        print(f"  {case} on {gpu}: {category} {percent(rel)}")
    if not args.quick:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps({"model": MODEL, "base": BASE, "rows": rows}, indent=1) + "\n")
        print(f"\nwrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
