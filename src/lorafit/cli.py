"""The `lorafit` command: parse, build the request, call, render. No logic lives here.

Sub-commands from other packages (`data`, `train`, ...) register themselves through `register(app)`; those
modules import torch/transformers only inside their command functions, so `lorafit plan` stays instant.
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from lorafit import hardware, memory, models, render
from lorafit.errors import LorafitError
from lorafit.hardware import GpuSpec
from lorafit.schema import PlanRequest, Settings, default_quant, one_line

app = typer.Typer(
    name="lorafit",
    help="Will this fine-tune fit my GPU, with which settings, how long and at what cost - then run it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


# --- shared options -----------------------------------------------------------------------------------------
DEFAULT_MODEL = "llama-2-7b"
EMBEDDED_GPUS = ("RTX 4090", "RTX 4060 Ti 16GB")

ModelOpt = Annotated[
    str | None,
    typer.Option("--model", "-m", help="preset, hub id of a preset, or local dir / config.json (see `lorafit models`)"),
]
GpuOpt = Annotated[str | None, typer.Option("--gpu", "-g", help="catalog GPU (see `lorafit gpus`); default: detected")]
VramOpt = Annotated[float | None, typer.Option("--vram", help="a GPU known only by its memory, in GB as sold")]
MethodOpt = Annotated[str, typer.Option("--method", help="full | lora | qlora")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object for programs")]
HeadroomOpt = Annotated[float, typer.Option("--headroom", help="fraction of GPU memory kept free")]
NGpusOpt = Annotated[int, typer.Option("--n-gpus", help="GPUs to train on")]


def _gpu(gpu: str | None, vram: float | None) -> GpuSpec | None:
    """--gpu, else --vram, else the detected GPU (torch is not imported for this: NVML only)."""
    if gpu and vram:
        raise LorafitError("pass --gpu or --vram, not both")
    if gpu:
        return hardware.resolve(gpu)
    if vram is not None:
        return hardware.custom(vram)
    detected = hardware.detect(use_torch=False).gpus
    if detected:
        found = detected[0]
        if found.catalog_name:
            return hardware.resolve(found.catalog_name)
        return hardware.custom(found.memory_gib)
    return None


def _settings(**values: object) -> Settings:
    """Settings from CLI values, filling quant from the method when not given."""
    given = {key: value for key, value in values.items() if value is not None}
    method = given.get("method", "qlora")
    given.setdefault("quant", default_quant(method))  # type: ignore[arg-type]
    try:
        return Settings(**given)
    except ValidationError as error:
        raise LorafitError(one_line(error)) from None


# --- commands -----------------------------------------------------------------------------------------------
@app.command()
def estimate(
    model: ModelOpt = None,
    method: MethodOpt = "qlora",
    precision: Annotated[str, typer.Option(help="bf16 | fp16 | fp32")] = "bf16",
    quant: Annotated[str | None, typer.Option(help="none | int8 | nf4 (default: nf4 for qlora)")] = None,
    double_quant: Annotated[bool, typer.Option("--double-quant/--no-double-quant")] = True,
    lora_r: Annotated[int, typer.Option("--lora-r")] = 16,
    lora_alpha: Annotated[int | None, typer.Option("--lora-alpha", help="default: 2 x r")] = None,
    lora_dropout: Annotated[float, typer.Option("--lora-dropout")] = 0.05,
    lora_targets: Annotated[str, typer.Option("--lora-targets", help="all | attn | qv")] = "all",
    optimizer: Annotated[
        str, typer.Option(help="adamw | adamw_8bit | paged_adamw_8bit | paged_adamw_32bit | sgd")
    ] = "adamw",
    micro_batch: Annotated[int, typer.Option("--micro-batch")] = 1,
    seq_len: Annotated[int, typer.Option("--seq-len")] = 2048,
    grad_ckpt: Annotated[bool, typer.Option("--grad-ckpt/--no-grad-ckpt")] = True,
    attn: Annotated[str, typer.Option(help="sdpa | flash | eager")] = "sdpa",
    gpu: GpuOpt = None,
    vram: VramOpt = None,
    n_gpus: NGpusOpt = 1,
    shard: Annotated[str, typer.Option(help="none | ddp | zero2 | zero3 | fsdp")] = "none",
    headroom: HeadroomOpt = 0.1,
    exact: Annotated[bool, typer.Option("--exact", help="trace the real training step on fake tensors")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Peak memory of one training step, as a breakdown, and whether it fits the GPU."""
    spec = models.resolve(model or DEFAULT_MODEL)
    spec.check_seq_len(seq_len)
    if not 0 <= headroom < 1:
        raise LorafitError(f"--headroom must be in [0, 1), got {headroom}")
    settings = _settings(
        method=method,
        precision=precision,
        quant=quant,
        double_quant=double_quant,
        lora_r=lora_r,
        lora_alpha=lora_alpha or 2 * lora_r,
        lora_dropout=lora_dropout,
        lora_targets=lora_targets,
        optimizer=optimizer,
        micro_batch=micro_batch,
        seq_len=seq_len,
        grad_ckpt=grad_ckpt,
        attn=attn,
        n_gpus=n_gpus,
        shard=shard,
    )
    if settings.attn not in spec.attention_implementations:
        raise LorafitError(
            f"{spec.name} has no {settings.attn} attention in transformers; use --attn "
            f"{' or '.join(spec.attention_implementations)}"
        )
    target = _gpu(gpu, vram)
    if exact:
        from lorafit import trace

        result = trace.exact_estimate(spec, settings, target, headroom)
    else:
        result = memory.estimate(spec, settings, target, headroom)
    if as_json:
        render.print_json(
            result.model_dump(mode="json")
            | {
                "exact": exact,
                "model": spec.model_dump(mode="json"),
                "settings": settings.model_dump(mode="json"),
                "gpu": target.model_dump(mode="json") if target else None,
            }
        )
    else:
        render.show_estimate(spec, settings, result, target)


