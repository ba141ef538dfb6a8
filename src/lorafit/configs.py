"""Read another trainer's config file (`lorafit plan --from FILE`) into lorafit's own settings.

People who train with axolotl, LLaMA-Factory, TRL, torchtune or litgpt ask "does my config fit?". Each reader
below maps the keys of one tool that change a step's memory onto lorafit's options (`lorafit.options`): what
lorafit models becomes a value, what it does not model becomes one line of `unmodelled`, and every other key
is ignored. The kind of file is told from its keys, never from its name.

`values` holds what the file states. Where leaving a key out means something else in that tool than in lorafit
and changes memory (LLaMA-Factory's LoRA rank 8, axolotl's sequence_len 512, ...), the tool's default is put in
too, with the source it comes from. The code paths of each tool (what its step keeps alive) are its stack's, in
catalog/stacks.toml, and are not repeated here; only the facets a file switches (autocast, fused AdamW) are.
A key this module reads must have the shape its tool gives it (a switch true or false, a section a mapping, a
number not a boolean), else it is refused in one line naming it, never read as on, off or a default; the values
mapped are checked by the caller with `options.validate`. The file is parsed with bounds (`safeload`). Pure Python.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lorafit import options, safeload
from lorafit.errors import InvalidConfig

# the kinds of file understood, as the error for an unknown one names them
KIND_TITLES = {
    "axolotl": "axolotl",
    "llama-factory": "LLaMA-Factory",
    "trl": "TRL SFTConfig / transformers TrainingArguments",
    "torchtune": "torchtune recipe",
    "litgpt": "litgpt finetune",
    "lorafit": "lorafit train",
}
# the stack (options.Stack) whose step each kind of file runs
STACK_OF_KIND = {
    "axolotl": "axolotl",
    "llama-factory": "llama-factory",
    "trl": "trl",
    "torchtune": "torchtune",
    "litgpt": "litgpt",
    "lorafit": "lorafit",
}


@dataclass(frozen=True)
class Imported:
    """A config file of another tool in lorafit's terms: what it sets, and what it sets that lorafit cannot."""

    kind: str  # one of KIND_TITLES
    values: dict[str, Any]  # lorafit option name -> value; `stack` always, `model` when the file names one
    unmodelled: list[str]  # "KEY: VALUE (why)", one per key that changes memory in a way lorafit does not model


def read(path: Path) -> Imported:
    """Read a training config of any kind in KIND_TITLES. Raises InvalidConfig, one line naming the file, when
    the file cannot be read or parsed, its kind cannot be told, or a value has no lorafit counterpart."""
    path = Path(path)
    config = _load(path)
    kind = detect(config)
    if kind is None and (mixed := _mixed_evidence(config)):
        raise InvalidConfig(
            f"{path}: cannot tell which trainer this config is for: it has lorafit's keys and {mixed}; "
            "a lorafit config holds lorafit's keys only (see `lorafit init`)"
        )
    if kind is None:
        understood = ", ".join(KIND_TITLES.values())
        raise InvalidConfig(
            f"{path}: cannot tell which trainer this config is for (none of the keys lorafit looks for); "
            f"lorafit reads {understood} configs"
        )
    reading = _Reading(config)
    try:
        READERS[kind](reading)
    except _Unmappable as problem:
        raise InvalidConfig(_one_line(f"{path}: {problem}")) from None
    values = {"stack": STACK_OF_KIND[kind]} | reading.values
    return Imported(kind=kind, values=values, unmodelled=reading.unmodelled)


# --- reading the file -----------------------------------------------------------------------------------------
def _load(path: Path) -> dict[str, Any]:
    """The top-level mapping of a YAML or JSON file: JSON when it starts with a brace, as every JSON config does,
    else YAML, whatever the file is called."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise InvalidConfig(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InvalidConfig(f"{path} is a directory, not a config file") from None
    except UnicodeDecodeError:
        raise InvalidConfig(f"{path} is not a text file (not UTF-8)") from None
    except OSError as error:
        raise InvalidConfig(f"{path}: cannot be read ({error.strerror or error})") from None
    if text.lstrip().startswith(("{", "[")):
        try:
            config = safeload.load_json(text)
        except json.JSONDecodeError as error:
            raise InvalidConfig(f"{path} is not valid JSON (line {error.lineno}: {error.msg})") from None
        except ValueError as error:  # past a bound: too deep, a number too long
            raise InvalidConfig(f"{path} cannot be read as settings ({error})") from None
    else:
        try:
            config = safeload.load_yaml(text)
        except safeload.Refused as error:
            raise InvalidConfig(f"{path} cannot be read as settings ({error})") from None
        except yaml.YAMLError as error:
            raise InvalidConfig(_one_line(f"{path} is not valid YAML ({_yaml_problem(error)})")) from None
    if not isinstance(config, dict):
        found = "nothing" if config is None else f"a {type(config).__name__}"
        raise InvalidConfig(f"{path} must hold a mapping of settings at the top level, not {found}")
    if names := [key for key in config if not isinstance(key, str)]:
        raise InvalidConfig(f"{path}: the key {_shown(names[0])} is not a setting's name")
    return config


def _yaml_problem(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    return f"line {mark.line + 1}: {problem}" if mark is not None else problem


def _one_line(text: str) -> str:
    return " ".join(text.split())


# --- telling the kind from the keys ---------------------------------------------------------------------------
# Keys only that tool's files have at the top level. Files of LLaMA-Factory and axolotl hold transformers'
# TrainingArguments keys too, so those tools' own keys decide first, and TRL's only when none of theirs is there.
AXOLOTL_KEYS = frozenset(
    {
        "base_model",
        "adapter",
        "micro_batch_size",
        "sequence_len",
        "sample_packing",
        "lora_target_linear",
        "lora_model_dir",
        "flash_attention",
        "num_epochs",
        "datasets",
        "dataset_prepared_path",
        "val_set_size",
        "pad_to_sequence_len",
        "train_on_inputs",
        "evals_per_epoch",
        "saves_per_epoch",
        "special_tokens",
        "wandb_project",
        "plugins",
    }
)
LLAMA_FACTORY_KEYS = frozenset(
    {
        "stage",
        "finetuning_type",
        "quantization_bit",
        "quantization_method",
        "double_quantization",
        "lora_rank",
        "lora_target",
        "cutoff_len",
        "template",
        "dataset_dir",
        "flash_attn",
        "upcast_layernorm",
        "pure_bf16",
        "disable_gradient_checkpointing",
        "plot_loss",
        "use_unsloth",
        "enable_liger_kernel",
        "additional_target",
        "max_samples",
    }
)
LITGPT_KEYS = frozenset(
    {
        "checkpoint_dir",
        "out_dir",
        "quantize",
        "devices",
        "num_nodes",
        "lora_query",
        "lora_key",
        "lora_value",
        "lora_projection",
        "lora_mlp",
        "lora_head",
        "train",
        "eval",
        "logger_name",
    }
)
# lorafit's own names that the other tools do not use at the top level
LORAFIT_KEYS = frozenset(
    {
        "model",
        "gpu",
        "vram",
        "eval_data",
        "eval_split",
        "method",
        "quant",
        "double_quant",
        "lora_targets",
        "micro_batch",
        "grad_accum",
        "seq_len",
        "grad_ckpt",
        "attn",
        "stack",
        "shard",
        "n_gpus",
        "headroom",
        "offload_activations",
        "offload_embeddings",
        "expandable_segments",
        "data_format",
        "data_mapping",
        "batching",
    }
)
TRL_KEYS = frozenset(
    {
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "gradient_checkpointing",
        "optim",
        "bf16",
        "fp16",
        "num_train_epochs",
        "max_seq_length",
        "max_length",
        "packing",
        "use_peft",
        "model_name_or_path",
        "dataset_name",
        "dataset_text_field",
        "lr_scheduler_type",
        "save_strategy",
        "eval_strategy",
        "report_to",
        "attn_implementation",
        "load_in_4bit",
        "load_in_8bit",
        "torch_dtype",
        "do_train",
        "overwrite_output_dir",
    }
)


OWN_KEYS = {"llama-factory": LLAMA_FACTORY_KEYS, "axolotl": AXOLOTL_KEYS, "litgpt": LITGPT_KEYS}


def detect(config: Mapping[str, Any]) -> str | None:
    """The kind of a config from its keys: a torchtune recipe names `_component_`s; axolotl, LLaMA-Factory and
    litgpt have keys of their own (the most of them wins); then lorafit's names; then transformers' and TRL's.
    A file with lorafit's own keys is lorafit's when no other tool's keys outnumber them (`lora_rank` in a lorafit
    file is a typo of lora_r, not a LLaMA-Factory config); with more of another's, the kind is not told (None)."""
    if any(isinstance(value, Mapping) and "_component_" in value for value in config.values()):
        return "torchtune"
    keys = set(config)
    counts = {kind: len(keys & marks) for kind, marks in OWN_KEYS.items()}
    best = max(counts, key=lambda kind: counts[kind])
    lorafit = len(keys & LORAFIT_KEYS)
    if lorafit and lorafit >= counts[best]:
        return "lorafit"
    if counts[best]:
        return None if lorafit else best
    if keys and keys <= set(options.BY_NAME):
        return "lorafit"
    if keys & TRL_KEYS:
        return "trl"
    return None


