"""`make bench-memory`: lorafit's peak-memory estimate against published measurements, and against the other
calculators a user would reach for, run on the same rows in the same process.

Input: bench/calibration/measured_memory.csv (published peak-memory figures, each with its source, settings,
`memory_metric` and `split`: `fit` rows were used to fit a constant or choose a runtime term of lorafit, `check`
rows were not; bench/calibration/README.md). Every row ends in exactly one group, and the output says which and why:

- scored: a measurement whose model lorafit can describe and whose settings follow from the row, its notes and
  the framework it names. lorafit is compared like with like: `peak_allocated` for max_memory_allocated (and
  torchtune's "memory active"), `peak_reserved` for max_memory_reserved, `peak_device` for nvidia-smi; in the
  unit the row states (GB = 1e9 bytes, GiB = 2**30). Rows that report nvidia-smi beside allocated (FMS-*) give a
  second scored figure, `<id> smi`.
- bound: a capacity statement ("OOM on 24 GB"), checked as a bound.
- shown, not scored: a measurement that does not say whether it is allocated, reserved or nvidia-smi, or whose
  settings are known but include something lorafit does not model (torch.compile, load-time reservation); shown
  with lorafit's three figures, not counted.
- excluded: architecture lorafit does not model, settings that cannot be determined, or a figure that is not a
  training-step peak; the reason is printed.
- estimate: rules of thumb of other tools (kind = estimate): not measurements, shown separately.

Rows measured on this machine (bench/cpu_measured.py, real CPU steps under a live-tensor tracker) are scored too
when that module is present, against `peak_allocated` with Runtime(device="cpu").

Prints one line per row and the summary: the headline is the median and worst absolute % error on the check rows
only, per metric (allocated, reserved, device = nvidia-smi); the fit rows are summed up apart, labelled as such;
each calculator is compared with lorafit on the check figures it covers. Writes bench/out/memory_accuracy.json.

    python bench/memory_accuracy.py [--csv PATH] [--rows ID,ID,...] [--no-competitors] [--no-cpu] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from calibration_rows import (
    DEFAULT_CSV,
    EXCLUDED,
    FRAMEWORK_OF_PREFIX,
    GB,
    METRICS,
    MIB,
    ROW_SETUP,
    STACK_ROWS,
    UNSCORED,
    Mapping,
    Metric,
    Row,
    Unmappable,
    gpu_gib_of,
    map_row,
    nvidia_smi_mib,
    prefix_of,
    read_rows,
    resolve_model,
)
from lorafit import stacks
from lorafit.memory import GIB, Runtime
from lorafit.models import ModelSpec
from lorafit.schema import Settings
from torchtune_step import estimate
from unsloth_releases import DYNAMIC_REPO, UNSLOTH_RELEASE_LOSS, after_loading_gib, loaded_bytes

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
DEFAULT_OUT = BENCH_DIR / "out" / "memory_accuracy.json"

TARGET_MEDIAN_PCT = 5.0
TARGET_WORST_PCT = 15.0
# issue 28's acceptance for the stacks `--stack` offers, on check rows: worst |error| and worst under-prediction
STACK_WORST_PCT = 12.0
STACK_UNDER_PCT = 5.0

ESTIMATE_FIELD: dict[str, str] = {
    "allocated": "peak_allocated_gib",
    "reserved": "peak_reserved_gib",
    "device": "peak_device_gib",
}


# --- scoring --------------------------------------------------------------------------------------------------
@dataclass
class Figure:
    """One measured number compared with one lorafit figure (and the calculators' headline figures)."""

    label: str
    row_id: str
    model: str
    method: str
    metric: Metric
    unit: str
    unit_bytes: int
    measured_bytes: float
    predicted_bytes: float
    notes: list[str]
    split: str = "check"  # the row's split; "machine" for the rows measured here (not in the CSV)
    stack: str = ""  # the trainer the row ran (the CSV's `stack` column)
    competitors: dict[str, float | str] = field(default_factory=dict)  # bytes, or the reason there is none

    @property
    def error_pct(self) -> float:
        return 100 * (self.predicted_bytes - self.measured_bytes) / self.measured_bytes

    def competitor_error_pct(self, name: str) -> float | None:
        value = self.competitors.get(name)
        if not isinstance(value, float):
            return None
        return 100 * (value - self.measured_bytes) / self.measured_bytes


@dataclass
class Report:
    figures: list[Figure] = field(default_factory=list)
    bounds: list[dict[str, Any]] = field(default_factory=list)
    unscored: list[dict[str, Any]] = field(default_factory=list)
    excluded: list[dict[str, Any]] = field(default_factory=list)
    estimates: list[dict[str, Any]] = field(default_factory=list)
    competitors_missing: dict[str, str] = field(default_factory=dict)
    cpu_rows: str = ""


def predicted_bytes(mapping: Mapping, metric: Metric) -> float:
    """lorafit's figure for the row: at its length, or, for a padded row whose peak may be at a shorter length
    (Mapping.shorter), the higher of the two."""
    lengths = [mapping.settings] + ([mapping.shorter] if mapping.shorter else [])
    results = [estimate(mapping.spec, settings, mapping.gpu, runtime=mapping.runtime) for settings in lengths]
    return max(getattr(result, ESTIMATE_FIELD[metric]) for result in results) * GIB


def lorafit_figures_gib(mapping: Mapping) -> dict[str, float]:
    result = estimate(mapping.spec, mapping.settings, mapping.gpu, runtime=mapping.runtime)
    return {metric: round(getattr(result, name), 3) for metric, name in ESTIMATE_FIELD.items()}


def figures_of(row: Row, mapping: Mapping) -> list[Figure]:
    assert row.peak is not None and row.unit is not None and row.metric in ESTIMATE_FIELD
    name, unit_bytes = row.unit
    common = dict(
        row_id=row.id, model=row.model, method=row.method, notes=mapping.notes, split=row.split, stack=row.raw["stack"]
    )
    figures = [
        Figure(
            label=row.id,
            metric=row.metric,
            unit=name,
            unit_bytes=unit_bytes,
            measured_bytes=row.peak * unit_bytes,
            predicted_bytes=predicted_bytes(mapping, row.metric),
            **common,
        )
    ]
    if (smi_mib := nvidia_smi_mib(row.raw["memory_metric"])) is not None:
        figures.append(
            Figure(
                label=f"{row.id} smi",
                metric="device",
                unit="GiB",
                unit_bytes=2**30,
                measured_bytes=smi_mib * MIB,
                predicted_bytes=predicted_bytes(mapping, "device"),
                **common,
            )
        )
    return figures


def build_report(rows: list[Row]) -> tuple[Report, dict[str, Mapping]]:
    """Sort every row into its group; returns the mapped settings of the scored rows for the calculators."""
    report, mappings = Report(), {}
    for row in rows:
        spec = resolve_model(row.model)
        entry: dict[str, Any] = {
            "id": row.id,
            "model": row.model,
            "method": row.method,
            "measured": row.raw["peak_gb"],
            "memory_metric": row.raw["memory_metric"],
            "split": row.split,
        }
        if row.kind == "estimate":
            entry["reason"] = "kind = estimate: another tool's rule of thumb or an interpolated bound"
            if isinstance(spec, ModelSpec) and row.id in ROW_SETUP:
                with contextlib.suppress(Unmappable):
                    entry["lorafit_gib"] = lorafit_figures_gib(map_row(row, spec))
            report.estimates.append(entry)
            continue
        if row.id in EXCLUDED:
            report.excluded.append(entry | {"reason": EXCLUDED[row.id]})
            continue
        if not row.raw["peak_gb"].strip() and not row.raw["memory_metric"].strip():
            report.excluded.append(entry | {"reason": "no memory figure: a speed-only row (make bench-throughput)"})
            continue
        if isinstance(spec, str):
            report.excluded.append(entry | {"reason": spec})
            continue
        try:
            mapping = map_row(row, spec)
        except Unmappable as error:
            if row.metric is None:
                report.unscored.append(entry | {"reason": f"metric not stated; also {error}"})
            else:
                report.excluded.append(entry | {"reason": str(error)})
            continue
        if row.id in UNSCORED:
            report.unscored.append(entry | {"reason": UNSCORED[row.id], "lorafit_gib": lorafit_figures_gib(mapping)})
            continue
        if row.metric is None or row.unit is None and row.metric in ESTIMATE_FIELD:
            report.unscored.append(
                entry
                | {
                    "reason": "memory metric (or its unit) not stated: allocated, "
                    "reserved and nvidia-smi differ by GBs",
                    "lorafit_gib": lorafit_figures_gib(mapping),
                }
            )
            continue
        if row.metric in ("bound", "oom"):
            report.bounds.append(bound_check(row, mapping) | entry)
            continue
        if row.peak is None:
            report.excluded.append(entry | {"reason": "no figure"})
            continue
        mappings[row.id] = mapping
        report.figures.extend(figures_of(row, mapping))
    return report, mappings


def bound_check(row: Row, mapping: Mapping) -> dict[str, Any]:
    """'fits within X' passes when lorafit's device peak is <= X; 'OOM on X' when it is > X (the GPU's capacity
    as the catalog states it)."""
    device_gib = estimate(mapping.spec, mapping.settings, runtime=mapping.runtime).peak_device_gib
    capacity_gib = gpu_gib_of(row.raw["gpu"]) if row.metric == "oom" else (row.peak or 0) * GB / GIB
    passed = device_gib > capacity_gib if row.metric == "oom" else device_gib <= capacity_gib
    return {
        "check": "OOM: predicted > capacity" if row.metric == "oom" else "fits: predicted <= bound",
        "capacity_gib": round(capacity_gib, 2),
        "lorafit_device_gib": round(device_gib, 2),
        "passed": passed,
        "notes": mapping.notes,
    }


# --- rows measured on this machine ----------------------------------------------------------------------------
def cpu_figures() -> tuple[list[Figure], str]:
    """Rows from bench/cpu_measured.py (real CPU steps under a live-tensor tracker), when that module exists."""
    path = BENCH_DIR / "cpu_measured.py"
    if not path.exists():
        return [], "skipped: bench/cpu_measured.py is not in this tree"
    module_spec = importlib.util.spec_from_file_location("cpu_measured", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    figures = []
    for index, measured in enumerate(module.measure_rows(), start=1):
        spec = ModelSpec.model_validate(measured["spec"])
        settings = Settings.model_validate(measured["settings"])
        runtime = Runtime(**(measured.get("runtime") or {}) | {"device": "cpu"})
        mapping = Mapping(spec, settings, runtime, [measured.get("name", "")])
        figures.append(
            Figure(
                label=f"CPU-{index:02d}",
                row_id=f"CPU-{index:02d}",
                model=spec.name,
                method=settings.method,
                metric="allocated",
                unit="MiB",
                unit_bytes=MIB,
                measured_bytes=float(measured["measured_allocated_bytes"]),
                predicted_bytes=predicted_bytes(mapping, "allocated"),
                notes=mapping.notes,
                split="machine",
            )
        )
    return figures, f"{len(figures)} rows from bench/cpu_measured.py"


# --- the other calculators ------------------------------------------------------------------------------------
def run_competitors(report: Report, mappings: dict[str, Mapping], rows: dict[str, Row]) -> list[str]:
    """Fill each figure's competitors with the calculators' figures (bytes) or the reason there is none."""
    sys.path.insert(0, str(BENCH_DIR))
    from competitors import NOT_RUN, NotApplicable, Query, available

    with contextlib.suppress(ImportError):  # the calculators build models through transformers: keep it quiet
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
    ready, missing = available()
    report.competitors_missing = missing | {name: f"not run: {reason}" for name, reason in NOT_RUN.items()}
    cache: dict[tuple[str, str], float | str] = {}
    for figure in report.figures:
        mapping = mappings.get(figure.row_id)
        if mapping is None:  # rows measured on this machine: tiny CPU models, no calculator covers them
            continue
        query = Query(mapping.spec, mapping.settings, gpu_gib_of(rows[figure.row_id].raw["gpu"]))
        for competitor in ready:
            key = (competitor.name, figure.row_id)
            if key not in cache:
                try:
                    with (
                        warnings.catch_warnings(),
                        contextlib.redirect_stdout(io.StringIO()),
                        contextlib.redirect_stderr(io.StringIO()),
                    ):
                        warnings.simplefilter("ignore")
                        cache[key] = float(competitor.predict(query))
                except NotApplicable as reason:
                    cache[key] = f"n/a: {reason}"
                except Exception as error:  # the calculator's own failure is a result to report
                    cache[key] = f"error: {type(error).__name__}: {error}"
            figure.competitors[competitor.name] = cache[key]
    return [competitor.name for competitor in ready]


EXACT = "lorafit --exact"
# Runtime flags the trace reproduces (it runs lorafit's own code path: transformers 5, peft, bitsandbytes 0.50);
# a row that needs any other flag ran code the trace does not, so the trace is not scored on it.
EXACT_RUNTIME_FIELDS = {"fused_optimizer", "kbit_upcast", "autocast", "device"}


def exact_reason(mapping: Mapping) -> str | None:
    """Why the trace cannot reproduce this row's step, or None."""
    defaults = type(mapping.runtime)()
    other = [
        name
        for name in type(mapping.runtime).model_fields
        if name not in EXACT_RUNTIME_FIELDS
        and name not in ("cuda_context_gib", "nccl_gib")
        and getattr(mapping.runtime, name) != getattr(defaults, name)
    ]
    if other:
        return f"n/a: the row's stack differs from the traced code path ({', '.join(other)})"
    if mapping.settings.n_gpus > 1:
        return "n/a: the trace runs one GPU"
    if mapping.settings.quant == "int8":
        return "n/a: int8 is not traced"
    return None


def run_exact(report: Report, mappings: dict[str, Mapping]) -> list[str]:
    """The `--exact` trace of each row's step, beside the analytic estimate, with the same device-side model."""
    from lorafit.trace import exact_estimate

    cache: dict[str, Any] = {}
    for figure in report.figures:
        mapping = mappings.get(figure.row_id)
        if mapping is None:  # the rows measured on this machine were measured with the tracer itself
            continue
        if figure.row_id not in cache:
            reason = exact_reason(mapping)
            if reason:
                cache[figure.row_id] = reason
            else:
                # flash-attn is not installed here; its kernel saves what sdpa's does (q, k, v, output, logsumexp)
                settings = mapping.settings
                if settings.attn == "flash":
                    settings = settings.model_copy(update={"attn": "sdpa"})
                try:
                    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
                        warnings.simplefilter("ignore")
                        cache[figure.row_id] = exact_estimate(mapping.spec, settings, runtime=mapping.runtime)
                except Exception as error:  # a refusal of the tracer is a result to report
                    cache[figure.row_id] = f"error: {type(error).__name__}: {str(error).splitlines()[0]}"
        traced = cache[figure.row_id]
        figure.competitors[EXACT] = (
            traced if isinstance(traced, str) else float(getattr(traced, ESTIMATE_FIELD[figure.metric]) * GIB)
        )
    return [EXACT]


# --- output ---------------------------------------------------------------------------------------------------
def summary(errors: list[float]) -> dict[str, float | int]:
    absolute = [abs(error) for error in errors]
    if not absolute:
        return {"n": 0}
    return {
        "n": len(absolute),
        "median_abs_pct": round(statistics.median(absolute), 2),
        "worst_abs_pct": round(max(absolute), 2),
        "within_15_pct": sum(error <= TARGET_WORST_PCT for error in absolute),
    }


def fmt_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1f}"


def print_report(
    report: Report, competitor_names: list[str], seconds: float, apart: frozenset[str] = frozenset()
) -> dict[str, Any]:
    short = {name: name[:12] for name in competitor_names}
    header = (
        f"{'id':<11} {'split':<5} {'model':<30} {'method':<6} {'metric':<9} {'measured':>11} {'lorafit':>11} "
        f"{'err%':>7}" + "".join(f" {short[name]:>12}" for name in competitor_names)
    )
    print("Scored rows (error % = (predicted - measured) / measured; calculators' headline figures in the same unit)")
    print(header)
    print("-" * len(header))
    for figure in report.figures:
        unit = figure.unit
        print(
            f"{figure.label:<11} {figure.split:<5} {figure.model[:30]:<30} {figure.method:<6} {figure.metric:<9} "
            f"{figure.measured_bytes / figure.unit_bytes:>7.2f} {unit:<3} "
            f"{figure.predicted_bytes / figure.unit_bytes:>7.2f} {unit:<3} {figure.error_pct:>+7.1f}"
            + "".join(f" {fmt_pct(figure.competitor_error_pct(name)):>12}" for name in competitor_names)
        )
        for note in figure.notes if figure.label == figure.row_id else []:
            print(f"{'':<11}   - {note}")

    print()
    print(f"Bound checks ({len(report.bounds)}):")
    for bound in report.bounds:
        print(
            f"  {bound['id']:<8} {bound['check']}: lorafit device {bound['lorafit_device_gib']} GiB vs "
            f"{bound['capacity_gib']} GiB -> {'pass' if bound['passed'] else 'FAIL'}"
        )
    print(f"\nShown, not scored ({len(report.unscored)}): measured; lorafit allocated / reserved / device")
    for entry in report.unscored:
        figures = entry.get("lorafit_gib")
        shown = f"{figures['allocated']} / {figures['reserved']} / {figures['device']} GiB" if figures else "-"
        print(f"  {entry['id']:<8} {entry['measured']:>6} ({entry['memory_metric'][:44]}); lorafit {shown}")
        print(f"  {'':<8} {entry['reason']}")
    print(f"\nExcluded ({len(report.excluded)}):")
    for entry in report.excluded:
        print(f"  {entry['id']:<8} {entry['model'][:34]:<34} {entry['reason']}")
    print(f"\nEstimates of other tools, not measurements ({len(report.estimates)}):")
    for entry in report.estimates:
        extra = f"; lorafit device {entry['lorafit_gib']['device']} GiB" if entry.get("lorafit_gib") else ""
        print(
            f"  {entry['id']:<8} {entry['model'][:34]:<34} {entry['measured']:>6} ({entry['memory_metric'][:50]})"
            f"{extra}"
        )
    print(f"\nRows measured on this machine: {report.cpu_rows}")
    for name, reason in report.competitors_missing.items():
        print(f"Calculator {name}: {reason}")

    print("\nSummary")
    rows_scored = len({figure.row_id for figure in report.figures})
    print(
        f"  rows: {rows_scored} scored ({len(report.figures)} figures, nvidia-smi second figures included), "
        f"{len(report.bounds)} bound-checked ({sum(b['passed'] for b in report.bounds)} pass), "
        f"{len(report.unscored)} shown not scored, {len(report.excluded)} excluded, "
        f"{len(report.estimates)} estimates shown apart"
    )
    # the rows of a stack estimated from its source (STACK_ROWS) have their own target: reported apart, below
    check = [figure for figure in report.figures if figure.split == "check" and figure.row_id not in apart]
    fit = [figure for figure in report.figures if figure.split == "fit" and figure.row_id not in apart]
    machine = [figure for figure in report.figures if figure.split == "machine"]
    print(
        f"  Headline: check rows only ({len({f.row_id for f in check})} rows, {len(check)} figures; never used to "
        "fit or choose anything, bench/calibration/README.md"
        + (f"; the --stack {', '.join(STACK_ROWS)} rows apart, below)" if apart else ")")
    )
    headline = per_metric(check)
    print_per_metric(headline)
    print(f"    all   {summary_line(summary([figure.error_pct for figure in check]))}")
    print(
        f"    target: median <= {TARGET_MEDIAN_PCT} %, every figure <= {TARGET_WORST_PCT} %; "
        "worst check figures: " + worst_labels(check)
    )
    by_method = {
        method: summary([figure.error_pct for figure in check if figure.method == method])
        for method in ("full", "lora", "qlora")
    }
    for method, numbers in by_method.items():
        if numbers["n"]:
            print(f"    {method:<5} {summary_line(numbers)}")
    by_stack = per_stack(check)
    print(
        f"  Per stack, check figures (issue 28: the offered stacks median <= {TARGET_MEDIAN_PCT} %, worst <= "
        f"{STACK_WORST_PCT} %, never under by more than {STACK_UNDER_PCT} %):"
    )
    offered = {stack.name for stack in stacks.offered()}
    for stack, numbers in by_stack.items():
        print(f"    {stack:<13} {stack_line(numbers)}{'' if stack in offered else ' (not offered by --stack)'}")
    print(
        f"  Fit rows ({len({f.row_id for f in fit})} rows, {len(fit)} figures; used to fit a constant or choose a "
        "runtime term, so their error shows the fit, not the accuracy)"
    )
    fitted = per_metric(fit)
    print_per_metric(fitted)
    print(f"    worst fit figures: {worst_labels(fit)}")
    on_machine = summary([figure.error_pct for figure in machine])
    if machine:
        print(f"  Measured on this machine (bench/cpu_measured.py, allocated): {summary_line(on_machine)}")
    print("  Other calculators, on the check figures each covers (lorafit on the same figures in brackets):")
    competitors_summary = {}
    for name in competitor_names:
        covered = [figure for figure in check if figure.competitor_error_pct(name) is not None]
        theirs = summary([figure.competitor_error_pct(name) for figure in covered])
        ours = summary([figure.error_pct for figure in covered])
        competitors_summary[name] = {"self": theirs, "lorafit_same_rows": ours}
        if theirs["n"]:
            print(
                f"    {name:<14} median |err| {theirs['median_abs_pct']} %, worst {theirs['worst_abs_pct']} % on "
                f"{theirs['n']} figures (lorafit: median {ours['median_abs_pct']} %, worst {ours['worst_abs_pct']} %)"
            )
        else:
            print(f"    {name:<14} covers none of the check figures")
    print(f"  ({seconds:.0f} s)")
    return {
        "headline_check": headline | {"all": summary([figure.error_pct for figure in check])},
        "fit": fitted | {"all": summary([figure.error_pct for figure in fit])},
        "machine": on_machine,
        "lorafit": summary([figure.error_pct for figure in report.figures]),
        "lorafit_by_method_check": by_method,
        "lorafit_by_stack_check": by_stack,
        "competitors_check": competitors_summary,
        "rows_scored": rows_scored,
        "figures_scored": len(report.figures),
    }


def per_metric(figures: list[Figure]) -> dict[str, dict[str, float | int]]:
    """The summary of each metric's figures: allocated, reserved and device (nvidia-smi) apart."""
    return {metric: summary([figure.error_pct for figure in figures if figure.metric == metric]) for metric in METRICS}


def per_stack(figures: list[Figure]) -> dict[str, dict[str, Any]]:
    """Each trainer's figures apart, with the worst under-prediction (the unsafe direction) and the verdict
    against the offered stacks' target (issue 28)."""
    found: dict[str, dict[str, Any]] = {}
    for stack in sorted({figure.stack for figure in figures}):
        errors = [figure.error_pct for figure in figures if figure.stack == stack]
        numbers: dict[str, Any] = dict(summary(errors))
        numbers["worst_under_pct"] = round(min(0.0, *errors), 2)
        numbers["meets_target"] = (
            numbers["median_abs_pct"] <= TARGET_MEDIAN_PCT
            and numbers["worst_abs_pct"] <= STACK_WORST_PCT
            and numbers["worst_under_pct"] >= -STACK_UNDER_PCT
        )
        found[stack] = numbers
    return found


def stack_line(numbers: dict[str, Any]) -> str:
    return (
        f"{numbers['n']:>3} figures: median |err| {numbers['median_abs_pct']} %, worst {numbers['worst_abs_pct']} %, "
        f"worst under {numbers['worst_under_pct']} % -> {'meets' if numbers['meets_target'] else 'misses'} the target"
    )


def summary_line(numbers: dict[str, float | int]) -> str:
    if not numbers["n"]:
        return "no figures"
    return (
        f"{numbers['n']:>3} figures: median |err| {numbers['median_abs_pct']} %, worst {numbers['worst_abs_pct']} % "
        f"({numbers['within_15_pct']}/{numbers['n']} within {TARGET_WORST_PCT:.0f} %)"
    )


def print_per_metric(numbers: dict[str, dict[str, float | int]]) -> None:
    for metric in METRICS:
        print(f"    {metric:<9} {summary_line(numbers[metric])}")


def worst_labels(figures: list[Figure], count: int = 5) -> str:
    worst = sorted(figures, key=lambda figure: -abs(figure.error_pct))[:count]
    return ", ".join(f"{figure.label} {figure.error_pct:+.1f} %" for figure in worst) or "-"


def to_json(report: Report, totals: dict[str, Any]) -> dict[str, Any]:
    def figure_json(figure: Figure) -> dict[str, Any]:
        return {
            "label": figure.label,
            "id": figure.row_id,
            "model": figure.model,
            "method": figure.method,
            "metric": figure.metric,
            "unit": figure.unit,
            "measured": round(figure.measured_bytes / figure.unit_bytes, 3),
            "lorafit": round(figure.predicted_bytes / figure.unit_bytes, 3),
            "error_pct": round(figure.error_pct, 2),
            "split": figure.split,
            "notes": figure.notes,
            "competitors": {
                name: (
                    {
                        "predicted": round(value / figure.unit_bytes, 3),
                        "error_pct": round(figure.competitor_error_pct(name), 2),
                    }
                    if isinstance(value, float)
                    else {"reason": value}
                )
                for name, value in figure.competitors.items()
            },
        }

    return {
        "summary": totals,
        "scored": [figure_json(figure) for figure in report.figures],
        "bounds": report.bounds,
        "unscored": report.unscored,
        "excluded": report.excluded,
        "estimates": report.estimates,
        "calculators_not_run": report.competitors_missing,
        "cpu_rows": report.cpu_rows,
    }


# The targets for the rows of a stack lorafit estimates from its source (Unsloth's): on check rows whose
# sequence length is fixed, median and worst |error|; where the source padded each batch to its longest row, the
# estimate at the length cap must never be below the measurement
STACK_TARGET_MEDIAN_PCT = 10.0
STACK_TARGET_WORST_PCT = 20.0


def before_the_fused_loss(row_id: str) -> bool:
    """An Unsloth row of a release before its fused loss (2025-08-13): its loss replayed (UNSLOTH_RELEASE_LOSS),
    a step further from the pinned one than the later rows'."""
    return UNSLOTH_RELEASE_LOSS.get(row_id, {}).get("loss") in ("compute_logits", "cut_ce")


def print_check_figures(label: str, figures: list[Figure], rows: dict[str, Row]) -> dict[str, Any]:
    """One group of a stack's check figures: fixed-length ones against the median / worst target, padded ones
    against 'never under-predicts'."""
    fixed = [abs(f.error_pct) for f in figures if not rows[f.row_id].seq_is_max]
    padded = [f for f in figures if rows[f.row_id].seq_is_max]
    under = [f"{f.label} {f.error_pct:+.1f} %" for f in padded if f.error_pct < 0]
    print(f"  {label}:")
    if fixed:
        median, worst = statistics.median(fixed), max(fixed)
        met = median <= STACK_TARGET_MEDIAN_PCT and worst <= STACK_TARGET_WORST_PCT
        print(
            f"    fixed length: {len(fixed)} figures, median |err| {median:.1f} %, worst {worst:.1f} % (target "
            f"<= {STACK_TARGET_MEDIAN_PCT:.0f} % / {STACK_TARGET_WORST_PCT:.0f} %: {'met' if met else 'not met'})"
        )
    spread = f"median |err| {statistics.median(abs(f.error_pct) for f in padded):.1f} %, " if padded else ""
    print(
        f"    padded to each batch's longest row, estimated at the cap: {len(padded)} figures, {spread}"
        + (f"under-predicted: {', '.join(under)}" if under else "none under-predicted")
    )
    dynamic = [f"{f.label} {f.error_pct:+.1f} %" for f in figures if f.row_id in DYNAMIC_REPO]
    if dynamic:
        print(f"      of these, from a dynamic 4-bit repo (16-bit layers from the row's loading): {', '.join(dynamic)}")
    return {"fixed_abs_err_pct": fixed, "padded_under": under, "dynamic_repo": dynamic}


def print_loaded(mappings: dict[str, Mapping], rows: dict[str, Row]) -> dict[str, Any]:
    """The weights half of the check, on its own: each Unsloth notebook prints max_memory_reserved once the
    model and its adapters are loaded, before training; lorafit's weights and adapters against it, on the rows
    that loaded a plain 4-bit or 16-bit repo. (The rows that loaded a dynamic 4-bit repo take their 16-bit
    layers from that figure: unsloth_releases.with_dynamic_layers.)"""
    diffs: dict[str, float] = {}
    for row_id, mapping in mappings.items():
        after = after_loading_gib(rows[row_id].raw["notes"])
        if after is None or row_id in DYNAMIC_REPO:
            continue
        diffs[row_id] = after - loaded_bytes(mapping.spec, mapping.settings, mapping.runtime) / GIB
    if diffs:
        worst = sorted(diffs, key=lambda row_id: -abs(diffs[row_id]))[:3]
        print(
            f"  loaded, before the first step (the notebooks' after-loading figure - lorafit's weights and "
            f"adapters), {len(diffs)} rows of plain repos: median |diff| "
            f"{statistics.median(abs(d) for d in diffs.values()):.2f} GiB, largest "
            + ", ".join(f"{row_id} {diffs[row_id]:+.2f}" for row_id in worst)
        )
        print(f"  dynamic 4-bit repos, their 16-bit layers from that figure: {', '.join(sorted(DYNAMIC_REPO))}")
    return {row_id: round(diff, 3) for row_id, diff in diffs.items()}


def print_stack_rows(report: Report, rows: dict[str, Row], mappings: dict[str, Mapping]) -> dict[str, Any]:
    """Per stack routed by the CSV's stack column (STACK_ROWS): its check rows apart, Unsloth's releases since its
    fused loss (the pinned step's loss family) apart from the earlier ones, whose loss is replayed."""
    out: dict[str, Any] = {}
    for stack in STACK_ROWS:
        mine = [
            f
            for f in report.figures
            if f.split == "check"
            and f.row_id in rows
            and rows[f.row_id].raw["stack"] == stack
            and prefix_of(f.row_id) not in FRAMEWORK_OF_PREFIX
        ]
        print(f"\n--stack {stack} check rows (routed by the CSV's stack column)")
        recent = [f for f in mine if not before_the_fused_loss(f.row_id)]
        earlier = [f for f in mine if before_the_fused_loss(f.row_id)]
        out[stack] = print_check_figures("releases since its fused loss (2025-08-13), as the pinned one", recent, rows)
        out[f"{stack} before 2025-08-13"] = print_check_figures(
            "earlier releases, their loss replayed (Triton cross-entropy, cut cross-entropy)", earlier, rows
        )
        out[f"{stack} loaded"] = print_loaded(
            {row_id: mapping for row_id, mapping in mappings.items() if rows[row_id].raw["stack"] == stack}, rows
        )
        fitted = [
            abs(f.error_pct)
            for f in report.figures
            if f.split == "fit" and f.row_id in rows and rows[f.row_id].raw["stack"] == stack
        ]
        if fitted:
            print(
                f"  fit rows (used to choose its terms): {len(fitted)} figures, median |err| "
                f"{statistics.median(fitted):.1f} %, worst {max(fitted):.1f} %"
            )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    parser.add_argument("--rows", help="comma-separated row ids (default: all)")
    parser.add_argument("--no-competitors", action="store_true", help="skip the other calculators")
    parser.add_argument("--no-cpu", action="store_true", help="skip the rows measured on this machine")
    parser.add_argument("--no-exact", action="store_true", help="skip the --exact trace of each row")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if not args.csv.is_file():
        parser.exit(2, f"error: no calibration file at {args.csv} (pass --csv)\n")

    start = time.perf_counter()
    rows = read_rows(args.csv)
    if args.rows:
        wanted = set(args.rows.split(","))
        rows = [row for row in rows if row.id in wanted]
    report, mappings = build_report(rows)
    if args.no_cpu:
        report.cpu_rows = "skipped (--no-cpu)"
    else:
        cpu, report.cpu_rows = cpu_figures()
        report.figures.extend(cpu)
    names = [] if args.no_exact else run_exact(report, mappings)
    if not args.no_competitors:
        names += run_competitors(report, mappings, {row.id: row for row in rows})
    by_id = {row.id: row for row in rows}
    apart = frozenset(row.id for row in rows if row.raw["stack"] in STACK_ROWS)
    totals = print_report(report, names, time.perf_counter() - start, apart)
    totals["stacks"] = print_stack_rows(report, by_id, mappings)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = to_json(report, totals)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"  wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
