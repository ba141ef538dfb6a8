"""Predicted vs published training throughput (tokens/s per GPU), side by side, for the calibration rows that
report a speed. Run: `make bench-throughput`.

Roles: "fit" rows set the three constants of lorafit/plan.py (MAX_MFU from FMS-01, LORA_BACKWARD_PASSES from
FMS-03, QLORA_SLOWDOWN from FMS-06), so their error only shows the fit; "check" rows are other batch sizes of the
same Hugging Face Trainer set-up and are the real test. "reference" rows ran other stacks (torchtune with
torch.compile, fms-acceleration's fused kernels) and are printed, not scored.
"""

from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path

from lorafit import hardware, models
from lorafit.plan import tokens_per_second
from lorafit.schema import Settings

CALIBRATION = Path(__file__).resolve().parents[1].parent / "shared" / "calibration" / "measured_memory.csv"

# row id -> (preset, gpu, settings, role). Settings are those the row's source states (see its notes column).
FMS = dict(seq_len=4096, grad_ckpt=True, attn="flash", lora_r=16, lora_targets="attn")
ROWS: dict[str, tuple[str, str, dict, str]] = {
    "FMS-01": ("mistral-7b-v0.1", "A100 80GB", dict(FMS, method="full", quant="none", micro_batch=4), "fit"),
    "FMS-03": ("mistral-7b-v0.1", "A100 80GB", dict(FMS, method="lora", quant="none", micro_batch=4), "fit"),
    "FMS-04": ("mistral-7b-v0.1", "A100 80GB", dict(FMS, method="lora", quant="none", micro_batch=8), "check"),
    "FMS-06": ("mistral-7b-v0.1", "A100 80GB", dict(FMS, method="qlora", micro_batch=4), "fit"),
    "FMS-07": ("mistral-7b-v0.1", "A100 80GB", dict(FMS, method="qlora", micro_batch=8), "check"),
    "FMS-10": ("llama-2-70b", "A100 80GB", dict(FMS, method="qlora", micro_batch=4), "reference"),
    "TT-12": (
        "llama-3.1-8b",
        "RTX 4090",
        dict(method="qlora", micro_batch=2, seq_len=2048, grad_ckpt=False, lora_r=8),
        "reference",
    ),
    "TT-10": (
        "llama-3.1-8b",
        "RTX 4090",
        dict(method="lora", quant="none", micro_batch=2, seq_len=2048, grad_ckpt=False, lora_r=8),
        "reference",
    ),
    "TT-11": (
        "llama-3.1-8b",
        "RTX A6000",
        dict(method="lora", quant="none", micro_batch=2, seq_len=2048, grad_ckpt=False, lora_r=8),
        "reference",
    ),
    "TT-01": (
        "llama-2-7b",
        "RTX 4090",
        dict(method="qlora", micro_batch=4, seq_len=2048, grad_ckpt=False, lora_r=8),
        "reference",
    ),
}


def published() -> dict[str, float]:
    if not CALIBRATION.is_file():
        sys.exit(f"calibration file not found: {CALIBRATION}")
    with CALIBRATION.open() as handle:
        return {row["id"]: float(row["tokens_per_s"]) for row in csv.DictReader(handle) if row["tokens_per_s"]}


def main() -> None:
    measured = published()
    errors: dict[str, list[float]] = {"fit": [], "check": []}
    print(f"{'row':8} {'model':16} {'gpu':10} {'method':6} {'published':>10} {'lorafit':>9} {'error':>7}  role")
    for row_id, (preset, gpu_name, fields, role) in ROWS.items():
        spec, gpu = models.resolve(preset), hardware.resolve(gpu_name)
        predicted = tokens_per_second(spec, Settings(**fields), gpu)
        truth = measured[row_id]
        error = (predicted - truth) / truth
        errors.get(role, []).append(abs(error))
        print(
            f"{row_id:8} {preset:16} {gpu_name:10} {fields['method']:6} {truth:10.0f} {predicted:9.0f} "
            f"{error:+7.1%}  {role}"
        )
    for role, values in errors.items():
        print(f"{role} rows: {len(values)}, median |error| {statistics.median(values):.1%}, worst {max(values):.1%}")


if __name__ == "__main__":
    main()