def _mixed_evidence(config: Mapping[str, Any]) -> str:
    """For a file with lorafit's keys and more of other tools': "LLaMA-Factory's (lora_rank, cutoff_len)"."""
    if not set(config) & LORAFIT_KEYS:
        return ""
    found = [(KIND_TITLES[kind], sorted(set(config) & marks)) for kind, marks in OWN_KEYS.items()]
    return " and ".join(f"{title}'s ({', '.join(keys)})" for title, keys in found if keys)


# --- what every reader shares ----------------------------------------------------------------------------------
class _Unmappable(Exception):
    """A value with no lorafit counterpart; `read` puts the file's name in front."""


@dataclass
class _Reading:
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
                self.values[option] = _number_checked(key, option, value)

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
        raise _Unmappable(f"{key} {_shown(value)}: must be true or false")

    def section(self, key: str, example: str = "") -> Mapping[str, Any]:
        """A key that holds a mapping (an empty one when not set); anything else is refused."""
        value = self.get(key, {})
        if not isinstance(value, Mapping):
            raise _Unmappable(f"{key} {_shown(value)}: must be a mapping{' such as ' + example if example else ''}")
        return value

    def note(self, key: str, value: Any, why: str) -> None:
        self.unmodelled.append(f"{key}: {_shown(value)} ({why})")

    def note_switched_on(self, table: Mapping[str, str]) -> None:
        """One line for each key of `table` (key -> why lorafit cannot model it) that the file turns on."""
        for key, why in table.items():
            if _is_on(value := self.get(key)):
                self.note(key, value, why)


def _number_checked(key: str, option: str, value: Any) -> Any:
    """YAML's true is not a number, though Python counts it as 1: refuse it for a numeric setting."""
    kind = options.BY_NAME[option].type if option in options.BY_NAME else None
    if isinstance(value, bool) and kind in (int, float):
        raise _Unmappable(f"{key} {_shown(value)}: must be a {'whole number' if kind is int else 'number'}")
    return value


def _one_of(value: Any, table: Mapping[Any, Any] | Iterable[Any]) -> bool:
    """`value in table` for any value a file holds: a list is in no table, true is not 1."""
    return isinstance(value, str | int | float) and not isinstance(value, bool) and value in table


def _is_on(value: Any) -> bool:
    return value not in (None, False, 0, "", "false", "none") and value != [] and value != {}


