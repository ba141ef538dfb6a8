"""The `lorafit` command: parse, build the request, call, render. No logic lives here.

Sub-commands from other packages (`data`, `train`, ...) register themselves through `register(app)`; those
modules import torch/transformers only inside their command functions, so `lorafit plan` stays instant.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError

from lorafit import hardware, memory, models, options, render
from lorafit.errors import LorafitError
from lorafit.hardware import GpuSpec
from lorafit.options import one_line
from lorafit.schema import PLAN_REQUEST_KEYS, PlanRequest

app = typer.Typer(
    name="lorafit",
    help="Will this fine-tune fit my GPU, with which settings, how long and at what cost - then run it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: wraps to any terminal width instead of cutting long flags
)


# --- options, derived from lorafit.options -----------------------------------------------------------------
DEFAULT_MODEL = "llama-2-7b"
EMBEDDED_GPUS = ("RTX 4090", "RTX 4060 Ti 16GB")
SWITCHES = {option.name for option in options.OPTIONS if not option.config}
METAVARS = {int: "INTEGER", float: "NUMBER", str: "TEXT", dict: "FIELD=COLUMN,..."}


def _parameter(option: options.Option) -> inspect.Parameter:
    """One typer option. Values arrive as text and are checked by `options.validate`, so that a flag, a YAML
    key and a form field are refused with the same message."""
    if option.is_bool:
        off = option.off_flag or "--no-" + option.flag.removeprefix("--")
        declarations = [option.flag] if not option.config else [f"{option.flag}/{off}"]
        default, annotation, metavar = (False if not option.config else None), bool | None, None
    else:
        declarations = [option.flag]
        default, annotation = None, list[str] | None if option.many else str | None
        metavar = "|".join(option.choices) if option.choices else METAVARS.get(option.type, "TEXT")
    declarations += list(option.flags)
    info = typer.Option(default, *declarations, help=option.help_text(), metavar=metavar, show_default=False)
    return inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation)


def derived_options(command: options.Command) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command function (`def f(<arguments>, **values)`) a typer option for every setting of `command`."""

    def attach(function: Callable[..., None]) -> Callable[..., None]:
        own = [p for p in inspect.signature(function).parameters.values() if p.kind is not p.VAR_KEYWORD]
        function.__signature__ = inspect.Signature(own + [_parameter(o) for o in options.for_command(command)])  # type: ignore[attr-defined]
        return function

    return attach


