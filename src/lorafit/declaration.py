"""How a setting is declared (`About` in its `Annotated[...]`), the table row derived from it (`Option`,
`option_rows`) and the base of the models that hold settings, whose cross-setting rules (lorafit.rules) run on
validation. The settings themselves are lorafit.options (the step and what to fine-tune) and
lorafit.run_options (the rest). Pure Python: no torch here."""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo

from lorafit.choices import Command, Frozen
from lorafit.rules import broken_rule

ESTIMATE_PLAN_TRAIN: tuple[Command, ...] = ("estimate", "plan", "train")
# The most tokens one epoch can hold: about 30 times the largest published pre-training runs (Llama 3: 15T in
# all), and 10^13 tokens a GPU-century at any throughput lorafit knows
MAX_TOKENS_PER_EPOCH = 10**13
# The most optimizer steps of one run: a second per step runs for 30 years
MAX_STEPS = 10**9


@dataclass(frozen=True)
class About:
    """What people are told about a setting, beside its type, default and bounds: its help, the commands that take
    it and the group it is shown in. It rides in the setting's `Annotated[...]` declaration."""

    help: str
    commands: tuple[Command, ...]
    group: str
    auto: str = ""  # what "not set" means where it is not simply the default
    unit: str = ""
    flags: tuple[str, ...] = ()  # more spellings, e.g. "-m", "--lr"
    off_flag: str = ""  # a bool's "false" flag; default --no-NAME
    config: bool = True  # False: a command switch (--json, --exact), not a setting a file can hold
    flag_name: str = ""  # the flag where it is not --name-with-dashes


@dataclass(frozen=True)
class Option:
    """One setting, as the table row derived from its declaration. `name` is the config key and the Python name;
    the flag is `--name-with-dashes`."""

    name: str
    type: Any  # int, float, bool, str, dict, or a Literal of the choices
    help: str
    commands: tuple[Command, ...]
    group: str
    default: Any = None
    auto: str = ""  # what "not set" means where it is not simply `default`
    unit: str = ""
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    flags: tuple[str, ...] = ()  # more spellings, e.g. "-m", "--lr"
    off_flag: str = ""  # a bool's "false" flag; default --no-NAME
    step: bool = False  # a field of `Settings`, the knobs of one training step
    config: bool = True  # False: a command switch (--json, --exact), not a setting a file can hold
    many: bool = False  # the flag may be given several times; the value is a list
    flag_name: str = ""  # the flag where it is not --name-with-dashes

    @property
    def flag(self) -> str:
        return self.flag_name or "--" + self.name.replace("_", "-")

    @property
    def choices(self) -> tuple[str, ...]:
        return get_args(self.type) if get_origin(self.type) is Literal else ()

    @property
    def is_bool(self) -> bool:
        return self.type is bool

    def describe_default(self) -> str:
        if self.auto:
            return self.auto
        if self.default is None:
            return "not set"
        if self.is_bool:
            return "on" if self.default else "off"
        return f"{self.default:g}" if isinstance(self.default, float) else str(self.default)

    def help_text(self) -> str:
        """What `--help` says: the help, the unit and the default (the choices are the flag's metavar)."""
        text = self.help + (f", in {self.unit}" if self.unit else "")
        default = self.describe_default()
        return text if default == "not set" else f"{text} [default: {default}]"

    def field_info(self, *, optional: bool) -> tuple[Any, Any]:
        """(annotation, pydantic Field) of this option in a model; `optional`: None means not set."""
        bounds: dict[str, Any] = {
            key: getattr(self, key) for key in ("gt", "ge", "lt", "le") if getattr(self, key) is not None
        }
        if self.type is float:
            bounds["allow_inf_nan"] = False
        if self.type is str:
            bounds["min_length"] = 1
        # a step setting whose default is "the stack's" is None in Settings until the stack fills it
        annotation = self.type | None if optional or (self.step and self.default is None) else self.type
        if self.many:
            annotation = list[self.type] | None if optional else list[self.type]  # type: ignore[name-defined]
        default = None if optional else self.default
        if self.type is dict:
            annotation = dict[str, str] | None if optional else dict[str, str]
            return annotation, Field(default_factory=dict) if not optional else Field(default=None)
        return annotation, Field(default=default, description=self.help_text(), **bounds)


# --- the declaration --------------------------------------------------------------------------------------------
class Declared(Frozen):
    """A model whose fields are declared settings: floats finite, text not empty."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, str_min_length=1)


class RuledModel(Declared):
    @model_validator(mode="after")
    def _rules(self) -> RuledModel:
        values = dict(self.__dict__)
        if "batch_size" in type(self).model_fields:
            values["batch_size"] = batch_size_of(values)  # the rules check the batch the run will have
        problem = broken_rule(values)
        if problem:
            raise ValueError(problem)
        return self


DEFAULT_BATCH_SIZE = 16


def batch_size_of(values: Mapping[str, Any]) -> int:
    """The effective batch: as set, else micro_batch x grad_accum (x n_gpus) when both are set, else 16."""
    if values.get("batch_size") is not None:
        return values["batch_size"]
    if values.get("micro_batch") is not None and values.get("grad_accum") is not None:
        return values["micro_batch"] * values["grad_accum"] * (values.get("n_gpus") or 1)
    return DEFAULT_BATCH_SIZE


# --- the table, derived from the declaration --------------------------------------------------------------------
def _declared_fields(declaration: type) -> dict[str, FieldInfo]:
    """The fields of a declaration class, as pydantic reads them (a plain class's through the same reader)."""
    if issubclass(declaration, BaseModel):
        return dict(declaration.model_fields)
    hints = get_type_hints(declaration, include_extras=True)
    return {name: FieldInfo.from_annotated_attribute(hint, getattr(declaration, name)) for name, hint in hints.items()}


def _plain_type(annotation: Any) -> tuple[Any, bool]:
    """(the value type without None, whether the setting is a list of it): `list[GgufType] | None` -> GgufType."""
    if get_origin(annotation) in (Union, types.UnionType):
        (annotation,) = (arg for arg in get_args(annotation) if arg is not type(None))
    if get_origin(annotation) is list:
        return get_args(annotation)[0], True
    return (dict if get_origin(annotation) is dict else annotation), False


def option_rows(declaration: type, *, step: bool = False) -> tuple[Option, ...]:
    """One table row per field of a declaration class: its `About`, its bounds, its type and its default."""
    rows = []
    for name, field in _declared_fields(declaration).items():
        about = next(item for item in field.metadata if isinstance(item, About))
        bounds = {
            key: getattr(item, key) for item in field.metadata for key in ("gt", "ge", "lt", "le") if hasattr(item, key)
        }
        kind, many = _plain_type(field.annotation)
        rows.append(
            Option(
                name,
                kind,
                about.help,
                about.commands,
                about.group,
                field.default,
                about.auto,
                about.unit,
                flags=about.flags,
                off_flag=about.off_flag,
                step=step,
                config=about.config,
                many=many,
                flag_name=about.flag_name,
                **bounds,
            )  # fmt: skip
        )
    return tuple(rows)