def _shown(value: Any) -> str:
    """A value as a YAML file writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_shown(item) for item in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{key}: {_shown(item)}" for key, item in value.items()) + "}"
    return str(value)


def _as_names(value: Any) -> list[str]:
    """A module list as the tools write it: a YAML list, or one string with commas ("q_proj,v_proj")."""
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    if isinstance(value, Iterable) and not isinstance(value, Mapping):
        return [str(name) for name in value]
    return [str(value)]


def _quant_of_switches(reading: _Reading, four_bit: str) -> str:
    """nf4, int8 or none from what asks for a 4-bit base (`four_bit` names it; "" for nothing) and load_in_8bit:
    both is a contradiction, not nf4."""
    eight_bit = reading.switch("load_in_8bit")
    if four_bit and eight_bit:
        raise _Unmappable(
            f"{four_bit} and load_in_8bit both ask for a quantised base: it loads in 4 or in 8 bits; keep one"
        )
    return "nf4" if four_bit else "int8" if eight_bit else "none"


def _set_method(reading: _Reading, *, adapters: bool, quant: str) -> None:
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
# lorafit's choices (models.LoraTargets), smallest first: a file's modules get the first that covers them all
LORA_TARGET_CHOICES: tuple[tuple[str, frozenset[str]], ...] = (
    ("qv", frozenset({"q", "v"})),
    ("attn", frozenset({"q", "k", "v", "o"})),
    ("all", frozenset({"q", "k", "v", "o", "gate", "up", "down"})),
)
ALL_LINEAR = {"all", "all-linear", "all_linear"}  # LLaMA-Factory's "all", peft's "all-linear"
HEAD_MODULES = {"lm_head", "embed_tokens", "output", "tok_embeddings", "wte"}


def _lora_targets(reading: _Reading, key: str, modules: Any) -> str | None:
    """The lorafit choice for a list of module names; the smallest that covers them, with a line saying which
    projections it adds (an over-estimate, never an under-estimate), and a line for names lorafit does not adapt."""
    names = _as_names(modules)
    if ALL_LINEAR & set(names):
        return "all"
    return _targets_covering(reading, key, _projections_of(reading, key, names), names)


def _projections_of(reading: _Reading, key: str, names: list[str]) -> set[str]:
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


def _targets_covering(reading: _Reading, key: str, projections: set[str], shown: Any) -> str | None:
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


def _set_hf_optimizer(reading: _Reading, key: str, name: Any) -> None:
    if str(name) not in HF_OPTIMIZERS:
        raise _Unmappable(f"{key} {_shown(name)}: not an optimizer lorafit estimates; use {', '.join(HF_OPTIMIZERS)}")
    optimizer, fused = HF_OPTIMIZERS[str(name)]
    reading.values["optimizer"] = optimizer
    if fused is not None:
        reading.values["fused_optimizer"] = fused


# transformers' attn_implementation -> lorafit's attn (hub kernels named "...flash..." count as flash)
HF_ATTENTION = {"flash_attention_2": "flash", "flash_attention_3": "flash", "sdpa": "sdpa", "eager": "eager"}


def _set_hf_attention(reading: _Reading, key: str, name: Any) -> None:
    attn = HF_ATTENTION.get(str(name)) or ("flash" if "flash" in str(name) else None)
    if attn is None:
        raise _Unmappable(f"{key} {_shown(name)}: lorafit estimates flash_attention_2, sdpa and eager attention")
    reading.values["attn"] = attn


def _set_hf_mixed_precision(reading: _Reading, *, bf16: bool, fp16: bool) -> None:
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


def _set_deepspeed(reading: _Reading, key: str) -> None:
    """An inline DeepSpeed config sets shard and offload; a path to one is not opened (it may not be here)."""
    config = reading.get(key)
    if not _is_on(config):
        return
    if isinstance(config, str):
        reading.note(key, config, "a DeepSpeed config file is not read; give shard zero2 or zero3, and offload")
        return
    if not isinstance(config, Mapping):
        raise _Unmappable(f"{key} {_shown(config)}: a DeepSpeed config is the path to its file or a mapping")
    zero = reading.section(f"{key}.zero_optimization", "{stage: 3, offload_param: {device: cpu}}")
    stage = zero.get("stage", 0)
    if not _one_of(stage, ZERO_STAGES):
        shown = repr(stage) if isinstance(stage, str) else _shown(stage)
        raise _Unmappable(f"{key}.zero_optimization.stage {shown}: DeepSpeed ZeRO has stages 0 to 3")
    if stage == 1:
        reading.note(f"{key}.zero_optimization.stage", stage, "ZeRO-1 keeps whole gradients; estimated as zero2")
    reading.values["shard"] = ZERO_STAGES[stage]
    if _offload_device(reading, f"{key}.zero_optimization.offload_param") in OFFLOAD_DEVICES:
        reading.values["offload"] = "params"
    elif _offload_device(reading, f"{key}.zero_optimization.offload_optimizer") in OFFLOAD_DEVICES:
        reading.values["offload"] = "optimizer"


def _offload_device(reading: _Reading, key: str) -> str:
    """The `device` of a DeepSpeed offload section: none, cpu or nvme."""
    device = reading.section(key, "{device: cpu}").get("device", "none")
    if not _one_of(device, ("none", *OFFLOAD_DEVICES)):
        raise _Unmappable(f"{key}.device {_shown(device)}: DeepSpeed offloads to none, cpu or nvme")
    return str(device)


def _set_fsdp(reading: _Reading, strategy: Any, fsdp_config: Any) -> None:
    """FSDP: `fsdp: "full_shard auto_wrap offload"` (a string or a list); shard_grad_op shards as ZeRO-2 does;
    offload (or offload_params) keeps the parameters, gradients and optimizer step on the host."""
    tokens = _as_names(strategy.split() if isinstance(strategy, str) else strategy) if _is_on(strategy) else []
    section = fsdp_config if isinstance(fsdp_config, Mapping) else {}
    reading.values["shard"] = "zero2" if {"shard_grad_op", "hybrid_shard_zero2"} & set(tokens) else "fsdp"
    if "offload" in tokens or section.get("offload_params") or section.get("fsdp_offload_params"):
        reading.values["offload"] = "params"


# --- axolotl ---------------------------------------------------------------------------------------------------
# Defaults from axolotl's schemas (src/axolotl/utils/schemas/): config.py sequence_len 512, gradient_checkpointing
# false, bf16 "auto"; training.py optimizer adamw_torch_fused; peft.py lora_dropout 0.0 once an adapter is set.
AXOLOTL_SAME = {
    "base_model": "model",
    "micro_batch_size": "micro_batch",
    "gradient_accumulation_steps": "grad_accum",
    "sequence_len": "seq_len",
    "num_epochs": "epochs",
}
AXOLOTL_LORA_SAME = {"lora_r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout"}
AXOLOTL_ATTENTION = {"flash_attention": "flash", "sdp_attention": "sdpa", "eager_attention": "eager"}
AXOLOTL_UNMODELLED = {
    "xformers_attention": "xformers attention is not modelled",
    "flex_attention": "flex attention is not modelled",
    "s2_attention": "shifted-sparse attention is not modelled",
    "liger_rms_norm": "Liger kernels are not modelled",
    "liger_glu_activation": "Liger kernels are not modelled",
    "liger_rope": "Liger kernels are not modelled",
    "liger_layer_norm": "Liger kernels are not modelled",
    "liger_cross_entropy": "Liger kernels are not modelled",
    "liger_fused_linear_cross_entropy": "Liger's fused loss is not modelled; lorafit's nearest is loss chunked",
    "cut_cross_entropy": "Cut Cross-Entropy is not modelled; lorafit's nearest is loss chunked",
    "torch_compile": "torch.compile changes what is kept for backward; not modelled",
    "unsloth_cross_entropy_loss": "Unsloth kernels are not modelled",
    "unsloth_lora_mlp": "Unsloth kernels are not modelled",
    "unsloth_lora_qkv": "Unsloth kernels are not modelled",
    "unsloth_lora_o": "Unsloth kernels are not modelled",
    "unsloth_rms_norm": "Unsloth kernels are not modelled",
    "unsloth_rope": "Unsloth kernels are not modelled",
    "lora_mlp_kernel": "axolotl's fused LoRA kernels are not modelled",
    "lora_qkv_kernel": "axolotl's fused LoRA kernels are not modelled",
    "lora_o_kernel": "axolotl's fused LoRA kernels are not modelled",
    "flash_attn_cross_entropy": "flash-attn's fused kernels are not modelled",
    "flash_attn_rms_norm": "flash-attn's fused kernels are not modelled",
    "flash_attn_fuse_qkv": "flash-attn's fused kernels are not modelled",
    "flash_attn_fuse_mlp": "flash-attn's fused kernels are not modelled",
    "lora_modules_to_save": "fully trained extra modules are not modelled",
    "peft_use_dora": "DoRA's magnitude vectors and extra activations are not modelled",
    "relora": "ReLoRA restarts are not modelled",
    "neftune_noise_alpha": "NEFTune's noised embeddings are not modelled",
    "rl": "preference and RL training (a reference model, paired rows) is not modelled",
}
AXOLOTL_PARALLEL = ("sequence_parallel_degree", "context_parallel_size", "tensor_parallel_size")


def _read_axolotl(reading: _Reading) -> None:
    """axolotl: `adapter` and `load_in_4bit`/`load_in_8bit` make the method; its own names for the rest."""
    reading.copy(AXOLOTL_SAME)
    reading.values.setdefault("seq_len", 512)  # schemas/config.py: sequence_len = 512
    if "micro_batch" not in reading.values or "grad_accum" not in reading.values:
        reading.copy({"batch_size": "batch_size"})  # axolotl needs two of the three; the third follows
    if reading.get("gptq"):
        raise _Unmappable("gptq: true: lorafit estimates bitsandbytes bases (load_in_4bit or load_in_8bit)")
    adapter = reading.get("adapter")
    if adapter in ("lora", "qlora"):
        four_bit = "adapter qlora" if adapter == "qlora" else "load_in_4bit" if reading.switch("load_in_4bit") else ""
        _set_method(reading, adapters=True, quant=_quant_of_switches(reading, four_bit))
        reading.copy(AXOLOTL_LORA_SAME)
        reading.values.setdefault("lora_dropout", 0.0)  # schemas/peft.py validate_lora_dropout: 0.0
        _axolotl_targets(reading)
        _axolotl_bnb_overrides(reading)
    elif adapter:
        raise _Unmappable(f"adapter {_shown(adapter)}: lorafit estimates the lora and qlora adapters (or none: full)")
    elif reading.switch("load_in_4bit") or reading.switch("load_in_8bit"):
        raise _Unmappable(
            "load_in_4bit / load_in_8bit without an adapter: axolotl trains a quantised base only with LoRA"
        )
    else:
        _set_method(reading, adapters=False, quant="none")
    _axolotl_precision(reading)
    for key, attn in AXOLOTL_ATTENTION.items():
        if reading.switch(key):
            reading.values["attn"] = attn
    _axolotl_checkpointing(reading)
    _set_hf_optimizer(reading, "optimizer", reading.get("optimizer", "adamw_torch_fused"))  # schemas/training.py
    _set_deepspeed(reading, "deepspeed")
    if _is_on(reading.get("fsdp")) or _is_on(reading.get("fsdp_config")):
        _set_fsdp(reading, reading.get("fsdp"), reading.get("fsdp_config"))
    reading.note_switched_on(AXOLOTL_UNMODELLED)
    for key in AXOLOTL_PARALLEL:
        if isinstance(degree := reading.get(key), int) and degree > 1:
            reading.note(key, degree, "splitting a layer or a sequence over GPUs is not modelled")
    # sample_packing fills each row to sequence_len: a step of micro_batch x seq_len tokens, which is what lorafit
    # estimates anyway (seq_len is always set above), so it needs no line of its own


def _axolotl_targets(reading: _Reading) -> None:
    modules = reading.get("lora_target_modules")
    if reading.switch("lora_target_linear"):
        reading.values["lora_targets"] = "all"
        if modules is not None:  # modules beyond the linear layers (lm_head, ...) are reported
            _projections_of(reading, "lora_target_modules", _as_names(modules))
    elif modules is not None and (targets := _lora_targets(reading, "lora_target_modules", modules)):
        reading.values["lora_targets"] = targets


def _axolotl_bnb_overrides(reading: _Reading) -> None:
    """bnb_config_kwargs overrides axolotl's 4-bit config (double quantisation on, nf4: src/axolotl/loaders)."""
    if reading.values.get("quant", options.default_quant(reading.values["method"])) != "nf4":
        return
    if reading.get("bnb_config_kwargs.bnb_4bit_use_double_quant") is not None:
        reading.values["double_quant"] = reading.switch("bnb_config_kwargs.bnb_4bit_use_double_quant")
    if reading.get("bnb_config_kwargs.bnb_4bit_quant_type") == "fp4":
        reading.note("bnb_config_kwargs.bnb_4bit_quant_type", "fp4", "estimated as nf4: the same 4 bits a weight")