def split(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(settings that were set, switches) of a command's keyword arguments."""
    given = {key: value for key, value in values.items() if key not in SWITCHES and value is not None}
    return given, {key: value for key, value in values.items() if key in SWITCHES}


def target_gpu(gpu: str | None, vram: float | None) -> GpuSpec | None:
    """--gpu, else --vram, else the detected GPU (torch is not imported for this: NVML only)."""
    if gpu and vram:
        raise LorafitError("pass --gpu or --vram, not both")
    if gpu:
        return hardware.resolve(gpu)
    if vram is not None:
        return hardware.custom(vram)
    return hardware.detected_gpu(use_torch=False)


# --- commands -----------------------------------------------------------------------------------------------
@app.command()
@derived_options("estimate")
def estimate(**values: Any) -> None:
    """Peak memory of one training step, as a breakdown, and whether it fits the GPU."""
    given, switches = split(values)
    request = options.validate("estimate", given, from_flags=given)
    spec = models.resolve(request.model or DEFAULT_MODEL)
    target = target_gpu(request.gpu, request.vram)
    settings = options.settings_from(request.model_dump(), spec, target)
    if switches["exact"]:
        from lorafit import trace

        result = trace.exact_estimate(spec, settings, target, request.headroom)
    else:
        result = memory.estimate(spec, settings, target, request.headroom)
    if switches["json"]:
        render.print_json(
            result.model_dump(mode="json")
            | {
                "exact": switches["exact"],
                "model": spec.model_dump(mode="json"),
                "settings": settings.model_dump(mode="json"),
                "gpu": target.model_dump(mode="json") if target else None,
            }
        )
    else:
        render.show_estimate(spec, settings, result, target)


@app.command()
@derived_options("plan")
def plan(**values: Any) -> None:
    """Will it fit, with which settings, how long, at what cost: the fastest configuration that fits."""
    from lorafit import plan as planner

    given, switches = split(values)
    asked = options.validate("plan", given, from_flags=given)
    spec = models.resolve(asked.model or DEFAULT_MODEL)
    pinned = {key: getattr(asked, key) for key in options.STEP_KEYS if key in given and key not in PLAN_REQUEST_KEYS}
    profile, truncated = None, None
    if asked.data is not None:
        from lorafit.data import length_profile

        options.check_against({"seq_len": asked.seq_len}, spec)
        lengths = length_profile(Path(asked.data), tokenizer=asked.tokenizer)
        profile = lengths.profile
        truncated = lengths.truncated_rows(asked.seq_len or min(profile.max, spec.max_position_embeddings))
    request = PlanRequest(
        model=spec,
        tokens=profile,
        pinned=pinned,
        **{key: getattr(asked, key) for key in PLAN_REQUEST_KEYS if key in asked.model_fields_set},
    )
    as_json = switches["json"]
    if switches["compare"]:
        plans = planner.compare(request)
        best_any, best_under = planner.cheapest(plans), planner.cheapest(plans, asked.max_price_hour)
        if as_json:
            render.print_json(
                {
                    "plans": [p.model_dump(mode="json") for p in plans],
                    "cheapest": best_any.gpu.name if best_any and best_any.gpu else None,
                    "cheapest_under_price": best_under.gpu.name if best_under and best_under.gpu else None,
                    "max_price_hour": asked.max_price_hour,
                }
            )
        else:
            render.show_compare(plans, best_any, best_under, asked.max_price_hour)
        return
    target = target_gpu(asked.gpu, asked.vram)
    if target is None and asked.model is None:
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
@derived_options("gpus")
def gpus(**values: Any) -> None:
    """The GPU catalog: memory, throughput, power and prices, each with its source."""
    given, switches = split(values)
    asked = options.validate("gpus", given, from_flags=given)
    rows = hardware.gpus(asked.min_vram or 0, asked.max_price_hour)
    if switches["json"]:
        render.print_json([gpu.model_dump(mode="json") for gpu in rows])
    else:
        render.show_gpus(rows)


@app.command("models")
@derived_options("models")
def list_models(**values: Any) -> None:
    """The model presets (any local config.json of a supported architecture works too)."""
    specs = list(models.catalog().values())
    if values["json"]:
        render.print_json(
            [
                spec.model_dump(mode="json") | {"num_params": spec.num_params, "variants": models.variants(spec.name)}
                for spec in specs
            ]
        )
    else:
        render.show_models(specs)


@app.command()
@derived_options("detect")
def detect(**values: Any) -> None:
    """The local GPUs, CPU and RAM. Works (and says so) on a machine without a GPU."""
    machine = hardware.detect()
    if values["json"]:
        render.print_json(machine.model_dump(mode="json"))
    else:
        render.show_machine(machine)


@cache  # once per process: main() may run several times in one interpreter (tests, notebooks)
def _register_subcommands() -> None:
    for module_name in ("lorafit.data.cli", "lorafit.train.cli", "lorafit.export.cli"):
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
        code = app(args=argv, standalone_mode=False)
    except typer.Abort:
        typer.echo("lorafit: interrupted", err=True)
        raise SystemExit(130) from None
    except typer.TyperException as error:  # a usage error: an unknown flag, a missing value, a bad argument
        context = getattr(error, "ctx", None)
        if type(error).__name__ == "NoArgsIsHelpError" and context is not None:
            typer.echo(context.get_help())
            raise SystemExit(0) from None
        fail(" ".join(error.format_message().split()) if hasattr(error, "format_message") else str(error))
    except LorafitError as error:
        fail(str(error).splitlines()[0] if str(error) else type(error).__name__)
    except ValidationError as error:
        fail(one_line(error))
    except KeyboardInterrupt:
        typer.echo("lorafit: interrupted", err=True)
        raise SystemExit(130) from None
    raise SystemExit(code if isinstance(code, int) else 0)  # as click's standalone mode ends


if __name__ == "__main__":
    main()
