"""Every setting of lorafit, declared once: its type, choices, default, unit, help and the rules that tie it to
the others.

The settings are the typed fields of three classes: `Inputs` (what to fine-tune, on what) and `Settings` (the
knobs of one training step) below, and `RunOptions` (lorafit.run_options: the whole job, data, schedule, chat,
export, serve and the command switches). Each field is declared once, with its bounds (`Field`) and what people
are told about it (`About`, lorafit.declaration). Everything else is derived from those fields: the table
`OPTIONS` (one `Option` row per field), the `estimate`, `plan`, `train` and `chat` command-line options
(`lorafit.cli.derived_options`), the `train` config file and its commented starter (`TrainConfig`,
`starter_yaml`), the web form (`as_dicts`), and the validation of all of them (`validate`), so that a
combination is accepted or refused the same way, with the same one-line message, from flags, from a YAML file
and from the page. Pure Python: no torch here.

`None` as a value means "not set": the command then uses the default, or, where `auto` says so, decides (the
planner searches micro-batch, accumulation, checkpointing and the optimizer; some defaults follow from the model,
the GPU or other settings, see `step_defaults`).
"""

from __future__ import annotations

import difflib
import math
import textwrap
from collections.abc import Callable, Iterable, Mapping
from functools import cache
from typing import TYPE_CHECKING, Annotated, Any, TypeVar, cast

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, create_model, model_validator
from pydantic_core import ErrorDetails

from lorafit import stacks
from lorafit.choices import (  # noqa: F401 (the choices are part of the declaration)
    SAVER_ON,
    Attention,
    Batching,
    Command,
    DataFormat,
    ExportTarget,
    Frozen,
    GgufType,
    Loss,
    Method,
    Offload,
    Optimizer,
    Precision,
    Quant,
    Scheduler,
    Shard,
    Stack,
    default_quant,
)
from lorafit.declaration import (
    ESTIMATE_PLAN_TRAIN,
    About,
    Option,
    RuledModel,
    batch_size_of,
    option_rows,
)
from lorafit.errors import InvalidConfig
from lorafit.hardware import MAX_VRAM_GB, GpuSpec
from lorafit.messages import say
from lorafit.model_spec import LoraTargets, ModelSpec
from lorafit.run_options import RunOptions


class Inputs:
    """What to fine-tune, on what: the first settings of the table."""

    model: Annotated[
        str | None,
        About(
            "catalog preset or hub id (see `lorafit models`), or a local model directory or config.json; `train` "
            "needs a local directory (config.json + safetensors)",
            ESTIMATE_PLAN_TRAIN,
            "model",
            auto="llama-2-7b for estimate and plan; train needs one",
            flags=("-m",),
        ),
    ] = None
    gpu: Annotated[
        str | None,
        About(
            "catalog GPU (see `lorafit gpus`)", ("estimate", "plan"), "model", auto="the detected GPU", flags=("-g",)
        ),
    ] = None
    vram: Annotated[
        float | None,
        Field(gt=0, le=MAX_VRAM_GB),
        About(
            "a GPU known only by its memory, as sold: a '24 GB' card has 24 GiB (nvidia-smi shows about that)",
            ("estimate", "plan"),
            "model",
            unit="GB as sold",
        ),
    ] = None
    tokenizer: Annotated[
        str | None,
        About(
            "local tokenizer directory to count the tokens of --data", ("plan",), "model", auto="a character estimate"
        ),
    ] = None
    data: Annotated[
        str | None,
        About(
            "dataset file or directory (JSONL, JSON, CSV, Parquet, text): plan counts its tokens, train trains on it",
            ("plan", "train"),
            "model",
        ),
    ] = None
    headroom: Annotated[
        float, Field(ge=0, lt=1), About("share of the GPU's memory kept free", ESTIMATE_PLAN_TRAIN, "model")
    ] = 0.1


