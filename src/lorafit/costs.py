"""What a run costs and how sure its hours are: renting vs owning the card, and the range around the time model's
hours from its error on published runs (catalog/time_accuracy.toml, written by `make bench-throughput`). The
Plan's speed, hours and costs come from `time_and_cost`; the speed itself from lorafit.timing."""

from __future__ import annotations

import functools
import tomllib
from importlib import resources

from lorafit.hardware import GpuSpec


# --- cost ---------------------------------------------------------------------------------------------------
def costs(
    gpu: GpuSpec | None, n_gpus: int, hours: float, kwh_price: float
) -> tuple[float | None, float | None, float | None]:
    """Renting vs owning: cloud price per hour, or board power x hours x electricity; break-even in runs."""
    if gpu is None:
        return None, None, None
    cloud = hours * gpu.rent_usd_per_hour * n_gpus if gpu.rent_usd_per_hour is not None else None
    local = hours * gpu.board_power_w / 1000 * kwh_price * n_gpus
    break_even = None
    if cloud is not None and gpu.price_usd and cloud > local:
        break_even = gpu.price_usd * n_gpus / (cloud - local)
    return cloud, local, break_even


# --- how far off the time is -------------------------------------------------------------------------------
# A class of runs needs this many check rows of its own for its range; with fewer, the next wider class's.
MIN_KIND_ROWS = 5


@functools.cache
def time_accuracy() -> dict[str, dict]:
    """catalog/time_accuracy.toml: the time model's signed error on the check rows of `make bench-throughput`,
    by class of run ("consumer, one GPU", "one GPU", "all", ...), as that command wrote it."""
    text = resources.files("lorafit").joinpath("catalog/time_accuracy.toml").read_text()
    return dict(tomllib.loads(text)["kind"])


def run_classes(kind: str, n_gpus: int) -> tuple[str, str, str]:
    """The classes a run's error is read from, narrowest first: its GPU kind and GPU count, its GPU count, all."""
    scope = "one GPU" if n_gpus == 1 else "several GPUs"
    return f"{kind}, {scope}", scope, "all"


def accuracy_of(gpu: GpuSpec, n_gpus: int = 1) -> tuple[str, dict]:
    """(class, its entry): the narrowest of run_classes with MIN_KIND_ROWS check rows."""
    table = time_accuracy()
    for name in run_classes(gpu.kind, n_gpus):
        entry = table.get(name)
        if entry is not None and entry["rows"] >= MIN_KIND_ROWS:
            return name, entry
    return "all", table["all"]


def hours_range(gpu: GpuSpec | None, hours: float, n_gpus: int = 1) -> tuple[float, float] | None:
    """The likely hours, low to high. A row's error e is (predicted - measured) / measured tokens/s, so the run
    takes hours x (1 + e): the 10th and 90th percentiles of e over the run's class (accuracy_of) bound it."""
    if gpu is None or not hours:
        return None
    _, entry = accuracy_of(gpu, n_gpus)
    return round(hours * max(1 + entry["low"], 0.05), 3), round(hours * (1 + entry["high"]), 3)


def time_and_cost(
    gpu: GpuSpec | None, n_gpus: int, speed: float, total_tokens: float, kwh_price: float
) -> dict[str, float | tuple[float, float] | None]:
    """The Plan's speed, hours (with their likely range) and costs for `total_tokens` at `speed` tokens/s,
    rounded as a Plan shows them."""
    hours = total_tokens / speed / 3600 if speed else 0.0
    cloud, local, break_even = costs(gpu, n_gpus, hours, kwh_price)
    return {
        "tokens_per_s": round(speed, 1),
        "hours": round(hours, 3),
        "hours_range": hours_range(gpu, hours, n_gpus),
        "cost_cloud_usd": None if cloud is None else round(cloud, 2),
        "cost_local_usd": None if local is None else round(local, 2),
        "break_even_runs": None if break_even is None else round(break_even, 1),
    }
