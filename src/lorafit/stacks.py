"""The trainers lorafit estimates: each a named, pinned set of code-path facts (`memory.Runtime` fields).

The same model, LoRA rank and batch take different memory under TRL, under the peft QLoRA guide's
`prepare_model_for_kbit_training`, under litgpt or torchtune, because each keeps different tensors alive in
different dtypes. `Settings.stack` names the trainer; `memory.stack_runtime` turns it (and the facets a user's own
script switches: autocast, kbit preparation, fused or foreach AdamW) into the Runtime the estimator sums with. The
facts live in catalog/stacks.toml with their sources and the trace that checks them. This module knows only the
catalog, so that the option rules and the estimator can both read it. Pure Python: no torch here.
"""

from __future__ import annotations

import math
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
    liger_runtime: dict[str, Any] = Field(default_factory=dict)  # what use_liger_kernel adds; {}: no such switch
    # what peft's prepare_model_for_kbit_training leaves (the kbit_prep facet): every parameter that is not packed
    # upcast to fp32, the norms' weights and the embeddings among them (Runtime.fp32_norms, fp32_stream)
    kbit_prep_runtime: dict[str, Any] = Field(
        default_factory=lambda: {"kbit_upcast": True, "fp32_norms": True, "fp32_stream": True}
    )
    rope_scaling: bool = False  # trains past the model's trained context by scaling RoPE
    rope_scaling_source: str = ""
    rope_scaling_families: tuple[str, ...] = ()  # the families whose load scales RoPE; empty: every family
    # the attention a family trains with under this stack where it replaces transformers' kernel, as the lorafit
    # kernel that keeps the same tensors (the default where --attn is not given)
    family_attn: dict[str, str] = Field(default_factory=dict)

    keeps: tuple[str, ...]
    sources: tuple[str, ...] = ()
    traced: str
    offered: bool = True
    not_offered_because: str = ""
    nearest: Stack | None = None  # not offered: the stack `--from` answers for this tool's config files
    nearest_because: str = ""

    def facts(self, quantized: bool, liger: bool = False) -> dict[str, Any]:
        """The Runtime fields of this stack's step over a quantised or a 16-bit base, with Liger's kernels or not."""
        facts = self.runtime | (self.qlora_runtime if quantized else self.lora_runtime)
        return facts | self.liger_runtime if liger else facts

    def scales_rope(self, family: str | None) -> bool:
        """Trains past the trained context for this family (None: not known, taken as any of them)."""
        return self.rope_scaling and (not self.rope_scaling_families or family in (None, *self.rope_scaling_families))

    @property
    def liger_fuses_loss(self) -> bool:
        """With use_liger_kernel, Liger's fused linear cross-entropy is the loss (TRL keeps its own fused head)."""
        return self.liger_runtime.get("loss") == "liger_fused"


