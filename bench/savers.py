"""`make bench-savers`: what each memory saver takes off a 7-8B QLoRA step at 2048 tokens, and whether it fits 8 GB.

For Llama-3.1-8B, Qwen2.5-7B and Llama-2-7B (QLoRA NF4, bf16, micro-batch 1 x 2048 tokens, checkpointing on,
paged 8-bit AdamW: the smallest step a planner would try on an 8 GB card), the device peak (nvidia-smi) with no
saver, with each saver alone and with all of them, side by side from the analytic estimate and from the
`--exact` trace of the real step, with the verdict on an 8 GB card with 10% kept free. Then the plan that
`lorafit plan --vram 16 --method qlora` makes for each model, with the savers searched and with them pinned off,
and its speed ratio.

The trace runs the step the trainer runs, savers included (lorafit.train.savers: the chunked loss, the activation
and embedding offloads), so each row's `--exact` figure comes from the tensors that step really holds; the host
memory the offloads take is reported beside it. expandable_segments changes only the allocator, so its traced row is
the same traced tensors with the allocator model of expandable segments (memory.reserved_bytes).

    python bench/savers.py [--no-exact] [--models llama-3.1-8b,...] [--out bench/results/savers.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from lorafit import hardware, memory, models
from lorafit.options import DEFAULT_HEADROOM
from lorafit.schema import Estimate, Settings

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "results" / "savers.json"
MODELS = ("llama-3.1-8b", "qwen2.5-7b", "llama-2-7b")
CARD_GB = 8
FASTER_CARD_GB = 16
NO_SAVERS = {"loss": "full", "offload_activations": False, "offload_embeddings": False, "expandable_segments": False}

SAVERS = {
    "loss chunked": {"loss": "chunked"},
    "offload_embeddings": {"offload_embeddings": True},
    "offload_activations": {"offload_activations": True},
    "expandable_segments": {"expandable_segments": True},
}


def base_settings() -> Settings:
    return Settings(
        method="qlora",
        micro_batch=1,
        grad_accum=16,
        seq_len=2048,
        grad_ckpt=True,
        optimizer="paged_adamw_8bit",
    )


def variants(spec: models.ModelSpec) -> dict[str, Settings]:
    """No saver, each saver that applies to the model alone, and all of them."""
    base = base_settings()
    applicable = {
        name: update
        for name, update in SAVERS.items()
        if name != "offload_embeddings" or memory.embedding_offload_applies(spec, base)
    }
    found = {"none": base}
    found |= {name: base.model_copy(update=update) for name, update in applicable.items()}
    every: dict = {}
    for update in applicable.values():
        every |= update
    found["all"] = base.model_copy(update=every)
    return found


class Tracer:
    """The `--exact` figure of each variant: one trace per model and tensor-changing savers (expandable
    segments changes only the allocator, so it shares the trace without it)."""

    def __init__(self) -> None:
        self._depths: dict[tuple, object] = {}

    def exact(self, spec: models.ModelSpec, settings: Settings, gpu: hardware.GpuSpec) -> tuple[Estimate, float]:
        """The traced estimate and the host GiB the traced savers held at most."""
        from lorafit.train.build import quiet_libraries

        quiet_libraries()  # before torch and bitsandbytes load, as `lorafit estimate --exact` does
        from lorafit.trace import api

        traced = settings.model_copy(update={"expandable_segments": False})
        key = (spec.name, traced)
        if key not in self._depths:
            self._depths[key] = api.trace_runtime(spec, traced, memory.Runtime())
        depth = self._depths[key]
        estimate = memory.assemble(depth.step_peak(None), settings, memory.Runtime(), gpu, DEFAULT_HEADROOM)
        return estimate, depth.host_peak_bytes / 2**30


def plan_row(spec: models.ModelSpec, pinned: dict) -> dict:
    from lorafit.plan import make_plan
    from lorafit.schema import PlanRequest
    from lorafit.search import savers_on

    request = PlanRequest(model=spec, gpu=hardware.custom(FASTER_CARD_GB), fixed=pinned | {"method": "qlora"})
    found = make_plan(request)
    s = found.settings
    return {
        "micro_batch": s.micro_batch,
        "grad_accum": s.grad_accum,
        "grad_ckpt": s.grad_ckpt,
        "savers": savers_on(s),
        "device_gib": found.estimate.peak_device_gib,
        "tokens_per_s": found.tokens_per_s,
    }


def faster_plans(names: list[str]) -> list[dict]:
    """The 16 GB plan with the savers searched against the plan with them pinned off (what lorafit chose before
    it had them)."""
    print(f"\nthe plan on a {FASTER_CARD_GB} GB card (QLoRA, 2048 tokens), savers searched vs pinned off")
    print(f"{'model':<14} {'without savers':<26} {'tok/s':>7}   {'with savers':<44} {'tok/s':>7} {'speed':>6}")
    rows = []
    for name in names:
        spec = models.resolve(name)
        without, with_savers = plan_row(spec, NO_SAVERS), plan_row(spec, {})
        ratio = with_savers["tokens_per_s"] / without["tokens_per_s"]
        rows.append({"model": spec.name, "without_savers": without, "with_savers": with_savers, "speedup": ratio})

        def shape(row: dict) -> str:
            savers = f" + {', '.join(row['savers'])}" if row["savers"] else ""
            return f"mb {row['micro_batch']} x {row['grad_accum']}, {row['device_gib']:.1f} GiB{savers}"

        print(
            f"{spec.name:<14} {shape(without):<26} {without['tokens_per_s']:7.0f}   {shape(with_savers):<44} "
            f"{with_savers['tokens_per_s']:7.0f} {ratio:5.2f}x"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-exact", action="store_true", help="the analytic estimate only (no traces)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    gpu = hardware.custom(CARD_GB)
    usable = gpu.usable_gib(DEFAULT_HEADROOM)
    tracer = Tracer()
    rows = []
    started = time.perf_counter()
    print(
        f"QLoRA nf4 bf16, micro-batch 1 x 2048 tokens, checkpointing on, paged_adamw_8bit; device peak (nvidia-smi) "
        f"in GiB; fits: an {CARD_GB} GB card with {DEFAULT_HEADROOM:.0%} kept free ({usable:.2f} GiB)\n"
    )
    print(
        f"{'model':<14} {'savers':<22} {'estimate':>9} {'fits':>5} {'host':>6} {'--exact':>9} {'fits':>5} {'host':>6}"
    )
    for name in args.models.split(","):
        spec = models.resolve(name)
        for label, settings in variants(spec).items():
            analytic = memory.estimate(spec, settings, gpu, DEFAULT_HEADROOM)
            host_gib = memory.host_saver_bytes(spec, settings) / 2**30
            exact, exact_host_gib = (None, None) if args.no_exact else tracer.exact(spec, settings, gpu)
            row = {
                "model": spec.name,
                "savers": label,
                "settings": settings.model_dump(mode="json"),
                "estimate_device_gib": analytic.peak_device_gib,
                "estimate_phase": analytic.peak_phase,
                "estimate_fits": analytic.fits,
                "estimate_host_gib": round(host_gib, 4),
                "exact_device_gib": exact.peak_device_gib if exact else None,
                "exact_fits": exact.fits if exact else None,
                "exact_host_gib": round(exact_host_gib, 4) if exact else None,
            }
            rows.append(row)
            exact_cell = (
                f"{exact.peak_device_gib:9.2f} {'yes' if exact.fits else 'no':>5} {exact_host_gib:6.2f}"
                if exact
                else f"{'-':>9} {'':>5} {'':>6}"
            )
            print(
                f"{spec.name:<14} {label:<22} {analytic.peak_device_gib:9.2f} "
                f"{'yes' if analytic.fits else 'no':>5} {host_gib:6.2f} {exact_cell}"
            )
    print("\nhost: GiB of host RAM the offloads hold (pinned) beside the device peak")
    print(
        "\nexpandable_segments: its reserve comes from the caching allocator's simulation, not a measurement; "
        "see memory.EXPANDABLE_RESERVE_FIT"
    )
    faster = faster_plans(args.models.split(","))
    seconds = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "card_gb": CARD_GB,
        "headroom": DEFAULT_HEADROOM,
        "usable_gib": round(usable, 4),
        "loss_chunk_tokens": memory.LOSS_CHUNK_TOKENS,
        "seconds": round(seconds, 1),
        "rows": rows,
        "faster_card_gb": FASTER_CARD_GB,
        "faster_plans": faster,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
