"""`lorafit train`, `lorafit init`, `lorafit chat` (alias `generate`). Parse, call the recipe, print.

The options of `train` and `chat` are derived from `lorafit.options` (every train option is a config key; a flag
wins over the file). torch and transformers are imported inside the command functions only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from lorafit import options
from lorafit.cli import derived_options, split
from lorafit.errors import InvalidConfig
from lorafit.train.chat import answer, answer_gguf, load
from lorafit.train.config import load_config, write_starter
from lorafit.train.demo import run_demo
from lorafit.train.launch import launch, needs_launch
from lorafit.train.recipe import run


def register(app: typer.Typer) -> None:
    app.command("train", help="Fine-tune a model (QLoRA / LoRA / full) from a config file and/or flags.")(train_command)
    app.command("init", help="Write a commented starter config for `lorafit train`.")(init_command)
    app.command("chat", help="Answer a prompt with a trained run (base model + adapter).")(chat_command)
    app.command("generate", help="Same as `chat`.")(chat_command)


@derived_options("train")
def train_command(
    config: Path | None = typer.Argument(None, help="YAML config (see `lorafit init`), or a plan from `lorafit plan`"),
    **values: Any,
) -> None:
    """Fine-tune; settings left out come from `lorafit plan` for this machine, and the run prints them."""
    overrides, switches = split(values)
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=True)
    run_switches = {"resume": switches["resume"], "overwrite": switches["overwrite"], "dry_run": switches["dry_run"]}
    if switches["demo"]:
        if config is not None:
            raise typer.BadParameter("--demo brings its own config; pass flags to change it", param_hint="CONFIG")
        if not run_demo(overrides, console=console, **run_switches):
            raise typer.Exit(1)
        return
    resolved = load_config(config, overrides)
    if needs_launch(resolved):  # n_gpus / nodes > 1: `accelerate launch` starts the processes
        code = launch(resolved, console=console, **run_switches)
        if code == 130:
            raise KeyboardInterrupt
        if code:
            raise typer.Exit(code)
        return
    run(resolved, console=console, **run_switches)


def init_command(
    path: Path = typer.Argument(Path("lorafit.yaml"), help="Where to write the config"),
    force: bool = typer.Option(False, "--force", help="Replace an existing file"),
) -> None:
    """Write a commented starter config with every key and its default."""
    write_starter(path, force=force)
    typer.echo(f"wrote {path}; set `model:` and `data:`, then run `lorafit train {path}`")


@derived_options("chat")
def chat_command(
    run_dir: Path = typer.Argument(..., help="A `lorafit train` output folder, or a GGUF from `lorafit export`"),
    **values: Any,
) -> None:
    """Load the run's base model and adapter (or the GGUF, through llama.cpp) and print its answer to PROMPT."""
    given, _ = split(values)
    asked = options.validate("chat", given, from_flags=given)
    if asked.prompt is None:
        raise InvalidConfig("no prompt: pass --prompt TEXT")
    if run_dir.suffix == ".gguf":
        reply = answer_gguf(run_dir, asked.prompt, max_new_tokens=asked.max_new_tokens, temperature=asked.temperature)
        typer.echo(reply)
        return
    model, tokenizer = load(run_dir, allow_pickle=asked.allow_pickle, trust_remote_code=asked.trust_remote_code)
    typer.echo(
        answer(model, tokenizer, asked.prompt, max_new_tokens=asked.max_new_tokens, temperature=asked.temperature)
    )