class Settings(RuledModel):
    """Every knob of one training step. memory.estimate() and the trainer read the same object. Each field is
    the declaration of its setting; quant and lora_alpha follow from method and rank when not set."""

    method: Annotated[
        Method,
        About("qlora: 4-bit base + LoRA; lora: 16-bit base + LoRA; full: every weight", ESTIMATE_PLAN_TRAIN, "step"),
    ] = "qlora"
    precision: Annotated[
        Precision,
        About(
            "compute dtype",
            ESTIMATE_PLAN_TRAIN,
            "step",
            auto="bf16; fp16 on a GPU without bf16; fp32 when training on the CPU",
        ),
    ] = "bf16"
    quant: Annotated[
        Quant | None,
        About(
            "base-weight quantisation: qlora needs nf4 or int8, lora and full none",
            ESTIMATE_PLAN_TRAIN,
            "step",
            auto="nf4 for qlora, else none",
        ),
    ] = None
    double_quant: Annotated[
        bool, About("quantise the 4-bit scales too (saves ~0.4 bit per weight)", ESTIMATE_PLAN_TRAIN, "step")
    ] = True
    lora_r: Annotated[int, Field(gt=0, le=4096), About("LoRA adapter rank", ESTIMATE_PLAN_TRAIN, "step")] = 16
    lora_alpha: Annotated[
        int | None,
        Field(gt=0),
        About("LoRA scale: alpha / r multiplies the update", ESTIMATE_PLAN_TRAIN, "step", auto="2 x lora_r"),
    ] = None
    lora_dropout: Annotated[
        float, Field(ge=0, lt=1), About("dropout on the adapter input", ESTIMATE_PLAN_TRAIN, "step")
    ] = 0.05
    lora_targets: Annotated[
        LoraTargets,
        About(
            "which layers get adapters (experts: an MoE's attention and experts, with lora_dropout 0)",
            ESTIMATE_PLAN_TRAIN,
            "step",
        ),
    ] = "all"
    train_embeddings: Annotated[
        bool,
        About(
            "also train the input embeddings and the LM head in full, beside the adapters (peft's modules_to_save): "
            "for new tokens or continued pretraining; lora and qlora only",
            ESTIMATE_PLAN_TRAIN,
            "step",
        ),
    ] = False
    optimizer: Annotated[
        Optimizer,
        About(
            "optimizer (8-bit states are a quarter of 32-bit ones)",
            ESTIMATE_PLAN_TRAIN,
            "step",
            auto="adamw; plan and train: the planner's choice",
        ),
    ] = "adamw"
    micro_batch: Annotated[
        int,
        Field(gt=0, le=65536),
        About(
            "sequences per forward pass", ESTIMATE_PLAN_TRAIN, "step", auto="1; plan and train: the planner's choice"
        ),
    ] = 1
    grad_accum: Annotated[
        int,
        Field(gt=0, le=65536),
        About(
            "micro-batches per optimizer step",
            ESTIMATE_PLAN_TRAIN,
            "step",
            auto="1; plan and train: batch_size / (micro_batch x n_gpus)",
        ),
    ] = 1
    seq_len: Annotated[
        int,
        Field(gt=0, le=1 << 22),
        About(
            "longest sequence in tokens; longer rows are cut",
            ESTIMATE_PLAN_TRAIN,
            "step",
            auto="2048; plan and train: the data's longest row",
        ),
    ] = 2048
    grad_ckpt: Annotated[
        bool,
        About(
            "gradient checkpointing: recompute activations in backward (less memory, about a third more compute)",
            ESTIMATE_PLAN_TRAIN,
            "step",
            auto="on; plan and train: the planner's choice",
        ),
    ] = True
    # memory savers: the same step in less memory, each searched by the planner when not set
    loss: Annotated[
        Loss,
        About(
            "LM head and cross-entropy: full (every token's fp32 logits at once) or chunked (a chunk of tokens at a "
            "time, recomputed in backward: the same loss and gradients in far less memory)",
            ESTIMATE_PLAN_TRAIN,
            "savers",
            auto="full; plan and train: the planner's choice",
        ),
    ] = "full"
    offload_activations: Annotated[
        bool,
        About(
            "keep the checkpointed layer inputs in pinned host memory, copied back for backward (needs grad_ckpt)",
            ESTIMATE_PLAN_TRAIN,
            "savers",
            auto="off; plan and train: the planner's choice",
        ),
    ] = False
    offload_embeddings: Annotated[
        bool,
        About(
            "keep the frozen input embeddings in host memory (not with tied embeddings or full fine-tuning)",
            ESTIMATE_PLAN_TRAIN,
            "savers",
            auto="off; plan and train: the planner's choice",
        ),
    ] = False
    expandable_segments: Annotated[
        bool,
        About(
            "PyTorch's expandable-segments allocator (PYTORCH_CUDA_ALLOC_CONF): less memory stranded between steps",
            ESTIMATE_PLAN_TRAIN,
            "savers",
            auto="off; plan and train: the planner's choice",
        ),
    ] = False
    attn: Annotated[
        Attention,
        About(
            "attention kernel",
            ESTIMATE_PLAN_TRAIN,
            "step",
            auto="sdpa where the model has it, else its own kernel (eager for Gemma-2)",
        ),
    ] = "sdpa"
    # the trainer that runs the step: what it keeps alive (see `lorafit stacks`)
    stack: Annotated[
        Stack,
        About(
            "the trainer that runs the step, at its pinned version (see `lorafit stacks`): lorafit is what `lorafit "
            "train` runs",
            ("estimate", "plan"),
            "stack",
        ),
    ] = "lorafit"
    autocast: Annotated[
        bool | None,
        About(
            "the forward runs under torch.autocast (the HF Trainer's bf16/fp16 switch; a plain loop without it)",
            ("estimate", "plan"),
            "stack",
            auto="the stack's",
        ),
    ] = None
    kbit_prep: Annotated[
        bool | None,
        About(
            "peft's prepare_model_for_kbit_training on the quantised model (embeddings, head and norms to fp32)",
            ("estimate", "plan"),
            "stack",
            auto="the stack's",
        ),
    ] = None
    fp32_adapters: Annotated[
        bool | None,
        About(
            "the LoRA adapters are held in fp32 (peft's autocast_adapter_dtype, its default since 0.12); off: in the "
            "compute dtype, as older peft made them and as a loop that casts the whole model (FSDP without mixed "
            "precision) runs them",
            ("estimate", "plan"),
            "stack",
            auto="the stack's",
        ),
    ] = None
    fused_optimizer: Annotated[
        bool | None,
        About(
            "AdamW steps every parameter in one fused kernel (adamw_torch_fused) instead of the foreach loop",
            ("estimate", "plan"),
            "stack",
            auto="the stack's",
        ),
    ] = None
    torch_compile: Annotated[
        bool | None,
        About(
            "the model runs under torch.compile (TrainingArguments' torch_compile): Inductor fuses the elementwise "
            "ops into fewer kernels; changes the time, not the memory estimate",
            ("estimate", "plan"),
            "stack",
            auto="the stack's",
        ),
    ] = None
    liger: Annotated[
        bool | None,
        About(
            "Liger's Triton kernels patched into the model (TrainingArguments' use_liger_kernel): RMSNorm, SwiGLU "
            "and rotary that save less for backward, and, where the stack lets it, the fused linear cross-entropy "
            "that never makes the logits",
            ("estimate", "plan"),
            "stack",
            auto="the stack's",
        ),
    ] = None
    # several GPUs
    n_gpus: Annotated[int, Field(gt=0, le=4096), About("GPUs to train on, per node", ESTIMATE_PLAN_TRAIN, "gpus")] = 1
    nodes: Annotated[
        int, Field(gt=0, le=1024), About("machines, each with n_gpus GPUs", ESTIMATE_PLAN_TRAIN, "gpus")
    ] = 1
    shard: Annotated[
        Shard,
        About(
            "how several GPUs share the model", ESTIMATE_PLAN_TRAIN, "gpus", auto="none; plan: zero3 for several GPUs"
        ),
    ] = "none"
    offload: Annotated[
        Offload,
        About(
            "with zero2/zero3/fsdp: keep the optimizer states (optimizer) or the parameters too (params) in host "
            "memory",
            ESTIMATE_PLAN_TRAIN,
            "gpus",
        ),
    ] = "none"

    @model_validator(mode="before")
    @classmethod
    def _derived_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            given = {key: value for key, value in data.items() if value is not None}
            return given | step_defaults(given)
        return data

    @classmethod
    def given(cls, values: Mapping[str, Any]) -> Settings:
        """The step of which only `values` are fixed (its `model_fields_set`; None is not set), each value checked
        against its declaration. The defaults that follow from other settings and the rules between them are left
        to the plan that completes the step (a pinned offload, say, before the planner picks its shard)."""
        checked = {
            name: _field_check(name).validate_python(value) for name, value in values.items() if value is not None
        }
        return cls.model_construct(_fields_set=set(checked), **checked)

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.n_gpus

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch * self.seq_len


