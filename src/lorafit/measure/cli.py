"""`lorafit measure`: parse (the options of `lorafit plan`, derived from lorafit.options, and three of its own),
plan, measure, print, store. torch and transformers load inside the command only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from lorafit import answers, render
from lorafit.cli import derived_options, split
from lorafit.errors import InvalidConfig
from lorafit.measure import run, store


def register(app: typer.Typer) -> None:
    app.command(
        "measure",
        help="Train the planned configuration for a few steps on this machine (random weights at the model's "
        "real shapes): measured speed and memory beside the estimate, and the run's time and cost from them.",
    )(measure_command)


@derived_options("plan")
def measure_command(
    cpu: bool = typer.Option(False, "--cpu", help="measure on the CPU (small models), against its own measured rates"),
    steps: int | None = typer.Option(
        None, "--steps", metavar="INTEGER", help=f"timed steps after one warm-up step (default {run.DEFAULT_STEPS})"
    ),
    export: Path | None = typer.Option(
        None,
        "--export",
        metavar="FILE",
        help="write every stored measurement as rows of the calibration CSV to a new FILE; measures nothing",
    ),
    **values: Any,
) -> None:
    """Measure the plan's step on this GPU (or --cpu); each measurement is added to the user's cache."""
    given, switches = split(values)
    if export is not None:
        if given or cpu or steps is not None or switches["compare"] or switches["from_config"]:
            raise InvalidConfig("--export writes the stored measurements and measures nothing; pass it alone")
        count = store.export(export, store.read_all())
        typer.echo(f"wrote {count} measurement row(s) to {export} (from {store.measurements_file()})")
        return
    if switches["compare"]:
        raise InvalidConfig("--compare ranks catalog GPUs; `lorafit measure` measures this machine: drop --compare")
    steps = run.DEFAULT_STEPS if steps is None else steps
    run.check_steps(steps)
    device, probe = run.open_device(cpu)
    card = run.local_card(device, given)
    answer = answers.plan(given, from_config=switches["from_config"], card=card, device=device)
    render.warn_about(answer.source)
    measured = run.measure(answer.plans[0], device, probe, steps)
    path = store.append(measured)
    if switches["json"]:
        render.print_json(measured)
    else:
        show(measured, path)


def _cell(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:,.2f}{unit}" if abs(value) < 100 else f"{value:,.0f}{unit}"


def show(measured: dict[str, Any], path: Path) -> None:
    """The measured figures beside the estimate, one row per figure, with (estimate - measured) / measured."""
    m, e = measured["measured"], measured["estimate"]
    render.console.rule(f"[bold]{measured['model']}[/bold] on {measured['device']}")
    settings = measured["settings"]
    render.console.print(
        f"{settings['method']} {settings['quant']}, micro-batch {settings['micro_batch']} x {settings['seq_len']} "
        f"tokens, accumulation {settings['grad_accum']}, checkpointing {'on' if settings['grad_ckpt'] else 'off'}, "
        f"{settings['optimizer']}, {settings['precision']}; {measured['warmup_steps']} warm-up + "
        f"{measured['steps']} timed steps of random tokens; estimate for {measured['card']}"
    )
    table = Table(header_style="bold")
    for column in ("", "measured", "estimate", "estimate vs measured"):
        table.add_column(column, justify="left" if not column else "right")
    rows = [
        ("tokens/s", "tokens_per_s", ""),
        ("peak allocated", "peak_allocated_gib", " GiB"),
        ("peak reserved", "peak_reserved_gib", " GiB"),
        ("peak device", "peak_device_gib", " GiB"),
        (f"run of {measured['run_tokens'] / 1e6:,.1f}M tokens", "hours", " h"),
        ("cost rented", "cost_cloud_usd", " USD"),
        ("cost own card (power)", "cost_local_usd", " USD"),
    ]
    for title, key, unit in rows:
        have, want = m.get(key), e.get(key)
        error = f"{(want - have) / have:+.0%}" if have and want is not None else "-"
        table.add_row(title, _cell(have, unit), _cell(want, unit), error)
    render.console.print(table)
    if m["peak_device_source"]:
        render.console.print(f"  peak device: {m['peak_device_source']}", soft_wrap=True)
    render.console.print(
        f"  recorded in {path} (`lorafit measure --export FILE` writes them as calibration rows)", soft_wrap=True
    )