@app.command()
def plan(
    model: ModelOpt = None,
    gpu: GpuOpt = None,
    vram: VramOpt = None,
    method: MethodOpt = "qlora",
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="default: the data's longest row, else 2048")] = None,
    target_batch: Annotated[int, typer.Option("--target-batch", help="effective batch in sequences")] = 16,
    tokens: Annotated[int | None, typer.Option("--tokens", help="training tokens per epoch")] = None,
    epochs: Annotated[float, typer.Option()] = 3.0,
    headroom: HeadroomOpt = 0.1,
    kwh_price: Annotated[float, typer.Option("--kwh-price", help="electricity, USD per kWh")] = 0.30,
    data: Annotated[Path | None, typer.Option("--data", help="dataset file: its real token counts")] = None,
    tokenizer: Annotated[str | None, typer.Option("--tokenizer", help="local tokenizer dir for --data")] = None,
    n_gpus: NGpusOpt = 1,
    lora_r: Annotated[int | None, typer.Option("--lora-r", help="pin the LoRA rank")] = None,
    lora_targets: Annotated[str | None, typer.Option("--lora-targets", help="pin: all | attn | qv")] = None,
    optimizer: Annotated[str | None, typer.Option(help="pin the optimizer")] = None,
    micro_batch: Annotated[int | None, typer.Option("--micro-batch", help="pin the micro-batch")] = None,
    grad_ckpt: Annotated[bool | None, typer.Option("--grad-ckpt/--no-grad-ckpt", help="pin checkpointing")] = None,
    compare: Annotated[bool, typer.Option("--compare", help="rank catalog GPUs for this job")] = False,
    max_price_hour: Annotated[float, typer.Option("--max-price-hour", help="with --compare: price cap")] = 1.0,
    as_json: JsonOpt = False,
) -> None:
    """Will it fit, with which settings, how long, at what cost: the fastest configuration that fits."""
    from lorafit import plan as planner

    if tokens is not None and tokens <= 0:
        raise LorafitError(f"--tokens must be positive, got {tokens}")
    if micro_batch is not None and micro_batch <= 0:
        raise LorafitError(f"--micro-batch must be positive, got {micro_batch}")
    if target_batch <= 0 or epochs <= 0 or n_gpus <= 0:
        raise LorafitError("--target-batch, --epochs and --n-gpus must be positive")
    spec = models.resolve(model or DEFAULT_MODEL)
    spec.check_seq_len(seq_len)
    pinned = {
        key: value
        for key, value in dict(
            lora_r=lora_r, lora_targets=lora_targets, optimizer=optimizer, micro_batch=micro_batch, grad_ckpt=grad_ckpt
        ).items()
        if value is not None
    }
    if lora_r is not None:
        pinned["lora_alpha"] = 2 * lora_r
    profile, truncated = None, None
    if data is not None:
        from lorafit.data import length_profile

        lengths = length_profile(data, tokenizer=tokenizer)
        profile = lengths.profile
        truncated = lengths.truncated_rows(seq_len or min(profile.max, spec.max_position_embeddings))
    try:
        request = PlanRequest(
            model=spec,
            n_gpus=n_gpus,
            method=method,
            seq_len=seq_len,
            target_batch=target_batch,
            tokens=profile,
            tokens_per_epoch=tokens,
            epochs=epochs,
            headroom=headroom,
            kwh_price=kwh_price,
            pinned=pinned,
        )
    except ValidationError as error:
        raise LorafitError(one_line(error)) from None
    if compare:
        plans = planner.compare(request)
        best_any, best_under = planner.cheapest(plans), planner.cheapest(plans, max_price_hour)
        if as_json:
            render.print_json(
                {
                    "plans": [p.model_dump(mode="json") for p in plans],
                    "cheapest": best_any.gpu.name if best_any and best_any.gpu else None,
                    "cheapest_under_price": best_under.gpu.name if best_under and best_under.gpu else None,
                    "max_price_hour": max_price_hour,
                }
            )
        else:
            render.show_compare(plans, best_any, best_under, max_price_hour)
        return
    target = _gpu(gpu, vram)
    if target is None and model is None:
        # The embedded default: a 7B model on a comfortable and on a tight consumer card.
        plans = [
            planner.make_plan(request.model_copy(update={"gpu": hardware.resolve(name)}), truncated)
            for name in EMBEDDED_GPUS
        ]
        if as_json:
            render.print_json([p.model_dump(mode="json") for p in plans])
        else:
            for result in plans:
                render.show_plan(result)
        return
    if target is None:
        target = hardware.resolve(EMBEDDED_GPUS[0])
        if not as_json:
            render.console.print(f"no GPU detected: planning for {target.name} (pass --gpu or --vram)")
    result = planner.make_plan(request.model_copy(update={"gpu": target}), truncated)
    if as_json:
        render.print_json(result.model_dump(mode="json"))
    else:
        render.show_plan(result)


