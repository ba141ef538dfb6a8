"""The `lorafit` command: parse, build the request, call, render. No logic lives here.

Sub-commands from other packages (`data`, `train`, ...) register themselves through `register(app)`; those
modules import torch/transformers only inside their command functions, so `lorafit plan` stays instant.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from functools import cache
from typing import Any

import typer
from pydantic import ValidationError

from lorafit import answers, hardware, models, options, render, stacks, web
from lorafit.errors import LorafitError
from lorafit.options import one_line

app = typer.Typer(
    name="lorafit",
    help="Will this fine-tune fit my GPU, with which settings, how long and at what cost - then run it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: wraps to any terminal width instead of cutting long flags
)


# --- options, derived from lorafit.options -----------------------------------------------------------------
SWITCHES = {option.name for option in options.OPTIONS if not option.config}
METAVARS = {int: "INTEGER", float: "NUMBER", str: "TEXT", dict: "FIELD=COLUMN,..."}
# Choices a command's flag takes beyond the setting's own, and what they mean: a Plan's stack is always one stack
EVERY = "all"
WIDER = {("plan", "stack"): (EVERY, "; all: the plan for the default stack and the same job under every offered stack")}


def _parameter(option: options.Option, command: options.Command | None = None) -> inspect.Parameter:
    """One typer option. Values arrive as text and are checked by `options.validate`, so that a flag, a YAML
    key and a form field are refused with the same message."""
    wider, meaning = WIDER.get((command or "", option.name), ("", ""))
    if option.is_bool:
        off = option.off_flag or "--no-" + option.flag.removeprefix("--")
        declarations = [option.flag] if not option.config else [f"{option.flag}/{off}"]
        default, annotation, metavar = (False if not option.config else None), bool | None, None
    else:
        declarations = [option.flag]
        default, annotation = None, list[str] | None if option.many else str | None
        metavar = (
            "|".join(option.choices + ((wider,) if wider else ()))
            if option.choices
            else METAVARS.get(option.type, "TEXT")
        )
    declarations += list(option.flags)
    info = typer.Option(default, *declarations, help=option.help_text() + meaning, metavar=metavar, show_default=False)
    return inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation)


def derived_options(command: options.Command) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command function (`def f(<arguments>, **values)`) a typer option for every setting of `command`."""

    def attach(function: Callable[..., None]) -> Callable[..., None]:
        own = [p for p in inspect.signature(function).parameters.values() if p.kind is not p.VAR_KEYWORD]
        function.__signature__ = inspect.Signature(own + [_parameter(o, command) for o in options.for_command(command)])  # type: ignore[attr-defined]
        return function

    return attach


def split(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(settings that were set, switches) of a command's keyword arguments."""
    given = {key: value for key, value in values.items() if key not in SWITCHES and value is not None}
    return given, {key: value for key, value in values.items() if key in SWITCHES}


# --- commands -----------------------------------------------------------------------------------------------
@app.command()
@derived_options("estimate")
def estimate(**values: Any) -> None:
    """Peak memory of one training step, as a breakdown, and whether it fits the GPU."""
    given, switches = split(values)
    answer = answers.estimate(given, exact=switches["exact"], from_config=switches["from_config"])
    render.warn_about(answer.source)
    if switches["json"]:
        render.print_json(answer.to_json())
    else:
        render.show_estimate(answer.spec, answer.settings, answer.result, answer.gpu)


@app.command()
@derived_options("plan")
def plan(**values: Any) -> None:
    """Will it fit, with which settings, how long, at what cost: the fastest configuration that fits."""
    every_stack = values["stack"] == EVERY
    given, switches = split(values | {"stack": None} if every_stack else values)
    answer = answers.plan(
        given, compare=switches["compare"], from_config=switches["from_config"], every_stack=every_stack
    )
    render.warn_about(answer.source)
    if switches["json"]:
        render.print_json(answer.to_json())
    elif answer.kind == "compare":
        render.show_compare(answer.plans, answer.cheapest, answer.cheapest_under_price, answer.max_price_hour)
    else:
        if answer.note:
            render.console.print(answer.note)
        for result, rows in zip(answer.plans, answer.stacks or [[]] * len(answer.plans), strict=True):
            render.show_plan(result)
            if rows:
                render.show_stacks_for(result, rows)


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


@app.command("stacks")
@derived_options("stacks")
def list_stacks(**values: Any) -> None:
    """The trainers `--stack` estimates: the pinned versions and what each keeps alive differently. To compare
    them for one job: lorafit plan --model MODEL --gpu GPU --stack all."""
    listed = list(stacks.catalog().values())
    if values["json"]:
        render.print_json([stack.model_dump(mode="json") for stack in listed])
    else:
        render.show_stacks(listed)


@app.command()
@derived_options("detect")
def detect(**values: Any) -> None:
    """The local GPUs, CPU and RAM. Works (and says so) on a machine without a GPU."""
    machine = hardware.detect()
    if values["json"]:
        render.print_json(machine.model_dump(mode="json"))
    else:
        render.show_machine(machine)


@app.command()
@derived_options("serve")
def serve(**values: Any) -> None:
    """The planner as a local web page (and its JSON API): form, memory chart, GPU table, shareable links."""
    given, switches = split(values)
    asked = options.validate("serve", given, from_flags=given)
    web.serve(asked.host, asked.port, open_browser=switches["open"])


@cache  # once per process: main() may run several times in one interpreter (tests, notebooks)
def _register_subcommands() -> None:
    for module_name in ("lorafit.data.cli", "lorafit.train.cli", "lorafit.export.cli", "lorafit.measure.cli"):
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


INTERRUPTED = 130  # the exit code of a process ended by SIGINT, as shells report it


def _own_command(argv: list[str] | None) -> bool:
    """The command is one of this module's (plan, gpus, ...): the data, train and export commands are not imported,
    so `lorafit plan` starts without them."""
    first = next((arg for arg in (sys.argv[1:] if argv is None else argv) if not arg.startswith("-")), None)
    names = {info.name or info.callback.__name__.replace("_", "-") for info in app.registered_commands if info.callback}
    return first in names


def main(argv: list[str] | None = None) -> None:
    if not _own_command(argv):
        _register_subcommands()
    try:
        code = app(args=argv, standalone_mode=False)
    except typer.Abort:
        code = INTERRUPTED
    except typer.TyperException as error:  # a usage error: an unknown flag, a missing value, a bad argument
        context = getattr(error, "ctx", None)
        if type(error).__name__ == "NoArgsIsHelpError" and context is not None:
            typer.echo(context.get_help())
            raise SystemExit(0) from None
        message = " ".join(error.format_message().split()) if hasattr(error, "format_message") else str(error)
        if "No such option: --stack" in message and "train" in (sys.argv[1:] if argv is None else argv):
            message = (
                "--stack is for plan and estimate: lorafit train runs its own trainer (drop --stack), "
                "or run the plan with that stack's own tool"
            )
        fail(message)
    except LorafitError as error:
        fail(str(error).splitlines()[0] if str(error) else type(error).__name__)
    except ValidationError as error:
        fail(one_line(error))
    except KeyboardInterrupt:
        code = INTERRUPTED
    if code == INTERRUPTED:  # typer answers Ctrl-C in a command with this code and no word
        typer.echo("lorafit: interrupted", err=True)
    raise SystemExit(code if isinstance(code, int) else 0)  # as click's standalone mode ends


if __name__ == "__main__":
    main()
