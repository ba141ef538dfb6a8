"""The `--exact` trace beside the closed form, one row at a time, for the family benches (bench/hybrid_trace.py,
bench/moe_trace.py, bench/image_text_trace.py): the step's peak memory, and one micro-batch's time. Imported after
the bench has put src/ on sys.path."""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from lorafit import memory, timing
from lorafit.hardware import GpuSpec
from lorafit.models import resolve
from lorafit.schema import Settings

if TYPE_CHECKING:
    from lorafit.trace.optime import OpListTime

Rows = Callable[[list[str]], None]
TIME_TITLE = "one micro-batch on an {gpu}: the closed form beside the roofline over the traced op list"


def peak_gib(model: str, settings: Settings) -> tuple[float, float, float]:
    """The peak allocated GiB of the traced step and of the estimate, and the estimate's error in per cent."""
    from lorafit.trace import exact_estimate

    spec = resolve(model)
    traced = exact_estimate(spec, settings).peak_allocated_gib
    analytic = memory.estimate(spec, settings).peak_allocated_gib
    return traced, analytic, 100 * (analytic / traced - 1)


def micro_batch_times(model: str, settings: Settings, gpu: GpuSpec) -> tuple[OpListTime, timing.MicroBatchTime]:
    """One micro-batch's time on `gpu`: the roofline over the traced op list, and the time model's closed form."""
    from lorafit.trace.optime import trace_micro_batch

    spec = resolve(model)
    return trace_micro_batch(spec, settings).time(gpu), timing.micro_batch_time(spec, settings, gpu)


def main(doc: str, models: tuple[str, ...], memory_rows: Rows, time_rows: Rows) -> None:
    """A family bench's command line: its memory rows for --models, and its time rows with --time."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--models", default=",".join(models))
    parser.add_argument("--time", action="store_true", help="also the time model against the traced op list")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    memory_rows(args.models.split(","))
    if args.time:
        time_rows(args.models.split(","))
