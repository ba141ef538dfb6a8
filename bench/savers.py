"""`make bench-savers`: what each memory saver takes off a 7-8B QLoRA step at 2048 tokens, and whether it fits 8 GB.

For Llama-3.1-8B, Qwen2.5-7B and Llama-2-7B (QLoRA NF4, bf16, micro-batch 1 x 2048 tokens, checkpointing on,
paged 8-bit AdamW: the smallest step a planner would try on an 8 GB card), the device peak (nvidia-smi) with no
saver, with each saver alone and with all of them, side by side from the analytic estimate and from the
`--exact` trace of the real step, with the verdict on an 8 GB card with 10% kept free.

The trace runs the step transformers and peft run; the chunked loss and the two offloads are the trainer's own code
(lorafit.train.savers), which the traced step does not call yet: those rows say so instead of a traced figure.
expandable_segments changes only the allocator, so its traced row is the same traced tensors with the allocator
model of expandable segments (memory.reserved_bytes).

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
    """The `--exact` figure of each variant; one trace per model (the savers it can show share its tensors)."""

    def __init__(self) -> None:
        self._depths: dict[str, object] = {}

    def exact(self, spec: models.ModelSpec, settings: Settings, gpu: hardware.GpuSpec) -> Estimate | str:
        from lorafit.train.build import quiet_libraries

        quiet_libraries()  # before torch and bitsandbytes load, as `lorafit estimate --exact` does
        from lorafit.trace import api

        untraced = api.untraced_savers(settings)
        if untraced:
            return f"not traced: {', '.join(untraced)}"
        if spec.name not in self._depths:
            self._depths[spec.name] = api.trace_runtime(spec, settings, memory.Runtime())
        depth = self._depths[spec.name]
        return memory.assemble(
            depth.breakdown,
            depth.peak_phase,
            depth.transient_bytes,
            depth.paged_bytes,
            settings,
            memory.Runtime(),
            gpu,
            DEFAULT_HEADROOM,
            trainable=depth.trainable_params,
            total=depth.total_params,
        )


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
    print(f"{'model':<14} {'savers':<22} {'estimate':>9} {'fits':>5} {'--exact':>9} {'fits':>5}")
    for name in args.models.split(","):
        spec = models.resolve(name)
        for label, settings in variants(spec).items():
            analytic = memory.estimate(spec, settings, gpu, DEFAULT_HEADROOM)
            exact = None if args.no_exact else tracer.exact(spec, settings, gpu)
            traced = isinstance(exact, Estimate)
            row = {
                "model": spec.name,
                "savers": label,
                "settings": settings.model_dump(mode="json"),
                "estimate_device_gib": analytic.peak_device_gib,
                "estimate_phase": analytic.peak_phase,
                "estimate_fits": analytic.fits,
                "exact_device_gib": exact.peak_device_gib if traced else None,
                "exact_fits": exact.fits if traced else None,
                "exact_note": None if traced else exact or "--no-exact",
            }
            rows.append(row)
            exact_cell = (
                f"{exact.peak_device_gib:9.2f} {'yes' if exact.fits else 'no':>5}" if traced else f"{'-':>9} {'':>5}"
            )
            print(
                f"{spec.name:<14} {label:<22} {analytic.peak_device_gib:9.2f} "
                f"{'yes' if analytic.fits else 'no':>5} {exact_cell}"
            )
    if any(row["exact_note"] and row["exact_note"].startswith("not traced") for row in rows):
        print(
            "\n--exact '-': the chunked loss and the offloads run in lorafit.train.savers (the trainer), which the "
            "traced step does not call yet; those rows have the estimate only"
        )
    print(
        "\nexpandable_segments: its reserve is modelled (stranded 0.9 -> 0.2 GiB), not measured; see "
        "memory.EXPANDABLE_STRANDED_BYTES"
    )
    seconds = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "card_gb": CARD_GB,
        "headroom": DEFAULT_HEADROOM,
        "usable_gib": round(usable, 4),
        "loss_chunk_tokens": memory.LOSS_CHUNK_TOKENS,
        "seconds": round(seconds, 1),
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