@app.command()
def gpus(
    min_vram: Annotated[float, typer.Option("--min-vram", help="GiB")] = 0,
    max_price_hour: Annotated[float | None, typer.Option("--max-price-hour", help="USD per hour")] = None,
    as_json: JsonOpt = False,
) -> None:
    """The GPU catalog: memory, throughput, power and prices, each with its source."""
    rows = hardware.gpus(min_vram, max_price_hour)
    if as_json:
        render.print_json([gpu.model_dump(mode="json") for gpu in rows])
    else:
        render.show_gpus(rows)


@app.command("models")
def list_models(as_json: JsonOpt = False) -> None:
    """The model presets (any local config.json of a supported architecture works too)."""
    specs = list(models.catalog().values())
    if as_json:
        render.print_json([spec.model_dump(mode="json") | {"num_params": spec.num_params} for spec in specs])
    else:
        render.show_models(specs)


@app.command()
def detect(as_json: JsonOpt = False) -> None:
    """The local GPUs, CPU and RAM. Works (and says so) on a machine without a GPU."""
    machine = hardware.detect()
    if as_json:
        render.print_json(machine.model_dump(mode="json"))
    else:
        render.show_machine(machine)


@cache  # once per process: main() may run several times in one interpreter (tests, notebooks)
def _register_subcommands() -> None:
    for module_name in ("lorafit.data.cli", "lorafit.train.cli"):
        try:
            module = __import__(module_name, fromlist=["register"])
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise
            continue
        module.register(app)


def fail(message: str) -> None:
    """One line on stderr, exit 2: the contract for every kind of bad input."""
    typer.echo(f"lorafit: error: {message}", err=True)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    _register_subcommands()
    try:
        app(args=argv, standalone_mode=True)
    except LorafitError as error:
        fail(str(error).splitlines()[0] if str(error) else type(error).__name__)
    except ValidationError as error:
        fail(one_line(error))
    except KeyboardInterrupt:
        typer.echo("lorafit: interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