@cache
def _field_check(name: str) -> TypeAdapter[Any]:
    """The check of one step setting alone: its type and bounds."""
    if name not in Settings.model_fields:
        raise ValueError(f"{name} is not a step setting; those are {', '.join(Settings.model_fields)}")
    field = Settings.model_fields[name]
    return TypeAdapter(
        Annotated[(field.annotation, *field.metadata)],  # type: ignore[arg-type]  # built from the field's own parts
        config=ConfigDict(allow_inf_nan=False, str_min_length=1),
    )


OPTIONS: tuple[Option, ...] = option_rows(Inputs) + option_rows(Settings, step=True) + option_rows(RunOptions)
BY_NAME: dict[str, Option] = {option.name: option for option in OPTIONS}
STEP_KEYS: tuple[str, ...] = tuple(Settings.model_fields)
SEARCHED = ("micro_batch", "grad_accum", "grad_ckpt", "optimizer", *SAVER_ON)  # what the planner chooses when not set
DEFAULT_HEADROOM: float = BY_NAME["headroom"].default
DEFAULT_SEQ_LEN: int = BY_NAME["seq_len"].default


def for_command(command: Command, *, settings_only: bool = False) -> list[Option]:
    return [o for o in OPTIONS if command in o.commands and (o.config or not settings_only)]


