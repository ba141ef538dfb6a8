"""The trainers lorafit estimates: each a named, pinned set of code-path facts (`memory.Runtime` fields).

The same model, LoRA rank and batch take different memory under TRL, under the peft QLoRA guide's
`prepare_model_for_kbit_training`, under litgpt or torchtune, because each keeps different tensors alive in
different dtypes. `Settings.stack` names the trainer; `memory.stack_runtime` turns it (and the facets a user's own
script switches: autocast, kbit preparation, fused or foreach AdamW) into the Runtime the estimator sums with. The
facts live in catalog/stacks.toml with their sources and the trace that checks them. This module knows only the
catalog, so that the option rules and the estimator can both read it. Pure Python: no torch here.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from lorafit.choices import SAVER_ON, Stack, default_quant
from lorafit.errors import InvalidConfig
from lorafit.messages import say


class StackSpec(BaseModel):
    """One trainer at its pinned version: what it keeps alive, as Runtime fields, and where that is read from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Stack
    title: str
    pinned: str
    quant: tuple[str, ...]
    savers: tuple[str, ...] = ()
    peft: bool = True  # adapters come from peft, so peft's kbit preparation applies
    # the shards it runs on several GPUs and the model families whose step it patches; empty: all of lorafit's
    shards: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()
    families: tuple[str, ...] = ()
    defaults: dict[str, Any] = Field(default_factory=dict)  # settings the stack's own API defaults differently
    estimate_only: str = ""  # what to use instead of `lorafit train`, for a stack whose step needs its own package
    runtime: dict[str, Any] = Field(default_factory=dict)
    qlora_runtime: dict[str, Any] = Field(default_factory=dict)
    lora_runtime: dict[str, Any] = Field(default_factory=dict)
    keeps: tuple[str, ...]
    sources: tuple[str, ...] = ()
    traced: str
    offered: bool = True
    not_offered_because: str = ""
    nearest: Stack | None = None  # not offered: the stack `--from` answers for this tool's config files
    nearest_because: str = ""

    def facts(self, quantized: bool) -> dict[str, Any]:
        """The Runtime fields of this stack's step over a quantised or a 16-bit base."""
        return self.runtime | (self.qlora_runtime if quantized else self.lora_runtime)


@cache
def catalog() -> dict[str, StackSpec]:
    text = resources.files("lorafit").joinpath("catalog/stacks.toml").read_text()
    return {entry["name"]: StackSpec.model_validate(entry) for entry in tomllib.loads(text)["stack"]}


def offered() -> list[StackSpec]:
    return [stack for stack in catalog().values() if stack.offered]


def resolve(name: str) -> StackSpec:
    stack = catalog().get(name)
    if stack is None:
        raise InvalidConfig(f"stack {name}: not a stack lorafit knows; choose one of {', '.join(catalog())}")
    if not stack.offered:
        raise InvalidConfig(say("error.stack_not_offered", setting="stack", name=name, why=stack.not_offered_because))
    return stack


def for_config_of(name: str) -> tuple[str, str | None]:
    """The stack that answers for a config file of the tool `name` runs (`--from`), and the warning to say when
    it is not that tool's own: a tool whose step is not offered is answered by its nearest traced stack."""
    stack = catalog()[name]
    if stack.offered:
        return name, None
    if stack.nearest is None:
        raise InvalidConfig(say("error.stack_not_offered", setting="stack", name=name, why=stack.not_offered_because))
    return stack.nearest, (
        f"stack {name} is not offered ({stack.not_offered_because}); answered for stack {stack.nearest}: "
        f"{stack.nearest_because}"
    )


def check(values: Mapping[str, Any], family: str | None = None) -> None:
    """Refuse settings the stack cannot run, in one line naming what works. `values` are the settings that are
    set, with at least `stack` and `method` (the option rules fill their defaults), so that a plan's pinned
    settings are checked as a whole step's; `family`: the model's architecture, where it is known."""
    stack = resolve(values["stack"])
    if family is not None and stack.families and family not in stack.families:
        raise InvalidConfig(
            f"stack {stack.name} patches the step of {', '.join(stack.families)} models, not {family}; "
            "choose one of those or another stack (`lorafit stacks`)"
        )
    if stack.methods and values["method"] not in stack.methods:
        raise InvalidConfig(
            f"method {values['method']}: stack {stack.name} is modelled for method {' or '.join(stack.methods)}; "
            "choose that or another stack (`lorafit stacks`)"
        )
    shard = values.get("shard")
    if stack.shards and shard not in (None, "none", *stack.shards):
        raise InvalidConfig(
            f"shard {shard}: stack {stack.name} runs on several GPUs only with {' or '.join(stack.shards)}; "
            "choose that or another stack (`lorafit stacks`)"
        )
    quant = values.get("quant") or default_quant(values["method"])
    if quant != "none" and quant not in stack.quant:
        can = " or ".join(stack.quant) if stack.quant else "none (no quantised base)"
        raise InvalidConfig(f"quant {quant}: stack {stack.name} trains over quant {can}; see `lorafit stacks`")
    for saver, on in SAVER_ON.items():
        if values.get(saver) == on and saver not in stack.savers:
            others = ", ".join(s.name for s in offered() if saver in s.savers)
            raise InvalidConfig(f"{saver}: stack {stack.name} has no such switch (stacks that do: {others})")
    if values.get("kbit_prep") is not None:
        if not stack.peft:
            raise InvalidConfig(f"kbit_prep: stack {stack.name} does not build its adapters with peft")
        if values["kbit_prep"] and quant == "none":
            raise InvalidConfig("kbit_prep prepares a quantised base: it needs method qlora (quant nf4 or int8)")