def _axolotl_precision(reading: _Reading) -> None:
    """bf16/fp16 are the Trainer's autocast; bfloat16/float16 load the model in that dtype without it; with
    neither, axolotl loads and trains in fp32. `bf16: auto` (the default) is bf16 where the GPU has it."""
    bf16, fp16 = reading.get("bf16", "auto"), reading.switch("fp16")
    if bf16 != "auto":
        bf16 = reading.switch("bf16")
    if bf16 is True or fp16:
        _set_hf_mixed_precision(reading, bf16=bf16, fp16=fp16)
    elif reading.switch("bfloat16"):
        reading.values |= {"precision": "bf16", "autocast": False}
    elif reading.switch("float16"):
        reading.values |= {"precision": "fp16", "autocast": False}
    elif bf16 is False:
        reading.values |= {"precision": "fp32", "autocast": False}


def _axolotl_checkpointing(reading: _Reading) -> None:
    checkpointing = reading.get("gradient_checkpointing", False)  # schemas/config.py: False
    if checkpointing not in ("offload", "offload_disk"):
        checkpointing = reading.switch("gradient_checkpointing")
    reading.values["grad_ckpt"] = bool(checkpointing)
    if checkpointing == "offload":
        reading.values["offload_activations"] = True
    elif checkpointing == "offload_disk":
        reading.note("gradient_checkpointing", checkpointing, "checkpoints on disk are not modelled")
    offloading = reading.get("activation_offloading")
    if offloading not in ("legacy", "disk"):
        offloading = reading.switch("activation_offloading")
    if offloading in (True, "legacy"):
        reading.values["offload_activations"] = True
    elif offloading == "disk":
        reading.note("activation_offloading", offloading, "activations on disk are not modelled")