def config_keys(command: Command) -> tuple[str, ...]:
    return tuple(o.name for o in for_command(command, settings_only=True))


def not_set_is_none(option: Option) -> bool:
    """In a command's settings a step setting the planner decides (see `auto`) is None until the plan fills it."""
    return option.default is None or (option.step and bool(option.auto))


def declared(name: str) -> Any:
    """The pydantic Field of setting `name` as a command's settings hold it (None where not set), for a model
    that holds the setting beside its own fields (`schema.PlanRequest`)."""
    option = BY_NAME[name]
    return option.field_info(optional=not_set_is_none(option))[1]


def _command_fields(command: Command) -> dict[str, Any]:
    return {o.name: o.field_info(optional=not_set_is_none(o)) for o in for_command(command, settings_only=True)}


# --- defaults that follow from other settings, the model and the GPU ---------------------------------------
def _set(values: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}


def step_defaults(
    values: Mapping[str, Any], spec: ModelSpec | None = None, gpu: GpuSpec | None = None, *, on_cpu: bool = False
) -> dict[str, Any]:
    """The step settings that are not set but follow from what is: quant from the method, lora_alpha from the
    rank, the stack's own defaults, the attention kernel from the model, the precision from the GPU (or the CPU)."""
    filled: dict[str, Any] = {}
    method = values.get("method") or BY_NAME["method"].default
    stored = spec.prequantized if spec is not None else None  # a pre-quantised checkpoint's base is as stored
    if values.get("quant") is None:
        filled["quant"] = (
            stored.quant if stored and method == "qlora" and stored.quant != "fp4" else default_quant(method)
        )
    if stored and values.get("double_quant") is None:
        filled["double_quant"] = stored.double_quant
    if values.get("lora_alpha") is None:
        filled["lora_alpha"] = 2 * (values.get("lora_r") or BY_NAME["lora_r"].default)
    stack = stacks.catalog().get(values.get("stack") or BY_NAME["stack"].default)
    own_attn = stack.family_attn.get(spec.architecture) if stack and spec is not None else None
    if values.get("attn") is None and own_attn:  # e.g. Unsloth's flex attention for gpt-oss
        filled["attn"] = own_attn
    elif values.get("attn") is None and spec is not None and "sdpa" not in spec.attention_implementations:
        filled["attn"] = spec.attention_implementations[0]
    for name, value in (stack.defaults if stack else {}).items():  # e.g. Unsloth's lora_dropout 0
        if values.get(name) is None:
            filled[name] = value
    if values.get("precision") is None:
        if on_cpu:
            filled["precision"] = "fp32"
        elif gpu is not None and not gpu.supports_bf16:
            filled["precision"] = "fp16"
    return filled


