"""What every reader of another tool's config shares: the file being read, its checked values, and the
settings several tools spell alike (method, optimizer, attention, precision, DeepSpeed, FSDP)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lorafit import options


# --- what every reader shares ----------------------------------------------------------------------------------
class Unmappable(Exception):
    """A value with no lorafit counterpart; `read` puts the file's name in front."""


# the module names peft's modules_to_save takes for the embeddings and the LM head in the families lorafit trains
EMBEDDING_MODULES = frozenset({"embed_tokens", "lm_head"})


@dataclass
class Reading:
    """One file being read: its keys, the lorafit values mapped so far, the lines of what is not modelled."""

    config: Mapping[str, Any]
    values: dict[str, Any] = field(default_factory=dict)
    unmodelled: list[str] = field(default_factory=list)

    def get(self, dotted: str, default: Any = None) -> Any:
        """The value at "a.b" (None counts as not set, as YAML's empty `key:` means)."""
        value: Any = self.config
        for part in dotted.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        return default if value is None else value

    def has(self, dotted: str) -> bool:
        parent, _, last = dotted.rpartition(".")
        section = self.get(parent) if parent else self.config
        return isinstance(section, Mapping) and last in section

    def copy(self, table: Mapping[str, str]) -> None:
        """Copy each key of `table` that the file sets onto its lorafit option."""
        for key, option in table.items():
            if (value := self.get(key)) is not None:
                self.values[option] = number_checked(key, option, value)

    def switch(self, key: str, default: bool = False) -> bool:
        """A true/false key: YAML's booleans, or the words true and false; anything else ("maybe", 1, a list)
        is refused rather than read as on or off."""
        value = self.get(key)
        if value is None:
            return default
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise Unmappable(f"{key} {shown_value(value)}: must be true or false")

    def section(self, key: str, example: str = "") -> Mapping[str, Any]:
        """A key that holds a mapping (an empty one when not set); anything else is refused."""
        value = self.get(key, {})
        if not isinstance(value, Mapping):
            raise Unmappable(f"{key} {shown_value(value)}: must be a mapping{' such as ' + example if example else ''}")
        return value

    def note(self, key: str, value: Any, why: str) -> None:
        self.unmodelled.append(f"{key}: {shown_value(value)} ({why})")

    def note_switched_on(self, table: Mapping[str, str], modules_to_save: str = "") -> None:
        """One line for each key of `table` (key -> why lorafit cannot model it) that the file turns on; the
        tool's `modules_to_save` key is read as train_embeddings where it can be (trains_embeddings)."""
        for key, why in table.items():
            if is_on(value := self.get(key)) and not (key == modules_to_save and self.trains_embeddings(key)):
                self.note(key, value, why)

    def trains_embeddings(self, key: str) -> bool:
        """The tool's modules_to_save names the input embedding and/or the LM head only: lorafit's
        train_embeddings (peft matches a module by its name's last part). Other module lists stay refused."""
        value = self.get(key)
        if not is_on(value) or self.values.get("method") == "full":
            return False
        if not {name.rsplit(".", 1)[-1] for name in as_names(value)} <= EMBEDDING_MODULES:
            return False
        self.values["train_embeddings"] = True
        return True


def number_checked(key: str, option: str, value: Any) -> Any:
    """YAML's true is not a number, though Python counts it as 1: refuse it for a numeric setting."""
    kind = options.BY_NAME[option].type if option in options.BY_NAME else None
    if isinstance(value, bool) and kind in (int, float):
        raise Unmappable(f"{key} {shown_value(value)}: must be a {'whole number' if kind is int else 'number'}")
    return value


def one_of(value: Any, table: Mapping[Any, Any] | Iterable[Any]) -> bool:
    """`value in table` for any value a file holds: a list is in no table, true is not 1."""
    return isinstance(value, str | int | float) and not isinstance(value, bool) and value in table


def is_on(value: Any) -> bool:
    return value not in (None, False, 0, "", "false", "none") and value != [] and value != {}


