"""`lorafit train`, `lorafit init`, `lorafit chat` (alias `generate`). Parse, call the recipe, print.

Every flag of `train` is a key of the config file (`lorafit.train.config.TrainConfig`) with dashes; a flag
wins over the file. torch and transformers are imported inside the command functions only.
"""

from __future__ import annotations

from pathlib import Path

import typer

# Flags that are not config keys: what to do with the output folder, and the demo switch.
RUN_FLAGS = ("config", "demo", "resume", "overwrite")


def register(app: typer.Typer) -> None:
    app.command("train", help="Fine-tune a model (QLoRA / LoRA / full) from a config file and/or flags.")(train_command)
    app.command("init", help="Write a commented starter config for `lorafit train`.")(init_command)
    app.command("chat", help="Answer a prompt with a trained run (base model + adapter).")(chat_command)
    app.command("generate", help="Same as `chat`.")(chat_command)


def train_command(
    config: Path | None = typer.Argument(None, help="YAML config (see `lorafit init`), or a plan from `lorafit plan`"),
    demo: bool = typer.Option(False, "--demo", help="Build a tiny model and fine-tune it on bundled data (CPU)"),
    model: str | None = typer.Option(None, help="Local model directory (config.json + safetensors)"),
    data: str | None = typer.Option(None, help="Dataset file or directory"),
    data_format: str | None = typer.Option(None, help="alpaca | sharegpt | messages | prompt_completion | text"),
    eval_data: str | None = typer.Option(None, help="Held-out dataset for eval loss"),
    eval_split: float | None = typer.Option(None, help="Share (<1) or number of rows held out for eval loss"),
    method: str | None = typer.Option(None, help="qlora | lora | full"),
    output_dir: str | None = typer.Option(None, help="Where the adapter, metrics and checkpoints go"),
    precision: str | None = typer.Option(None, help="bf16 | fp16 | fp32"),
    quant: str | None = typer.Option(None, help="nf4 | int8 | none"),
    double_quant: bool | None = typer.Option(
        None, "--double-quant/--no-double-quant", help="Quantise the 4-bit scales too"
    ),
    lora_r: int | None = typer.Option(None, help="LoRA rank"),
    lora_alpha: int | None = typer.Option(None, help="LoRA alpha"),
    lora_dropout: float | None = typer.Option(None, help="LoRA dropout"),
    lora_targets: str | None = typer.Option(None, help="all | attn | qv"),
    optimizer: str | None = typer.Option(None, help="adamw | adamw_8bit | paged_adamw_8bit | paged_adamw_32bit | sgd"),
    micro_batch: int | None = typer.Option(None, help="Sequences per forward pass"),
    grad_accum: int | None = typer.Option(None, help="Micro-batches per optimizer step"),
    seq_len: int | None = typer.Option(None, help="Longest sequence; longer rows are cut"),
    grad_ckpt: bool | None = typer.Option(None, "--grad-ckpt/--no-grad-ckpt", help="Gradient checkpointing"),
    attn: str | None = typer.Option(None, help="sdpa | flash | eager"),
    batch_size: int | None = typer.Option(None, help="Effective batch in sequences"),
    epochs: float | None = typer.Option(None, help="Passes over the data"),
    max_steps: int | None = typer.Option(None, help="Optimizer steps (overrides epochs)"),
    learning_rate: float | None = typer.Option(None, "--learning-rate", "--lr", help="Peak learning rate"),
    lr_scheduler: str | None = typer.Option(None, help="cosine | linear | constant | constant_with_warmup"),
    warmup_ratio: float | None = typer.Option(None, help="Share of steps spent warming up"),
    weight_decay: float | None = typer.Option(None, help="AdamW weight decay"),
    seed: int | None = typer.Option(None, help="Seed for data order, adapters and dropout"),
    train_on_prompt: bool | None = typer.Option(
        None, "--train-on-prompt/--answer-only", help="Loss on every token, or on the answers only (default)"
    ),
    batching: str | None = typer.Option(None, help="auto | length_grouped | padding_free | random"),
    logging_steps: int | None = typer.Option(None, help="Steps between metrics.jsonl lines"),
    eval_steps: int | None = typer.Option(None, help="Steps between eval-loss measurements"),
    save_steps: int | None = typer.Option(None, help="Steps between checkpoints"),
    save_total_limit: int | None = typer.Option(None, help="Checkpoints kept"),
    allow_pickle: bool | None = typer.Option(None, "--allow-pickle", help="Load .bin (pickle) weights"),
    trust_remote_code: bool | None = typer.Option(None, "--trust-remote-code", help="Run the model's own code"),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --output-dir from its checkpoint"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Delete the run in --output-dir and start over"),
) -> None:
    """Fine-tune; settings left out come from `lorafit plan` for this machine, and the run prints them."""
    overrides = {key: value for key, value in locals().items() if key not in RUN_FLAGS and value is not None}
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=True)
    if demo:
        if config is not None:
            raise typer.BadParameter("--demo brings its own config; pass flags to change it", param_hint="CONFIG")
        from lorafit.train.demo import run_demo

        if not run_demo(overrides, resume=resume, overwrite=overwrite, console=console):
            raise typer.Exit(1)
        return
    from lorafit.train.config import load_config
    from lorafit.train.recipe import run

    run(load_config(config, overrides), resume=resume, overwrite=overwrite, console=console)


def init_command(
    path: Path = typer.Argument(Path("lorafit.yaml"), help="Where to write the config"),
    force: bool = typer.Option(False, "--force", help="Replace an existing file"),
) -> None:
    """Write a commented starter config with every key and its default."""
    from lorafit.train.config import write_starter

    write_starter(path, force=force)
    typer.echo(f"wrote {path}; set `model:` and `data:`, then run `lorafit train {path}`")


def chat_command(
    run_dir: Path = typer.Argument(..., help="A `lorafit train` output folder"),
    prompt: str = typer.Option(..., "--prompt", "-p", help="The user message"),
    max_new_tokens: int = typer.Option(64, help="Longest answer, in tokens"),
    temperature: float = typer.Option(0.0, help="0: greedy (the same answer every time)"),
    allow_pickle: bool = typer.Option(False, "--allow-pickle", help="Load .bin (pickle) base weights"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Run the model's own code"),
) -> None:
    """Load the run's base model and adapter and print its answer to PROMPT."""
    from lorafit.train.chat import answer, load

    model, tokenizer = load(run_dir, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    typer.echo(answer(model, tokenizer, prompt, max_new_tokens=max_new_tokens, temperature=temperature))