def check_against(
    values: Mapping[str, Any], spec: ModelSpec | None = None, gpu: GpuSpec | None = None, *, on_cpu: bool = False
) -> None:
    """The rules that need the model or the device: its positions, its attention kernels, bf16 on the GPU."""
    family = spec.architecture if spec is not None else None
    stacks.check({"stack": BY_NAME["stack"].default, "method": BY_NAME["method"].default} | _set(values), family)
    attn, precision = values.get("attn"), values.get("precision")
    if spec is not None:
        stack = values.get("stack") or BY_NAME["stack"].default
        model_type = spec.vision.family if spec.vision else family  # an image-text model loads as its own type
        stacks.past_positions(stack, values.get("seq_len"), spec.name, spec.max_position_embeddings, model_type)
        if values.get("liger"):
            stacks.check_liger_model(spec.arch.model_types, spec.name)
    if spec is not None and spec.prequantized is not None:
        check_prequantized(values, spec)
    if spec is not None and values.get("offload_embeddings") and spec.tie_word_embeddings:
        raise InvalidConfig(say("error.tied_offload", setting="offload_embeddings", model=spec.name))
    if spec is not None:
        spec.check_lora_targets(values.get("lora_targets"), values.get("lora_dropout"))
    if spec is not None and attn is not None and attn not in spec.attention_implementations:
        choices = " or ".join(spec.attention_implementations)
        said = {"model": spec.name, "architecture": spec.architecture, "choices": choices}
        raise InvalidConfig(say("error.no_attention", setting="attn", attn=attn, **said))
    if precision == "bf16" and gpu is not None and not gpu.supports_bf16 and not on_cpu:
        raise InvalidConfig(say("error.no_bf16", setting="precision", gpu=gpu.name))
    if precision == "fp16" and on_cpu:
        raise InvalidConfig(say("error.fp16_cpu", setting="precision"))
    if attn == "flash" and on_cpu:  # (and training on the CPU is fp32, which flash attention has no kernel for)
        raise InvalidConfig(say("error.flash_cpu", setting="attn"))


def check_prequantized(values: Mapping[str, Any], spec: ModelSpec) -> None:
    """A pre-quantised checkpoint trains only as QLoRA over its base as stored: another method, quant or double
    quantisation would need the 16-bit weights it does not hold."""
    stored = spec.prequantized
    assert stored is not None
    if stored.quant == "fp4":  # read so that an export can merge into it; lorafit trains NF4 or int8 only
        raise InvalidConfig(say("error.prequantized_fp4", model=spec.name))
    wanted = {"method": "qlora", "quant": stored.quant, "double_quant": stored.double_quant}
    for name, value in wanted.items():
        given = values.get(name)
        if given is not None and given != value:
            shown = str(given).lower() if isinstance(given, bool) else _shown(given)
            raise InvalidConfig(stored.refusal(spec.hf_id or spec.name, f"{name} {shown}"))
    if values.get("shard") in PREQUANTIZED_UNSHARDABLE:
        model, base = spec.hf_id or spec.name, stored.base or "model"
        said = {"shard": values["shard"], "model": model, "base": base, "setting_method": "--method"}
        raise InvalidConfig(say("error.prequantized_shard", setting="shard", **said))


# ZeRO-3 and FSDP shard the weights themselves: the 4-bit storage must then be the compute dtype, which
# transformers sets only when it quantises the base itself (a stored checkpoint keeps its uint8 storage).
PREQUANTIZED_UNSHARDABLE = ("zero3", "fsdp")


def resolve_batching(batching: Batching, attn: str) -> Batching:
    """auto: padding-free batches with flash attention (its kernels take packed rows exactly), else rows of
    similar length together, so that padding to the longest in a batch wastes little compute."""
    if batching != "auto":
        return batching
    return "padding_free" if attn == "flash" else "length_grouped"


M = TypeVar("M", bound=BaseModel)


def with_settings_of(command: Command) -> Callable[[type[M]], type[M]]:
    """Give a model class a field for every setting of `command` (None where not set), from the declaration."""

    def build(base: type[M]) -> type[M]:
        model = create_model(
            base.__name__, __base__=base, __module__=base.__module__, __doc__=base.__doc__, **_command_fields(command)
        )
        return cast(type[M], model)

    return build