def shown_value(value: Any) -> str:
    """A value as a YAML file writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(shown_value(item) for item in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{key}: {shown_value(item)}" for key, item in value.items()) + "}"
    return str(value)


def as_names(value: Any) -> list[str]:
    """A module list as the tools write it: a YAML list, or one string with commas ("q_proj,v_proj")."""
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    if isinstance(value, Iterable) and not isinstance(value, Mapping):
        return [str(name) for name in value]
    return [str(value)]


def quant_of_switches(reading: Reading, four_bit: str) -> str:
    """nf4, int8 or none from what asks for a 4-bit base (`four_bit` names it; "" for nothing) and load_in_8bit:
    both is a contradiction, not nf4."""
    eight_bit = reading.switch("load_in_8bit")
    if four_bit and eight_bit:
        raise Unmappable(
            f"{four_bit} and load_in_8bit both ask for a quantised base: it loads in 4 or in 8 bits; keep one"
        )
    return "nf4" if four_bit else "int8" if eight_bit else "none"


def set_method(reading: Reading, *, adapters: bool, quant: str) -> None:
    """method and quant together: LoRA over a quantised base is lorafit's qlora. The quant is set only where it
    is not the method's own (int8 under qlora), so that a plan may still suggest another method."""
    method = ("qlora" if quant != "none" else "lora") if adapters else "full"
    reading.values["method"] = method
    if quant != options.default_quant(method):
        reading.values["quant"] = quant


# The module names LoRA is put on, over the families lorafit estimates, and the projection each one is.
LORA_MODULE_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "q_proj": ("q",),
    "k_proj": ("k",),
    "v_proj": ("v",),
    "o_proj": ("o",),
    "qkv_proj": ("q", "k", "v"),  # Phi-3's fused projection
    "gate_proj": ("gate",),
    "up_proj": ("up",),
    "down_proj": ("down",),
    "gate_up_proj": ("gate", "up"),  # Phi-3's fused MLP input
    # torchtune's names (torchtune/modules/peft/_utils.py LORA_ATTN_MODULES; its MLP's w1, w3 and w2)
    "output_proj": ("o",),
    "w1": ("gate",),
    "w3": ("up",),
    "w2": ("down",),
}
PROJECTION_MODULES = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}
# lorafit's choices (model_spec.LoraTargets), smallest first: a file's modules get the first that covers them all
LORA_TARGET_CHOICES: tuple[tuple[str, frozenset[str]], ...] = (
    ("qv", frozenset({"q", "v"})),
    ("attn", frozenset({"q", "k", "v", "o"})),
    ("all", frozenset({"q", "k", "v", "o", "gate", "up", "down"})),
)
ALL_LINEAR = {"all", "all-linear", "all_linear"}  # LLaMA-Factory's "all", peft's "all-linear"
HEAD_MODULES = {"lm_head", "embed_tokens", "output", "tok_embeddings", "wte"}


def lora_targets(reading: Reading, key: str, modules: Any) -> str | None:
    """The lorafit choice for a list of module names; the smallest that covers them, with a line saying which
    projections it adds (an over-estimate, never an under-estimate), and a line for names lorafit does not adapt."""
    names = as_names(modules)
    if ALL_LINEAR & set(names):
        return "all"
    return targets_covering(reading, key, projections_of(reading, key, names), names)


def projections_of(reading: Reading, key: str, names: list[str]) -> set[str]:
    """The projections the names adapt; a line for the names that are none of them (lm_head, ...)."""
    projections: set[str] = set()
    others = []
    for name in names:
        module = name.rsplit(".", 1)[-1]  # "model.layers.0.self_attn.q_proj" is a q_proj
        if module in LORA_MODULE_PROJECTIONS:
            projections.update(LORA_MODULE_PROJECTIONS[module])
        elif module not in ALL_LINEAR:
            others.append(name)
    if others:
        heads = all(name.rsplit(".", 1)[-1] in HEAD_MODULES for name in others)
        why = "LoRA on the embeddings or LM head is not modelled" if heads else "not a projection lorafit adapts"
        reading.note(key, others, why)
    return projections


def targets_covering(reading: Reading, key: str, projections: set[str], shown: Any) -> str | None:
    if not projections:
        return None
    choice, covered = next((name, covered) for name, covered in LORA_TARGET_CHOICES if projections <= covered)
    if projections != covered:
        added = ", ".join(PROJECTION_MODULES[p] for p in PROJECTION_MODULES if p in covered - projections)
        reading.note(key, shown, f"estimated as lora_targets {choice}, which adapts {added} too")
    return choice


# transformers' optimizer names (`optim`, axolotl's `optimizer`; transformers/training_args.py OptimizerNames)
# -> (lorafit optimizer, the fused AdamW step or the foreach one; None where the name does not say)
HF_OPTIMIZERS: dict[str, tuple[str, bool | None]] = {
    "adamw_torch": ("adamw", False),
    "adamw_torch_fused": ("adamw", True),
    "adamw_hf": ("adamw", False),
    "adamw": ("adamw", None),
    "adamw_8bit": ("adamw_8bit", None),
    "adamw_bnb_8bit": ("adamw_8bit", None),
    "paged_adamw_8bit": ("paged_adamw_8bit", None),
    "paged_adamw": ("paged_adamw_32bit", None),
    "paged_adamw_32bit": ("paged_adamw_32bit", None),
    "sgd": ("sgd", None),
}


