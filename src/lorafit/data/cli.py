"""`lorafit data check` and `lorafit data convert`: parse, call, render (rich for people, JSON for tools)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from lorafit.data.check import CheckReport, check
from lorafit.data.convert import ConvertReport, convert
from lorafit.data.outputs import output_path
from lorafit.errors import DataError
from lorafit.files import atomic_writer, write_atomic

if TYPE_CHECKING:
    from rich.console import Console


PROBLEMS_SHOWN = 20
BAR_WIDTH = 40

data_app = typer.Typer(
    name="data",
    help="Check a dataset (problems, token lengths, the sequence length it needs) or convert it.",
    no_args_is_help=True,
)

TokenizerOption = Annotated[
    str | None,
    typer.Option(
        "--tokenizer",
        help="tokenizer directory, tokenizer.json, or a model already in the local HF cache; "
        "default: estimate from characters",
    ),
]
FormatOption = Annotated[
    str | None,
    typer.Option("--format", help="alpaca, sharegpt, messages, prompt_completion or text (default: detected)"),
]
MapOption = Annotated[
    list[str] | None,
    typer.Option("--map", help="FIELD=COLUMN: read FIELD (e.g. instruction) from another column; repeatable"),
]


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")


@data_app.command("check")
def check_command(
    file: Annotated[Path, typer.Argument(help="a data file or a directory of them")],
    tokenizer: TokenizerOption = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", min=1, help="warn about rows longer than this")] = None,
    format: FormatOption = None,
    mapping: MapOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of tables")] = False,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="also draw the length histogram to this .png (or into this folder)")
    ] = None,
    strict: Annotated[bool, typer.Option("--strict", help="exit 1 on warnings")] = False,
    report_file: Annotated[
        Path | None, typer.Option("--report", help="write the full JSON report to this .json (or into this folder)")
    ] = None,
) -> None:
    """Problems (with file, line and row), token statistics and a suggested sequence length.

    Exit 0 clean, 1 warnings only with --strict, 2 errors.
    """

    if report_file is not None:
        report_file = output_path(
            report_file, file, label="--report", what="the report is JSON", suffixes=(".json",), name_suffix="-check"
        )
    if plot is not None:
        plot = output_path(
            plot, file, label="--plot", what="the histogram is a PNG", suffixes=(".png",), name_suffix="-lengths"
        )
    report = check(file, tokenizer=tokenizer, seq_len=seq_len, format=format, mapping=mapping)
    if report_file is not None:
        write_atomically(report_file, report.dumps() + "\n")
    if plot is not None:
        plot_histogram(report, plot)
    if as_json:
        typer.echo(report.dumps())
    else:
        render_check(report, _console(), given_format=format is not None, report_file=report_file, plot=plot)
    raise typer.Exit(report.exit_code(strict))


@data_app.command("convert")
def convert_command(
    source: Annotated[Path, typer.Argument(metavar="IN", help="a data file or a directory of them")],
    output: Annotated[
        Path, typer.Argument(metavar="OUT", help="the .jsonl file to write (or a folder to write it in)")
    ],
    to: Annotated[str, typer.Option("--to", help="messages, alpaca or sharegpt")] = "messages",
    format: FormatOption = None,
    mapping: MapOption = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace OUT if it exists")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of a summary")] = False,
) -> None:
    """Write the rows that pass as JSONL in one format.

    Exit 0 all rows written, 1 some were rejected, 2 bad input or no row passed (nothing written).
    """

    report = convert(source, output, to, format=format, mapping=mapping, overwrite=overwrite)
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2, ensure_ascii=False))
    else:
        render_convert(report, _console())
    raise typer.Exit(1 if report.rejected else 0)


# --- rendering --------------------------------------------------------------------------------------------
def _console() -> Console:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True, width=max(100, _terminal_width()))


def _terminal_width() -> int:
    try:
        return os.get_terminal_size().columns
    except OSError:
        return 100


def render_check(
    report: CheckReport, console: Console, given_format: bool, report_file: Path | None, plot: Path | None
) -> None:
    from rich.markup import escape
    from rich.table import Table

    how = "given" if given_format else "detected"
    console.print(
        f"[bold]{escape(report.source)}[/]: format [bold]{report.format or 'unknown'}[/] ({how}), "
        f"{report.rows:,} rows, "
        f"{report.valid_rows:,} valid, {report.rejected_rows:,} rejected; "
        f"{report.errors:,} errors, {report.warnings:,} warnings"
    )
    if report.problems:
        table = Table(title="Problems", title_justify="left")
        for column in ("severity", "file", "line", "row", "field", "message"):
            table.add_column(column, justify="right" if column in ("line", "row") else "left", overflow="fold")
        for problem in report.problems[:PROBLEMS_SHOWN]:
            style = "red" if problem.severity == "error" else "yellow"
            table.add_row(
                f"[{style}]{problem.severity}[/]",
                escape(Path(problem.file).name) if problem.file else "",
                "" if problem.line is None else str(problem.line),
                "" if problem.row is None else str(problem.row),
                escape(problem.field or ""),
                escape(problem.message),
            )
        console.print(table)
        if len(report.problems) > PROBLEMS_SHOWN:
            where = f"--report {escape(str(report_file))}" if report_file else "--json or --report FILE"
            console.print(f"... and {len(report.problems) - PROBLEMS_SHOWN:,} more problems (all of them: {where})")
    if report.tokens is None:
        console.print("no valid rows: no token statistics")
        return
    tokens = report.tokens
    counted = (
        f"tokenizer {escape(tokens.tokenizer)}"
        if tokens.tokenizer
        else f"estimated from characters, ~4 per token, ±{tokens.estimate_error:.0%} a row"
    )
    table = Table(title=f"Tokens per row ({counted})", title_justify="left")
    for column in ("total", "mean", "p50", "p95", "p99", "max", "answer share"):
        table.add_column(column, justify="right")
    share = "" if tokens.answer_token_share is None else f"{tokens.answer_token_share:.1%}"
    table.add_row(
        f"{tokens.total:,}",
        f"{tokens.mean:,.1f}",
        f"{tokens.p50:,.0f}",
        f"{tokens.p95:,.0f}",
        f"{tokens.p99:,.0f}",
        f"{tokens.max:,}",
        share,
    )
    console.print(table)
    render_histogram(report, console)
    if report.seq_len:
        console.print(f"--seq-len {report.seq_len}: truncates {report.truncated_rows(report.seq_len):,} rows")
    if report.suggestion:
        suggestion = report.suggestion
        console.print(
            f"suggested --seq-len [bold]{suggestion.seq_len}[/] ({suggestion.rule}; truncates "
            f"{suggestion.truncated_rows:,} rows); as a power of two: {suggestion.power_of_two}"
        )
    if report_file is not None:
        console.print(f"report written to {escape(str(report_file))}")
    if plot is not None:
        console.print(f"histogram written to {escape(str(plot))}")


def render_histogram(report: CheckReport, console: Console) -> None:
    edges, counts = report.histogram()
    if not counts:
        return
    console.print("Length histogram (tokens per row)")
    peak = max(counts)
    width = len(f"{edges[-1]:,}")
    for low, high, count in zip(edges, edges[1:], counts, strict=False):
        bar = "█" * max(1 if count else 0, round(BAR_WIDTH * count / peak))
        span = f"{low:>{width},}" + (f" – {high - 1:<{width},}" if high - low > 1 else " " * (width + 3))
        console.print(f"  {span} {bar} {count:,}")


def plot_histogram(report: CheckReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5))
    if len(report.lengths):
        axes.hist(report.lengths, bins=50, color="#4477aa")
        if report.tokens:
            axes.axvline(report.tokens.p99, color="#cc6677", linestyle="--", label=f"p99 = {report.tokens.p99:,.0f}")
        if report.seq_len:
            axes.axvline(report.seq_len, color="#228833", label=f"--seq-len {report.seq_len}")
        if report.suggestion:
            suggested = report.suggestion.seq_len
            axes.axvline(suggested, color="#666666", linestyle=":", label=f"suggested --seq-len {suggested}")
        axes.legend()
    counted = (report.tokens.tokenizer or "estimated from characters") if report.tokens else ""
    axes.set_title(f"{Path(report.source).name}: {report.valid_rows:,} rows ({counted})")
    axes.set_xlabel("tokens per row")
    axes.set_ylabel("rows")
    figure.tight_layout()

    try:
        with atomic_writer(path, binary=True) as handle:
            figure.savefig(handle, format="png", dpi=100)
    except OSError as error:
        raise DataError(f"cannot write {path}: {error.strerror or error}") from None
    finally:
        plt.close(figure)


def render_convert(report: ConvertReport, console: Console) -> None:
    from rich.markup import escape

    console.print(
        f"{escape(report.source)} ({report.format}) -> {escape(report.output)} ({report.to}): {report.written:,} of "
        f"{report.rows:,} rows written, {report.rejected:,} rejected"
    )
    errors = [problem for problem in report.problems if problem.severity == "error"]
    for problem in errors[:PROBLEMS_SHOWN]:
        console.print(f"  {escape(problem.where())}: {escape(problem.message)}")
    if len(errors) > PROBLEMS_SHOWN:
        more = len(errors) - PROBLEMS_SHOWN
        console.print(f"  ... and {more:,} more (`lorafit data check {escape(report.source)} --json`)")


def write_atomically(path: Path, text: str) -> None:
    """Temp file next to the target, then rename: a reader never sees half a report."""

    try:
        write_atomic(path, text)
    except OSError as error:
        raise DataError(f"cannot write {path}: {error.strerror or error}") from None