@with_settings_of("train")
class TrainConfig(RuledModel):
    """What `lorafit train` runs: the keys of its YAML file and, with dashes, its flags; a field for every train
    setting of the declaration (`for_command("train")`). A step setting left out (None) comes from `lorafit
    plan` for this machine."""

    if TYPE_CHECKING:  # the fields are the train settings, added from the declaration by the decorator

        def __getattr__(self, name: str) -> Any: ...

    def pinned_settings(self) -> dict[str, Any]:
        """The Settings fields this config fixes; the plan fills the others."""
        return {
            key: getattr(self, key)
            for key in STEP_KEYS
            if key in type(self).model_fields and getattr(self, key) is not None
        }

    @property
    def effective_batch_size(self) -> int:
        return batch_size_of(self.__dict__)

    def fingerprint(self) -> dict[str, Any]:
        """What makes two runs the same run: everything but where it writes, how often it reports, and safety."""
        ignored = {o.name for o in OPTIONS if o.group in ("checkpoints", "safety")} | {"output_dir", "headroom"}
        values = self.model_dump(mode="json") | {"batch_size": self.effective_batch_size}  # 8 set = 4 x 2 set
        return {key: value for key, value in values.items() if key not in ignored}


def _train_fields() -> list[Option]:
    return for_command("train", settings_only=True)


@cache
def command_model(command: Command) -> type[BaseModel]:
    """The flat model of one command's settings, None where not set: what `validate` checks values with."""
    if command == "train":
        return TrainConfig
    return create_model(f"{command.title()}Options", __base__=RuledModel, **_command_fields(command))


# --- validation with one-line messages ----------------------------------------------------------------------
def _problem(error: ErrorDetails, option: Option | None) -> str:
    """A pydantic error in the words of the setting: what it must be."""
    kind, context = error["type"], error.get("ctx") or {}
    if kind == "literal_error" and option is not None:
        return say("problem.one_of", choices=", ".join(option.choices))
    limits = {
        "greater_than": "problem.greater_than",
        "greater_than_equal": "problem.at_least",
        "less_than": "problem.less_than",
        "less_than_equal": "problem.at_most",
    }
    if kind in limits:
        limit = next(iter(context.values()))
        return say(limits[kind], limit=f"{limit:g}" if isinstance(limit, float) else limit)
    phrases = {
        "int_parsing": "problem.whole_number",
        "int_from_float": "problem.whole_number",
        "int_type": "problem.whole_number",
        "float_parsing": "problem.number",
        "float_type": "problem.number",
        "finite_number": "problem.finite_number",
        "bool_parsing": "problem.true_or_false",
        "bool_type": "problem.true_or_false",
        "string_too_short": "problem.not_empty",
        "string_type": "problem.text",
        "dict_type": "problem.mapping",
    }
    return say(phrases[kind]) if kind in phrases else error["msg"].removeprefix("Value error, ")


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return repr(value) if value == "" or " " in value else value
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:g}"
    return str(value)


def one_line(error: ValidationError, source: str = "", from_flags: Iterable[str] = ()) -> str:
    """The first problem of a validation error, naming the setting and its value: 'lora_r -1: must be ...',
    after the file it came from (`source`) unless it came from a flag."""
    problem = error.errors()[0]
    name = str(problem["loc"][0]) if problem["loc"] else ""
    where = f"{source}: " if source and name not in from_flags else ""
    if problem["type"] == "extra_forbidden":
        return where + unknown_key(name)
    option = BY_NAME.get(name)
    if not name:  # a rule over several settings: its message names them
        return where + problem["msg"].removeprefix("Value error, ")
    spelled = option.flag if option is not None and name in from_flags else ".".join(map(str, problem["loc"]))
    return where + say(
        "error.setting", setting=spelled, value=_shown(problem.get("input")), problem=_problem(problem, option)
    )


def unknown_key(key: str, known: Iterable[str] | None = None) -> str:
    known = list(known) if known is not None else [o.name for o in OPTIONS if o.config]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return (
        say("error.unknown_key", key=key, setting_close=close[0]) if close else say("error.unknown_key_init", key=key)
    )


def parse_mapping(text: str) -> dict[str, str]:
    """'instruction=question,output=answer' -> {'instruction': 'question', 'output': 'answer'}."""
    mapping = {}
    for pair in text.split(","):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise InvalidConfig(f"data_mapping {text!r}: expected FIELD=COLUMN[,FIELD=COLUMN...]")
        mapping[key.strip()] = value.strip()
    return mapping