def set_hf_optimizer(reading: Reading, key: str, name: Any) -> None:
    if str(name) not in HF_OPTIMIZERS:
        raise Unmappable(
            f"{key} {shown_value(name)}: not an optimizer lorafit estimates; use {', '.join(HF_OPTIMIZERS)}"
        )
    optimizer, fused = HF_OPTIMIZERS[str(name)]
    reading.values["optimizer"] = optimizer
    if fused is not None:
        reading.values["fused_optimizer"] = fused


# transformers' attn_implementation -> lorafit's attn (hub kernels named "...flash..." count as flash)
HF_ATTENTION = {"flash_attention_2": "flash", "flash_attention_3": "flash", "sdpa": "sdpa", "eager": "eager"}


def set_hf_attention(reading: Reading, key: str, name: Any) -> None:
    attn = HF_ATTENTION.get(str(name)) or ("flash" if "flash" in str(name) else None)
    if attn is None:
        raise Unmappable(f"{key} {shown_value(name)}: lorafit estimates flash_attention_2, sdpa and eager attention")
    reading.values["attn"] = attn


def set_hf_mixed_precision(reading: Reading, *, bf16: bool, fp16: bool) -> None:
    """The Trainer's bf16 / fp16 switches: autocast in that dtype; neither means no autocast at all."""
    if bf16:
        reading.values |= {"precision": "bf16", "autocast": True}
    elif fp16:
        reading.values |= {"precision": "fp16", "autocast": True}
    else:
        reading.values["autocast"] = False


# DeepSpeed ZeRO stage -> lorafit's shard; stage 1 has no lorafit counterpart and is read as the nearest, 2
ZERO_STAGES = {0: "ddp", 1: "zero2", 2: "zero2", 3: "zero3"}
OFFLOAD_DEVICES = ("cpu", "nvme")


def set_deepspeed(reading: Reading, key: str) -> None:
    """An inline DeepSpeed config sets shard and offload; a path to one is not opened (it may not be here)."""
    config = reading.get(key)
    if not is_on(config):
        return
    if isinstance(config, str):
        reading.note(key, config, "a DeepSpeed config file is not read; give shard zero2 or zero3, and offload")
        return
    if not isinstance(config, Mapping):
        raise Unmappable(f"{key} {shown_value(config)}: a DeepSpeed config is the path to its file or a mapping")
    zero = reading.section(f"{key}.zero_optimization", "{stage: 3, offload_param: {device: cpu}}")
    stage = zero.get("stage", 0)
    if not one_of(stage, ZERO_STAGES):
        shown = repr(stage) if isinstance(stage, str) else shown_value(stage)
        raise Unmappable(f"{key}.zero_optimization.stage {shown}: DeepSpeed ZeRO has stages 0 to 3")
    if stage == 1:
        reading.note(f"{key}.zero_optimization.stage", stage, "ZeRO-1 keeps whole gradients; estimated as zero2")
    reading.values["shard"] = ZERO_STAGES[stage]
    if offload_device(reading, f"{key}.zero_optimization.offload_param") in OFFLOAD_DEVICES:
        reading.values["offload"] = "params"
    elif offload_device(reading, f"{key}.zero_optimization.offload_optimizer") in OFFLOAD_DEVICES:
        reading.values["offload"] = "optimizer"


def offload_device(reading: Reading, key: str) -> str:
    """The `device` of a DeepSpeed offload section: none, cpu or nvme."""
    device = reading.section(key, "{device: cpu}").get("device", "none")
    if not one_of(device, ("none", *OFFLOAD_DEVICES)):
        raise Unmappable(f"{key}.device {shown_value(device)}: DeepSpeed offloads to none, cpu or nvme")
    return str(device)


def set_fsdp(reading: Reading, strategy: Any, fsdp_config: Any) -> None:
    """FSDP: `fsdp: "full_shard auto_wrap offload"` (a string or a list); shard_grad_op shards as ZeRO-2 does;
    offload (or offload_params) keeps the parameters, gradients and optimizer step on the host."""
    tokens = as_names(strategy.split() if isinstance(strategy, str) else strategy) if is_on(strategy) else []
    section = fsdp_config if isinstance(fsdp_config, Mapping) else {}
    reading.values["shard"] = "zero2" if {"shard_grad_op", "hybrid_shard_zero2"} & set(tokens) else "fsdp"
    if "offload" in tokens or section.get("offload_params") or section.get("fsdp_offload_params"):
        reading.values["offload"] = "params"
