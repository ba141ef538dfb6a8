"""Where `lorafit measure` keeps its measurements, and their export as calibration rows. Pure Python: no torch.

Each measurement is one JSON line appended to `measurements.jsonl` in the user's cache (`$XDG_CACHE_HOME/lorafit/`,
else `~/.cache/lorafit/`, the folder `lorafit serve` keeps its uploads under). `lorafit measure --export FILE`
writes them all as rows of bench/calibration/measured_memory.csv, so that a user can contribute them.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from lorafit.errors import InvalidConfig
from lorafit.files import cache_folder, target_problem, write_atomic

# The header of bench/calibration/measured_memory.csv, the file the exported rows are added to
CALIBRATION_COLUMNS = [
    "id",
    "split",
    "split_reason",
    "stack",
    "source",
    "evidence",
    "kind",
    "model",
    "params_b",
    "method",
    "lora_r",
    "lora_targets",
    "quant",
    "precision",
    "optimizer",
    "micro_batch",
    "seq_len",
    "grad_ckpt",
    "attn",
    "gpu",
    "n_gpus",
    "peak_gb",
    "memory_metric",
    "tokens_per_s",
    "step_time_s",
    "notes",
]
CHECK_REASON = "not used to fit or choose anything"  # the calibration file's words for a check row


def measurements_file() -> Path:
    return cache_folder() / "measurements.jsonl"


def append(record: dict[str, Any], path: Path | None = None) -> Path:
    """Add one measurement as a line of the measurements file (the folder made where missing)."""
    path = path or measurements_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(record, separators=(",", ":")) + "\n")
    return path


def read_all(path: Path | None = None) -> list[dict[str, Any]]:
    """Every stored measurement, oldest first; a line that is not a measurement (a write cut short) is skipped."""
    path = path or measurements_file()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("measured"), dict):
            records.append(record)
    return records


def _figure(value: float | None) -> str:
    return "" if value is None else f"{value:g}"


def calibration_row(number: int, record: dict[str, Any]) -> dict[str, str]:
    """One measurement as a calibration row: a check row of kind "measured", its settings filled from the plan
    it ran. The memory figure is the allocated peak (GiB), with reserved and the device figure in the metric text
    as the FMS rows give nvidia-smi beside it; on the CPU there is none."""
    settings, measured, estimate = record["settings"], record["measured"], record["estimate"]
    allocated, reserved, device = (measured.get(f"peak_{k}_gib") for k in ("allocated", "reserved", "device"))
    if allocated is not None:
        metric = f"torch.cuda.max_memory_allocated (GiB, 2**30 bytes); max_memory_reserved {_figure(reserved)} GiB"
        if device is not None:
            metric += f"; nvidia-smi used = {device * 1024:.0f} MiB ({measured.get('peak_device_source')})"
    else:
        metric = "none: measured on the CPU" + (f" (peak resident memory {device:g} GiB)" if device is not None else "")
    timed = measured["step_seconds"][record["warmup_steps"] :]
    return {
        "id": f"LM-{number:03d}",
        "split": "check",
        "split_reason": CHECK_REASON,
        "stack": settings["stack"],
        "source": f"lorafit measure {record['lorafit']} on {record['device']}, {record['date']}",
        "evidence": (
            f"{record['warmup_steps']} warm-up + {record['steps']} timed steps: {measured['tokens_per_s']} tokens/s, "
            f"peak allocated {_figure(allocated) or '-'} GiB, reserved {_figure(reserved) or '-'} GiB, device "
            f"{_figure(device) or '-'} GiB"
        ),
        "kind": "measured",
        "model": record["model"],
        "params_b": f"{record['params_b']:g}",
        "method": settings["method"],
        "lora_r": str(settings["lora_r"]),
        "lora_targets": str(settings["lora_targets"]),
        "quant": settings["quant"],
        "precision": settings["precision"],
        "optimizer": settings["optimizer"],
        "micro_batch": str(settings["micro_batch"]),
        "seq_len": str(settings["seq_len"]),
        "grad_ckpt": "on" if settings["grad_ckpt"] else "off",
        "attn": settings["attn"],
        "gpu": record["device"],
        "n_gpus": "1",
        "peak_gb": _figure(allocated),
        "memory_metric": metric,
        "tokens_per_s": _figure(measured["tokens_per_s"]),
        "step_time_s": f"{sum(timed) / len(timed):.4g}" if timed else "",
        "notes": (
            f"random weights at the model's shapes, rows of {settings['seq_len']} random tokens, grad_accum "
            f"{settings['grad_accum']}; lorafit's estimate for {record['card']}: {estimate['tokens_per_s']} tokens/s, "
            f"allocated {estimate['peak_allocated_gib']} / reserved {estimate['peak_reserved_gib']} / device "
            f"{estimate['peak_device_gib']} GiB; versions {record.get('versions', {})}"
        ),
    }


def export(path: Path, records: list[dict[str, Any]]) -> int:
    """Write `records` as calibration rows to a new file at `path`; an existing one is never replaced. The count."""
    problem = target_problem(path)
    if problem:
        raise InvalidConfig(f"--export {path} {problem}")
    if path.exists():
        raise InvalidConfig(f"--export {path} exists; name a new file (measurements are never written over a file)")
    if not records:
        raise InvalidConfig(f"no measurements stored in {measurements_file()}; run `lorafit measure` first")
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=CALIBRATION_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(calibration_row(number, record) for number, record in enumerate(records, start=1))
    write_atomic(path, text.getvalue())
    return len(records)
