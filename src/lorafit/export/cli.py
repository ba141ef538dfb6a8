"""`lorafit export RUN_DIR --to merged|gguf ...`: parse, run the export job, print. The options are derived from
`lorafit.options`; torch, transformers and llama.cpp are imported inside the command only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from lorafit import options
from lorafit.cli import derived_options, split
from lorafit.errors import ExportError
from lorafit.export import job
from lorafit.export.verify import GREEDY_TOKENS, STOP_TOKENS


def register(app: typer.Typer) -> None:
    app.command("export", help="Export a run: a merged transformers folder, or GGUF files checked in llama.cpp.")(
        export_command
    )


@derived_options("export")
def export_command(
    run_dir: Path = typer.Argument(..., help="a run folder written by `lorafit train` (or one of its checkpoints)"),
    **values: Any,
) -> None:
    """Write the fine-tuned model in a form people run; every file is checked before it takes its name."""
    given, switches = split(values)
    settings = options.validate("export", given, from_flags=given)
    if settings.to is None:
        raise ExportError("pass --to merged (a transformers folder) or --to gguf (files for llama.cpp and Ollama)")
    if settings.output is None:
        raise ExportError("pass --output DIR, the folder to write")
    if settings.to == "merged" and (settings.gguf_types or switches["ollama"]):
        raise ExportError("--quant and --ollama go with --to gguf")
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=True, stderr=switches["json"])
    if settings.to == "merged":
        result = job.export_merged(run_dir, Path(settings.output), overwrite=switches["overwrite"])
    else:
        result = job.export_gguf(
            run_dir,
            Path(settings.output),
            list(settings.gguf_types or ["f16"]),
            overwrite=switches["overwrite"],
            check=not switches["no_verify"],
            ollama=switches["ollama"],
            progress=lambda line: console.print(f"[dim]{line}[/dim]"),
        )
    if switches["json"]:
        typer.echo(json.dumps(result.as_json(), indent=2))
        return
    show(result, console)


def show(result: Any, console: Any) -> None:
    from rich.table import Table

    for kind, path in result.files.items():
        console.print(f"wrote {kind}: {path}")
    rows = {kind: figures for kind, figures in result.verify.items() if "kld_mean" in figures}
    if rows:
        table = Table(title="checked in llama.cpp against the merged model (transformers)", header_style="bold")
        for column in ("file", "mean KLD", "top-1", "ppl (ref)", "max |dlogit|", "greedy", "tokenizer", "stops"):
            table.add_column(column)
        for kind, f in rows.items():
            table.add_row(
                kind,
                f"{f['kld_mean']:.5f}",
                f"{f['top1_agreement']:.1%}",
                f"{f['ppl']:.3f} ({f['ppl_reference']:.3f})",
                f"{f['max_abs_logit_diff']:.4f}" if "max_abs_logit_diff" in f else "-",
                {True: "same", False: "differs"}.get(f.get("greedy_match"), "-"),
                "same" if f["tokenizer_match"] else "differs",
                f"{f.get('stops', 0)}/{f.get('prompts', 0)}",
            )
        console.print(table)
        console.print(
            f"[dim]greedy: the first {GREEDY_TOKENS} greedy tokens equal the merged model's (16/32-bit files); "
            f"stops: greedy answers that ended on an end-of-turn or EOS token within {STOP_TOKENS} tokens[/dim]"
        )
    if "merged" in result.verify:
        check = result.verify["merged"]
        console.print(
            f"logits of the merged model vs base + adapter: max difference {check['max_abs_logit_diff']:.3g} "
            f"(allowed {check['tolerance']:.3g})"
        )
    for note in result.notes:
        console.print(note)