def validate(command: Command, values: Mapping[str, Any], source: str = "", from_flags: Iterable[str] = ()) -> Any:
    """Check the settings of `command` with every declared type, bound and rule; one line naming the setting and
    its value when something is wrong. `source` names the file the values came from, except `from_flags`."""
    known = config_keys(command)
    if command == "train" and values.get("stack") not in (None, "lorafit"):
        stack = stacks.resolve(values["stack"])
        instead = stack.estimate_only or f"run it with {stack.title}, or drop stack for lorafit's own trainer"
        raise InvalidConfig(
            f"stack {stack.name}: lorafit plans and estimates it only, lorafit train runs its own trainer; {instead}"
        )
    for key in values:
        if key not in known:
            where = f"{source}: " if source and key not in from_flags else ""
            raise InvalidConfig(where + unknown_key(key, known))
    data = dict(values)
    if isinstance(data.get("data_mapping"), str):
        data["data_mapping"] = parse_mapping(data["data_mapping"])
    model = command_model(command)
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise InvalidConfig(one_line(error, source, from_flags)) from None


def settings_from(
    values: Mapping[str, Any], spec: ModelSpec | None = None, gpu: GpuSpec | None = None, *, on_cpu: bool = False
) -> Any:
    """A Settings from set values, the defaults that follow from the model and the GPU filled in, checked."""
    given = {key: value for key, value in values.items() if key in STEP_KEYS and value is not None}
    resolved = given | step_defaults(given, spec, gpu, on_cpu=on_cpu)
    try:
        settings = Settings(**resolved)
    except ValidationError as error:
        raise InvalidConfig(one_line(error)) from None
    check_against(settings.model_dump(), spec, gpu, on_cpu=on_cpu)
    return settings


# --- the train config file ----------------------------------------------------------------------------------
GROUP_TITLES = {
    "model": "what to train on",
    "step": "method and memory settings (~ = from the plan for this machine)",
    "savers": "memory savers: the same step in less memory (~ = the planner's choice)",
    "job": "the whole job",
    "data": "data",
    "schedule": "schedule",
    "loss": "loss and batching",
    "checkpoints": "logging, evaluation, checkpoints",
    "safety": "safety",
    "serve": "the web page",
}


def _yaml_value(value: Any) -> str:
    if value is None:
        return "~"
    if isinstance(value, dict):
        return "{}" if not value else yaml.safe_dump(value, default_flow_style=True).strip()
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()


def starter_yaml(name: str) -> str:
    """The commented starter config of `lorafit init`: every key of TrainConfig, its default and its help."""
    lines = [
        f"# lorafit train config. Run it with:  lorafit train {name}",
        "# Every key can also be given as a flag (--output-dir, --lora-r, ...), which wins over the file.",
        "# Keys left empty (~) are filled by `lorafit plan` for the GPU this machine has; the run prints them.",
        "# `lorafit train " + name + " --dry-run` shows what it would run without writing anything.",
    ]
    defaults = TrainConfig()
    group = None
    for option in _train_fields():
        if option.group != group:
            group = option.group
            title = f"# --- {GROUP_TITLES.get(group, group)} "
            lines += ["", title + "-" * max(3, 118 - len(title))]
        value = _yaml_value(getattr(defaults, option.name))
        comment = option.help + (f"; {' | '.join(option.choices)}" if option.choices else "")
        if value == "~" and option.auto:
            comment += f" (~: {option.auto})"
        lines += _commented(f"{option.name}: {value}", comment)
    return "\n".join(lines) + "\n"


def _commented(entry: str, comment: str, column: int = 28, width: int = 118) -> list[str]:
    """`entry  # comment`, the comment wrapped onto indented comment lines."""
    pieces = textwrap.wrap(comment, width - column - 2) or [""]
    first = f"{entry:<{column - 1}} # {pieces[0]}"
    return [first] + [f"{'':<{column - 1}} # {piece}" for piece in pieces[1:]]


def as_dicts() -> list[dict[str, Any]]:
    """The table as plain data (for a form or the docs): name, flag, type, choices, default, help, commands."""
    rows = []
    for o in OPTIONS:
        kind = "choice" if o.choices else getattr(o.type, "__name__", str(o.type))
        rows.append(
            {
                "name": o.name,
                "flag": o.flag,
                "type": kind,
                "choices": list(o.choices),
                "default": o.default,
                "default_text": o.describe_default(),
                "help": o.help,
                "unit": o.unit,
                "group": o.group,
                "commands": list(o.commands),
                "step": o.step,
                "config": o.config,
                "bounds": {k: getattr(o, k) for k in ("gt", "ge", "lt", "le") if getattr(o, k) is not None},
            }
        )
    return rows