# --- LLaMA-Factory ---------------------------------------------------------------------------------------------
# Defaults from LLaMA-Factory (src/llamafactory/hparams/): finetuning_args.py finetuning_type lora, lora_rank 8,
# lora_dropout 0.0, lora_target "all", lora_alpha 2 x rank (lorafit's own); data_args.py cutoff_len 2048;
# model_args.py double_quantization true, quantization_method bnb, quantization_type nf4;
# model/model_utils/checkpointing.py turns gradient checkpointing on unless disable_gradient_checkpointing.
# Its Trainer keys are transformers': per_device_train_batch_size 8, optim an AdamW, bf16 and fp16 off.
LLAMA_FACTORY_SAME = {
    "model_name_or_path": "model",
    "per_device_train_batch_size": "micro_batch",
    "gradient_accumulation_steps": "grad_accum",
    "cutoff_len": "seq_len",
    "num_train_epochs": "epochs",
}
LLAMA_FACTORY_LORA_SAME = {"lora_rank": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout"}
LLAMA_FACTORY_QUANT_BITS = {4: "nf4", 8: "int8"}
LLAMA_FACTORY_ATTENTION = {"auto": None, "disabled": "eager", "sdpa": "sdpa", "fa2": "flash", "fa3": "flash"}
LLAMA_FACTORY_STAGES = ("sft", "pt")  # the stages that train as lorafit estimates; rm, ppo, dpo, kto do not
LLAMA_FACTORY_UNMODELLED = {
    "use_unsloth": "Unsloth's kernels are not modelled",
    "use_unsloth_gc": "Unsloth's offloaded checkpoints are not modelled",
    "use_dora": "DoRA's magnitude vectors and extra activations are not modelled",
    "additional_target": "fully trained extra modules are not modelled",
    "neftune_noise_alpha": "NEFTune's noised embeddings are not modelled",
    "upcast_layernorm": "norm weights in fp32 are not modelled",
    "upcast_lmhead_output": "an fp32 LM-head output is not modelled",
    "torch_compile": "torch.compile changes what is kept for backward; not modelled",
    "use_galore": "GaLore's projected optimizer states are not modelled",
    "use_apollo": "APOLLO's projected optimizer states are not modelled",
    "use_badam": "BAdam's block-wise updates are not modelled",
    "use_llama_pro": "LLaMA Pro's added blocks are not modelled",
    "shift_attn": "shifted-sparse attention is not modelled",
}


def _read_llama_factory(reading: _Reading) -> None:
    """LLaMA-Factory: `finetuning_type` and `quantization_bit` make the method; transformers' names for the step."""
    reading.copy(LLAMA_FACTORY_SAME)
    reading.values.setdefault("micro_batch", 8)  # transformers TrainingArguments.per_device_train_batch_size
    reading.values.setdefault("seq_len", 2048)  # data_args.py: cutoff_len = 2048
    stage = reading.get("stage", "sft")
    if stage not in LLAMA_FACTORY_STAGES:
        reading.note("stage", stage, "lorafit estimates supervised fine-tuning; this stage's extra models are not")
    finetuning_type = reading.get("finetuning_type", "lora")  # finetuning_args.py
    quant = _llama_factory_quant(reading)
    if finetuning_type == "lora":
        _set_method(reading, adapters=True, quant=quant)
        reading.copy(LLAMA_FACTORY_LORA_SAME)
        reading.values.setdefault("lora_r", 8)  # finetuning_args.py: lora_rank = 8
        reading.values.setdefault("lora_dropout", 0.0)  # finetuning_args.py: lora_dropout = 0.0
        targets = _lora_targets(reading, "lora_target", reading.get("lora_target", "all"))  # finetuning_args.py
        if targets:
            reading.values["lora_targets"] = targets
        if quant == "nf4":
            reading.values["double_quant"] = reading.switch("double_quantization", True)  # model_args.py
    elif finetuning_type == "full":
        if quant != "none":
            raise _Unmappable(
                f"quantization_bit {reading.get('quantization_bit')}: LLaMA-Factory quantises only for LoRA"
            )
        _set_method(reading, adapters=False, quant="none")
    else:
        raise _Unmappable(f"finetuning_type {_shown(finetuning_type)}: lorafit estimates lora and full fine-tuning")
    if reading.switch("pure_bf16"):
        reading.values |= {"precision": "bf16", "autocast": False}  # bf16 weights, no autocast
    else:
        _set_hf_mixed_precision(reading, bf16=reading.switch("bf16"), fp16=reading.switch("fp16"))
    attention = reading.get("flash_attn", "auto")
    if not _one_of(attention, LLAMA_FACTORY_ATTENTION):
        raise _Unmappable(f"flash_attn {_shown(attention)}: use one of {', '.join(LLAMA_FACTORY_ATTENTION)}")
    if LLAMA_FACTORY_ATTENTION[attention]:
        reading.values["attn"] = LLAMA_FACTORY_ATTENTION[attention]
    reading.values["grad_ckpt"] = not reading.switch("disable_gradient_checkpointing")
    if reading.switch("enable_liger_kernel"):  # model_args.py; apply_liger_kernel, its fused loss for sft and pt
        reading.values["liger"] = True
    _set_hf_optimizer(reading, "optim", reading.get("optim", "adamw"))  # transformers' default: an AdamW
    _set_deepspeed(reading, "deepspeed")
    reading.note_switched_on(LLAMA_FACTORY_UNMODELLED)
    # packing and neat_packing fill each row to cutoff_len: what lorafit estimates at seq_len anyway


def _llama_factory_quant(reading: _Reading) -> str:
    bits = reading.get("quantization_bit")
    if bits is None:
        return "none"
    if not _one_of(bits, LLAMA_FACTORY_QUANT_BITS):
        raise _Unmappable(f"quantization_bit {_shown(bits)}: lorafit estimates 4-bit (nf4) and 8-bit bases")
    method = reading.get("quantization_method", "bnb")
    if method != "bnb":
        reading.note("quantization_method", method, f"estimated as bitsandbytes {LLAMA_FACTORY_QUANT_BITS[bits]}")
    if bits == 4 and reading.get("quantization_type") == "fp4":
        reading.note("quantization_type", "fp4", "estimated as nf4: the same 4 bits a weight")
    return LLAMA_FACTORY_QUANT_BITS[bits]


# --- TRL / transformers TrainingArguments ----------------------------------------------------------------------
# A TRL file (trl sft --config, or an SFTConfig as JSON) holds SFTConfig, ModelConfig and ScriptArguments keys;
# a transformers TrainingArguments file holds none of those. Defaults: trl/trainer/sft_config.py max_length 1024,
# gradient_checkpointing true, bf16 true unless fp16; trl/trainer/model_config.py use_peft false, lora_r 16 and
# lora_dropout 0.05 (lorafit's own), use_bnb_nested_quant false, lora_target_modules none, which leaves peft its
# default for the architecture (peft/utils/constants.py TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING:
# q_proj and v_proj for llama, mistral, qwen2, gemma); transformers training_args.py per_device_train_batch_size 8,
# gradient_checkpointing false, bf16 and fp16 false, optim an AdamW.
TRL_SAME = {
    "model_name_or_path": "model",
    "per_device_train_batch_size": "micro_batch",
    "gradient_accumulation_steps": "grad_accum",
    "gradient_checkpointing": "grad_ckpt",
    "num_train_epochs": "epochs",
    "activation_offloading": "offload_activations",
}
TRL_LORA_SAME = {"lora_r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout"}
TRL_SEQUENCE_KEYS = ("max_length", "max_seq_length")  # SFTConfig's, and its name before TRL 0.20
TRL_LOSSES = {"nll": "full", "dft": "full", "chunked_nll": "chunked"}
TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# keys of TRL's own configs, not of transformers' TrainingArguments
TRL_ONLY_KEYS = frozenset(
    {
        "max_length",
        "max_seq_length",
        "packing",
        "padding_free",
        "dataset_text_field",
        "dataset_kwargs",
        "completion_only_loss",
        "assistant_only_loss",
        "loss_type",
        "activation_offloading",
        "model_init_kwargs",
        "chat_template_path",
        "eos_token",
    }
)
TRL_MODEL_KEYS = frozenset(  # ModelConfig and ScriptArguments: `trl sft` loads the model itself
    {
        "model_name_or_path",
        "use_peft",
        "lora_r",
        "lora_alpha",
        "lora_target_modules",
        "load_in_4bit",
        "load_in_8bit",
        "use_bnb_nested_quant",
        "attn_implementation",
        "dataset_name",
    }
)
TRL_UNMODELLED = {
    "torch_compile": "torch.compile changes what is kept for backward; not modelled",
    "neftune_noise_alpha": "NEFTune's noised embeddings are not modelled",
    "lora_modules_to_save": "fully trained extra modules are not modelled",
    "use_dora": "DoRA's magnitude vectors and extra activations are not modelled",
}


def _read_trl(reading: _Reading) -> None:
    """TRL's SFTConfig + ModelConfig, or transformers' TrainingArguments alone (then the file cannot say whether
    the script adds LoRA, and the method is left to the user)."""
    keys = set(reading.config)
    is_trl = bool(keys & (TRL_ONLY_KEYS | TRL_MODEL_KEYS))
    reading.copy(TRL_SAME)
    reading.values.setdefault("micro_batch", 8)  # training_args.py: per_device_train_batch_size = 8
    reading.values.setdefault("grad_ckpt", is_trl)  # sft_config.py: True; training_args.py: False
    _trl_sequence_length(reading, is_trl)
    if keys & TRL_MODEL_KEYS:
        _trl_method(reading)
    else:
        reading.unmodelled.append(
            "method: not stated (a TrainingArguments file does not say whether the script adds LoRA; set method)"
        )
    fp16 = reading.switch("fp16")
    bf16 = reading.switch("bf16", default=is_trl and not fp16)  # sft_config.py: bf16 True unless fp16 is set
    _set_hf_mixed_precision(reading, bf16=bf16, fp16=fp16)
    dtype = _trl_model_dtype(reading)
    if reading.values["autocast"] is False and dtype in TORCH_DTYPES:
        reading.values["precision"] = TORCH_DTYPES[dtype]  # no autocast: the step runs in the model's dtype
    if (attention := reading.get("attn_implementation")) is not None:
        _set_hf_attention(reading, "attn_implementation", attention)
    _set_hf_optimizer(reading, "optim", reading.get("optim", "adamw"))  # training_args.py: an AdamW
    if reading.switch("use_liger_kernel"):  # training_args.py; SFTTrainer keeps its own fused head
        reading.values["liger"] = True
    if (loss := reading.get("loss_type")) is not None:
        if not _one_of(loss, TRL_LOSSES):
            raise _Unmappable(f"loss_type {_shown(loss)}: lorafit estimates {', '.join(TRL_LOSSES)}")
        reading.values["loss"] = TRL_LOSSES[loss]
    _set_deepspeed(reading, "deepspeed")
    if _is_on(reading.get("fsdp")):
        _set_fsdp(reading, reading.get("fsdp"), reading.get("fsdp_config"))
    reading.note_switched_on(TRL_UNMODELLED)
    # packing and padding_free fill each row to max_length: what lorafit estimates at seq_len anyway


def _trl_sequence_length(reading: _Reading, is_trl: bool) -> None:
    for key in TRL_SEQUENCE_KEYS:
        if reading.has(key):  # stated, even as null (no truncation: the data's longest row)
            if (length := reading.get(key)) is not None:
                reading.values["seq_len"] = length
            return
    if is_trl:
        reading.values["seq_len"] = 1024  # sft_config.py: max_length = 1024


def _trl_method(reading: _Reading) -> None:
    if not reading.switch("use_peft"):  # model_config.py: use_peft = False, a full fine-tune
        _set_method(reading, adapters=False, quant="none")
        return
    four_bit = reading.switch("load_in_4bit")
    _set_method(reading, adapters=True, quant=_quant_of_switches(reading, "load_in_4bit" if four_bit else ""))
    reading.copy(TRL_LORA_SAME)
    targets = _lora_targets(reading, "lora_target_modules", reading.get("lora_target_modules", ["q_proj", "v_proj"]))
    if targets:
        reading.values["lora_targets"] = targets
    if four_bit:
        reading.values["double_quant"] = reading.switch("use_bnb_nested_quant")  # model_config.py
        if reading.get("bnb_4bit_quant_type") == "fp4":
            reading.note("bnb_4bit_quant_type", "fp4", "estimated as nf4: the same 4 bits a weight")


def _trl_model_dtype(reading: _Reading) -> str | None:
    """The dtype the model loads in (`auto`: the one its config.json names); another name is refused."""
    for key in ("dtype", "torch_dtype", "model_init_kwargs.dtype", "model_init_kwargs.torch_dtype"):
        if (dtype := reading.get(key)) is not None:
            if not _one_of(dtype, (*TORCH_DTYPES, "auto")):
                raise _Unmappable(f"{key} {_shown(dtype)}: use one of {', '.join(TORCH_DTYPES)} or auto")
            return str(dtype)
    return None


# --- torchtune -------------------------------------------------------------------------------------------------
# Defaults from torchtune: recipes/lora_finetune_single_device.py enable_activation_checkpointing false (no
# autocast anywhere: the model runs in `dtype`); torchtune/models/llama2/_model_builders.py lora_rank 8,
# lora_alpha 16, lora_dropout 0.0, apply_lora_to_mlp false. QLoRA's base is torchao's NF4, its scales quantised
# too (lorafit's double_quant, already its default).
TORCHTUNE_SAME = {
    "checkpointer.checkpoint_dir": "model",
    "batch_size": "micro_batch",
    "gradient_accumulation_steps": "grad_accum",
    "tokenizer.max_seq_len": "seq_len",
    "epochs": "epochs",
    "enable_activation_offloading": "offload_activations",
}
TORCHTUNE_LORA_SAME = {
    "model.lora_rank": "lora_r",
    "model.lora_alpha": "lora_alpha",
    "model.lora_dropout": "lora_dropout",
}
TORCHTUNE_DTYPES = {"bf16": "bf16", "fp32": "fp32", "fp16": "fp16"}
# optimizer `_component_` -> (lorafit optimizer, whether `fused:` applies)
TORCHTUNE_OPTIMIZERS = {
    "torch.optim.AdamW": ("adamw", True),
    "torch.optim.Adam": ("adamw", True),
    "torch.optim.SGD": ("sgd", False),
    "bitsandbytes.optim.AdamW8bit": ("adamw_8bit", False),
    "bitsandbytes.optim.PagedAdamW8bit": ("paged_adamw_8bit", False),
    "bitsandbytes.optim.PagedAdamW": ("paged_adamw_32bit", False),
    "bitsandbytes.optim.PagedAdamW32bit": ("paged_adamw_32bit", False),
    "torchao.optim.AdamW8bit": ("adamw_8bit", False),
    "torchao.prototype.low_bit_optim.AdamW8bit": ("adamw_8bit", False),
}
TORCHTUNE_LOSSES = {
    "torchtune.modules.loss.CEWithChunkedOutputLoss": "chunked",
    "torchtune.modules.loss.LinearCrossEntropyLoss": "chunked",
    "torch.nn.CrossEntropyLoss": "full",
}
TORCHTUNE_FSDP_KEYS = ("fsdp_cpu_offload", "fsdp_reshard_after_forward", "custom_sharded_layers")
TORCHTUNE_UNMODELLED = {
    "compile": "torch.compile changes what is kept for backward; not modelled",
    "optimizer_in_bwd": "stepping the optimizer inside backward (no whole-model gradients) is not modelled",
    "model.use_dora": "DoRA's magnitude vectors and extra activations are not modelled",
    "model.apply_lora_to_output": "LoRA on the LM head is not modelled",
}


def _read_torchtune(reading: _Reading) -> None:
    """torchtune: the model builder's name makes the method (qlora_..., lora_..., else full)."""
    reading.copy(TORCHTUNE_SAME)
    builder = str(reading.get("model._component_", "")).rsplit(".", 1)[-1]
    if builder.startswith(("qlora_", "lora_")):
        quantized = builder.startswith("qlora_") or reading.switch("model.quantize_base")
        _set_method(reading, adapters=True, quant="nf4" if quantized else "none")
        reading.copy(TORCHTUNE_LORA_SAME)
        reading.values.setdefault("lora_r", 8)  # _model_builders.py: lora_rank = 8
        reading.values.setdefault("lora_dropout", 0.0)  # _model_builders.py: lora_dropout = 0.0
        _torchtune_targets(reading)
    else:
        _set_method(reading, adapters=False, quant="none")
    reading.values["grad_ckpt"] = reading.switch("enable_activation_checkpointing")
    reading.values["autocast"] = False
    if (dtype := reading.get("dtype")) is not None:
        if not _one_of(dtype, TORCHTUNE_DTYPES):
            raise _Unmappable(f"dtype {_shown(dtype)}: use one of {', '.join(TORCHTUNE_DTYPES)}")
        reading.values["precision"] = TORCHTUNE_DTYPES[dtype]
    _torchtune_optimizer(reading)
    if (loss := reading.get("loss._component_")) is not None:
        if not _one_of(loss, TORCHTUNE_LOSSES):
            raise _Unmappable(f"loss {_shown(loss)}: lorafit estimates {', '.join(TORCHTUNE_LOSSES)}")
        reading.values["loss"] = TORCHTUNE_LOSSES[loss]
    if any(reading.has(key) for key in TORCHTUNE_FSDP_KEYS):  # a config of a distributed recipe
        reading.values["shard"] = "fsdp"
        if reading.switch("fsdp_cpu_offload"):
            reading.values["offload"] = "params"
    reading.note_switched_on(TORCHTUNE_UNMODELLED)


def _torchtune_targets(reading: _Reading) -> None:
    modules = _as_names(reading.get("model.lora_attn_modules", []))
    if reading.switch("model.apply_lora_to_mlp"):
        modules += ["w1", "w2", "w3"]
    if modules and (targets := _lora_targets(reading, "model.lora_attn_modules", modules)):
        reading.values["lora_targets"] = targets


def _torchtune_optimizer(reading: _Reading) -> None:
    component = reading.get("optimizer._component_")
    if component is None:
        return
    if not _one_of(component, TORCHTUNE_OPTIMIZERS):
        raise _Unmappable(f"optimizer {_shown(component)}: lorafit estimates {', '.join(TORCHTUNE_OPTIMIZERS)}")
    optimizer, fusable = TORCHTUNE_OPTIMIZERS[component]
    reading.values["optimizer"] = optimizer
    if fusable:
        reading.values["fused_optimizer"] = reading.switch("optimizer.fused")  # torch's foreach step


# --- litgpt ----------------------------------------------------------------------------------------------------
# Defaults from litgpt/finetune/lora.py setup(): lora_r 8, lora_alpha 16, lora_dropout 0.05 (lorafit's own),
# lora_query and lora_value on, lora_key, lora_projection, lora_mlp and lora_head off; devices 1; optimizer
# "AdamW". One device trains without activation checkpointing; several shard with FSDPStrategy(
# activation_checkpointing_policy={Block}). Under a bitsandbytes `quantize`, litgpt/utils.py
# instantiate_bnb_optimizer swaps the AdamW for bitsandbytes' PagedAdamW (32-bit states).
LITGPT_SAME = {
    "train.micro_batch_size": "micro_batch",
    "train.max_seq_length": "seq_len",
    "train.epochs": "epochs",
    "num_nodes": "nodes",
}
LITGPT_LORA_SAME = {"lora_r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout"}
# Lightning's precision -> (lorafit precision, autocast); "bf16", "16" and "32" are Lightning's short names
LITGPT_PRECISIONS = {
    "bf16-true": ("bf16", False),
    "bf16-mixed": ("bf16", True),
    "bf16": ("bf16", True),
    "16-true": ("fp16", False),
    "16-mixed": ("fp16", True),
    "16": ("fp16", True),
    "32-true": ("fp32", False),
    "32": ("fp32", False),
}
# quantize -> (quant, double_quant)
LITGPT_QUANTIZE = {
    "bnb.nf4": ("nf4", False),
    "bnb.nf4-dq": ("nf4", True),
    "bnb.fp4": ("nf4", False),
    "bnb.fp4-dq": ("nf4", True),
    "bnb.int8": ("int8", None),
    "bnb.int8-training": ("int8", None),
}
# the projections of each LoRA switch, and its default in setup()
LITGPT_LORA_SWITCHES: dict[str, tuple[tuple[str, ...], bool]] = {
    "lora_query": (("q",), True),
    "lora_key": (("k",), False),
    "lora_value": (("v",), True),
    "lora_projection": (("o",), False),
    "lora_mlp": (("gate", "up", "down"), False),
}
LITGPT_LORA_KEYS = {*LITGPT_LORA_SAME, *LITGPT_LORA_SWITCHES, "lora_head"}
LITGPT_OPTIMIZERS = {"AdamW": "adamw", "Adam": "adamw", "SGD": "sgd"}


def _read_litgpt(reading: _Reading) -> None:
    """litgpt finetune: LoRA keys make it `finetune lora` (else `finetune full`); `quantize` makes it QLoRA."""
    reading.copy(LITGPT_SAME)
    if (checkpoint := reading.get("checkpoint_dir")) is not None:
        # litgpt downloads a hub id to checkpoints/<id> (litgpt/utils.py extend_checkpoint_dir): the id names it
        reading.values["model"] = str(checkpoint).removeprefix("checkpoints/")
    quant, double_quant = _litgpt_quant(reading)
    adapters = bool(LITGPT_LORA_KEYS & set(reading.config)) or quant != "none"
    _set_method(reading, adapters=adapters, quant=quant)
    if adapters:
        reading.copy(LITGPT_LORA_SAME)
        reading.values.setdefault("lora_r", 8)  # setup(): lora_r = 8
        _litgpt_targets(reading)
    if double_quant is not None:
        reading.values["double_quant"] = double_quant
    if (precision := reading.get("precision")) is not None:
        if str(precision) not in LITGPT_PRECISIONS:
            raise _Unmappable(f"precision {_shown(precision)}: use one of {', '.join(LITGPT_PRECISIONS)}")
        reading.values["precision"], reading.values["autocast"] = LITGPT_PRECISIONS[str(precision)]
    _litgpt_devices(reading)
    if (global_batch := _whole_number(reading, "train.global_batch_size")) is not None:
        reading.values["batch_size"] = global_batch // (_whole_number(reading, "num_nodes") or 1)  # lorafit's: a node
    _litgpt_optimizer(reading, quantized=quant != "none")
    if reading.switch("lora_head"):
        reading.note("lora_head", True, "LoRA on the LM head is not modelled")


def _whole_number(reading: _Reading, key: str) -> int | None:
    value = reading.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise _Unmappable(f"{key} {_shown(value)}: must be a whole number")
    return value


def _litgpt_quant(reading: _Reading) -> tuple[str, bool | None]:
    quantize = reading.get("quantize")
    if quantize is None:
        return "none", None
    if not _one_of(quantize, LITGPT_QUANTIZE):
        raise _Unmappable(f"quantize {_shown(quantize)}: lorafit estimates {', '.join(LITGPT_QUANTIZE)}")
    if "fp4" in quantize:
        reading.note("quantize", quantize, "estimated as nf4: the same 4 bits a weight")
    return LITGPT_QUANTIZE[quantize]


def _litgpt_targets(reading: _Reading) -> None:
    projections: set[str] = set()
    switched_on = []
    for key, (switch_projections, default) in LITGPT_LORA_SWITCHES.items():
        if reading.switch(key, default):
            projections.update(switch_projections)
            switched_on.append(key)
    if targets := _targets_covering(reading, ", ".join(switched_on), projections, True):
        reading.values["lora_targets"] = targets


def _litgpt_devices(reading: _Reading) -> None:
    devices = reading.get("devices", 1)  # setup(): devices = 1
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    if not isinstance(devices, int) or devices < 1:
        reading.note("devices", devices, "the number of GPUs is not stated; set n_gpus")
        return
    reading.values["n_gpus"] = devices
    reading.values["grad_ckpt"] = devices > 1  # FSDPStrategy(activation_checkpointing_policy={Block})
    if devices > 1:
        reading.values["shard"] = "fsdp"


def _litgpt_optimizer(reading: _Reading, *, quantized: bool) -> None:
    optimizer = reading.get("optimizer", "AdamW")  # setup(): optimizer = "AdamW"
    class_path = optimizer.get("class_path", "") if isinstance(optimizer, Mapping) else str(optimizer)
    name = str(class_path).rsplit(".", 1)[-1]
    if quantized:  # utils.py instantiate_bnb_optimizer: only AdamW, as bitsandbytes' PagedAdamW
        if "AdamW" not in name:
            raise _Unmappable(f"optimizer {_shown(class_path)}: litgpt trains a quantised model with AdamW only")
        reading.values["optimizer"] = "paged_adamw_32bit"
        return
    if name not in LITGPT_OPTIMIZERS:
        raise _Unmappable(f"optimizer {_shown(class_path)}: lorafit estimates {', '.join(LITGPT_OPTIMIZERS)}")
    reading.values["optimizer"] = LITGPT_OPTIMIZERS[name]
    if reading.values["optimizer"] == "adamw":
        reading.section("optimizer.init_args")
        reading.values["fused_optimizer"] = reading.switch("optimizer.init_args.fused")


# --- lorafit ---------------------------------------------------------------------------------------------------
def _read_lorafit(reading: _Reading) -> None:
    """lorafit's own train YAML: its keys are already lorafit's names (the caller validates the values). A key
    that is none of them is refused here, as `lorafit train` refuses it, rather than left out by the command."""
    known = [option.name for option in options.OPTIONS if option.config]
    for key, value in reading.config.items():
        if key not in known:
            raise _Unmappable(options.unknown_key(key, known))
        reading.values[key] = _number_checked(key, key, value)


READERS: dict[str, Callable[[_Reading], None]] = {
    "axolotl": _read_axolotl,
    "llama-factory": _read_llama_factory,
    "trl": _read_trl,
    "torchtune": _read_torchtune,
    "litgpt": _read_litgpt,
    "lorafit": _read_lorafit,
}