class Liger(BaseModel):
    """Liger-Kernel at its pinned version: the model types it patches (catalog/stacks.toml [liger])."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pinned: str
    model_types: tuple[str, ...]
    sources: tuple[str, ...]


@cache
def _toml() -> dict[str, Any]:
    return tomllib.loads(resources.files("lorafit").joinpath("catalog/stacks.toml").read_text())


@cache
def catalog() -> dict[str, StackSpec]:
    return {entry["name"]: StackSpec.model_validate(entry) for entry in _toml()["stack"]}


@cache
def liger() -> Liger:
    return Liger.model_validate(_toml()["liger"])


def offered() -> list[StackSpec]:
    return [stack for stack in catalog().values() if stack.offered]


def resolve(name: str) -> StackSpec:
    stack = catalog().get(name)
    if stack is None:
        raise InvalidConfig(say("error.stack_unknown", setting="stack", name=name, names=", ".join(catalog())))
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
        families = ", ".join(stack.families)
        raise InvalidConfig(
            say("error.stack_families", setting="stack", stack=stack.name, families=families, family=family)
        )
    if stack.methods and values["method"] not in stack.methods:
        said = {"method": values["method"], "stack": stack.name, "methods": " or ".join(stack.methods)}
        raise InvalidConfig(say("error.stack_method", setting="stack", setting_method="method", **said))
    shard = values.get("shard")
    if stack.shards and shard not in (None, "none", *stack.shards):
        said = {"shard": shard, "stack": stack.name, "shards": " or ".join(stack.shards)}
        raise InvalidConfig(say("error.stack_shard", setting="stack", setting_shard="shard", **said))
    quant = values.get("quant") or default_quant(values["method"])
    if quant != "none" and quant not in stack.quant:
        can = " or ".join(stack.quant) if stack.quant else say("stack.no_quant")
        said = {"quant": quant, "stack": stack.name, "can": can}
        raise InvalidConfig(say("error.stack_quant", setting="stack", setting_quant="quant", **said))
    for saver, on in SAVER_ON.items():
        if values.get(saver) == on and saver not in stack.savers:
            others = ", ".join(s.name for s in offered() if saver in s.savers)
            said = {"setting_saver": saver, "stack": stack.name, "others": others}
            raise InvalidConfig(say("error.stack_saver", setting="stack", **said))
    if values.get("liger"):
        check_liger(stack, values)
    if values.get("train_embeddings") and not stack.peft:  # peft's modules_to_save; litgpt and torchtune: none
        others = ", ".join(s.name for s in offered() if s.peft)
        said = {"setting_embeddings": "train_embeddings", "stack": stack.name, "others": others}
        raise InvalidConfig(say("error.stack_embeddings", setting="stack", **said))
    if values.get("fp32_adapters") is not None and not stack.peft:
        raise InvalidConfig(say("error.kbit_peft", setting_kbit="fp32_adapters", setting="stack", stack=stack.name))
    if values.get("kbit_prep") is not None:
        if not stack.peft:
            raise InvalidConfig(say("error.kbit_peft", setting_kbit="kbit_prep", setting="stack", stack=stack.name))
        if values["kbit_prep"] and quant == "none":
            said = {"setting_kbit": "kbit_prep", "setting_method": "method", "setting_quant": "quant"}
            raise InvalidConfig(say("error.kbit_quant", **said))


def check_liger(stack: StackSpec, values: Mapping[str, Any]) -> None:
    """`liger` on: the stack must have a use_liger_kernel switch, and where Liger's fused cross-entropy is the
    loss, lorafit's chunked loss is not."""
    if not stack.liger_runtime:
        others = ", ".join(s.name for s in offered() if s.liger_runtime)
        said = {"setting_liger": "liger", "setting": "stack", "stack": stack.name, "others": others}
        raise InvalidConfig(say("error.liger_switch", **said))
    if stack.liger_fuses_loss and values.get("loss") == SAVER_ON["loss"]:
        raise InvalidConfig(say("error.liger_loss", setting_loss="loss", setting_liger="liger"))


def check_liger_model(model_types: tuple[str, ...], name: str) -> None:
    """Liger patches only the model types it knows; another is trained without its kernels."""
    if not set(model_types) & set(liger().model_types):
        said = {"pinned": liger().pinned, "name": name, "model_type": model_types[0], "count": len(liger().model_types)}
        raise InvalidConfig(say("error.liger_model", setting_liger="liger", **said))


def rope_factor(seq_len: int, positions: int) -> int:
    """The whole RoPE scaling factor that stretches `positions` over `seq_len` (LLaMA-Factory's configure_rope:
    ceil(model_max_length / max_position_embeddings))."""
    return math.ceil(seq_len / positions)


def past_positions(
    stack_name: str, seq_len: int | None, model: str, positions: int, family: str | None = None
) -> str | None:
    """A sequence past the model's trained positions: for a stack that scales RoPE (for the model's `family`,
    where known), the plan line that says by what factor; for another, refused in one line naming the stacks that
    scale. None within the positions."""
    if seq_len is None or seq_len <= positions:
        return None
    stack = resolve(stack_name)
    scaling = [s.name for s in offered() if s.scales_rope(family)]
    if not stack.scales_rope(family):
        raise InvalidConfig(
            say(
                "error.seq_len_no_rope",
                setting="--seq-len",
                seq_len=seq_len,
                model=model,
                limit=positions,
                setting_stack="stack",
                stack=stack.name,
                stacks=", ".join(scaling),
            )
        )
    factor = rope_factor(seq_len, positions)
    return say("plan.rope", seq_len=seq_len, model=model, limit=positions, stack=stack.name, factor=factor)
