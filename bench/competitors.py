"""Adapters that run the other memory calculators on a benchmark row, offline, through their Python APIs.

Each adapter takes the row's model shape and settings (a `Query`) and returns the calculator's own headline figure
for training memory, in bytes, as a user of that tool would read it. A calculator that has no figure for the row
(full fine-tuning only, single GPU only, ...) raises `NotApplicable` with the reason; one that is not installed
is reported by `available()` with the import error. They are installed by the `bench` extra of pyproject.toml.

What each figure is (read from the installed source of each package):
- accelerate (`accelerate estimate-memory`): its CLI fetches the model from the Hub (`verify_on_hub`), so the
  adapter does what its transformers branch does, offline: `AutoModel.from_config` on the meta device from a
  config.json written to a temp dir, `calculate_maximum_sizes`, then `estimate_training_usage` - the "Training
  using Adam" column (max of model / gradients / optimizer / step; 8 bytes per parameter for bf16 and fp16, 16
  for fp32). It has no figure for LoRA or 4/8-bit training: for those rows the adapter reports its "Total Size"
  (load size) at the row's dtype, the only number the tool prints for them.
- canifinetune (`canifinetune.estimator.memory.estimate`, offline with `override` and `use_network=False`):
  `total_estimated_gb` minus `safety_margin_gb`, i.e. its prediction of its stated measurement target ("process
  torch peak reserved", safety margin reported separately). GiB. Single GPU only.
- fitscout (`fitscout.memory.estimator.estimate_memory`): `total_gb` (GiB). LoRA on q and v only; single GPU.
- ftuneai (`ftuneai.core.memory.MemoryEstimator`): `total_gb` (GiB), with its ZeRO/FSDP sharding factors.
- hf-vram-calc (`hf_vram_calc.calculator`): "Training (Adam)" for full fine-tuning, the "LoRA" column at the
  weights' dtype (int4/int8 for QLoRA) otherwise (GiB); it counts parameters by building the model on meta.
  No sharding model, so single GPU only.
- gpu-estimator (`gpu_estimator.estimator.GPUEstimator.estimate`): `total_memory_gb` (GiB); full fine-tuning
  only (it has no notion of adapters or quantised weights), single GPU.
"""

from __future__ import annotations

import importlib
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from lorafit.models import ModelSpec
from lorafit.schema import Settings

GIB = 2**30

# Calculators looked at and not run, with the reason (shown in the benchmark output).
NOT_RUN = {
    "cfit": "inference only (weights x precision bytes), and it reads the model size from the Hub's safetensors "
    "metadata (get_safetensors_metadata): needs the network",
    "alloc": "its `ghost` scan is full-training only (weights + grads + Adam + one activation per layer, from the "
    "parameter count); the same class as gpu-estimator, which is run",
}


class NotApplicable(Exception):
    """The calculator has no figure for this row (its reason is the message)."""


@dataclass(frozen=True)
class Query:
    spec: ModelSpec
    settings: Settings
    gpu_gib: float  # capacity of the row's GPU, for tools that size overheads from it


@dataclass(frozen=True)
class Competitor:
    name: str
    module: str  # the import that must succeed for it to run
    predict: Callable[[Query], float]  # bytes


# --- accelerate -----------------------------------------------------------------------------------------------
@cache
def _meta_model_fp32_bytes(spec: ModelSpec, causal_lm: bool) -> int:
    """Size in fp32 of the model built on the meta device from a local config.json (no download)."""
    import torch
    from accelerate import init_empty_weights
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(spec.to_hf_config()))
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    constructor = AutoModelForCausalLM if causal_lm else AutoModel
    with init_empty_weights():
        model = constructor.from_config(config, dtype=torch.float32)
    total_size, _ = calculate_maximum_sizes(model)
    return int(total_size)


def accelerate_estimate(query: Query) -> float:
    from accelerate.commands.estimate import estimate_training_usage

    # `create_empty_model` uses AutoModel (no LM head) for configs without an auto_map, as the Hub's Llama,
    # Mistral, Gemma and Mixtral configs are.
    fp32_bytes = _meta_model_fp32_bytes(query.spec, causal_lm=False)
    settings = query.settings
    if settings.n_gpus > 1:
        raise NotApplicable("single-device figures only")
    if settings.method == "full":
        dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[settings.precision]
        return float(max(estimate_training_usage(fp32_bytes, dtype).values()))
    # LoRA / QLoRA: the tool prints no training figure; "Total Size" at the load dtype is what it shows.
    divisor = {"none": 2 if settings.precision != "fp32" else 1, "int8": 4, "nf4": 8}[settings.quant]
    return fp32_bytes / divisor


# --- canifinetune ---------------------------------------------------------------------------------------------
CANIFINETUNE_SCOPE = {"qv": "conservative", "attn": "attention", "all": "all_linear"}
CANIFINETUNE_OPTIMIZER = {
    "adamw": "adamw_torch",
    "adamw_8bit": "adamw_8bit",
    "paged_adamw_8bit": "paged_adamw_8bit",
    "paged_adamw_32bit": "adamw_torch",  # nearest it offers: 32-bit AdamW states
    "sgd": "sgd",
}


def _family(spec: ModelSpec) -> str:
    return {"gemma2": "gemma", "qwen3": "qwen2"}.get(spec.architecture, spec.architecture)


def canifinetune_estimate(query: Query) -> float:
    from canifinetune.estimator.memory import EstimateRequest, estimate

    spec, settings = query.spec, query.settings
    if settings.n_gpus > 1:
        raise NotApplicable("single GPU only")
    quantization = {"nf4": "nf4_double_quant" if settings.double_quant else "nf4", "int8": "int8"}
    request = EstimateRequest(
        model_id=f"lorafit-bench/{spec.name}",
        method=settings.method,
        seq_len=settings.seq_len,
        micro_batch_size=settings.micro_batch,
        gradient_accumulation_steps=settings.grad_accum,
        base_dtype=settings.precision,
        quantization=quantization.get(settings.quant, "nf4_double_quant"),
        lora_rank=settings.lora_r,
        lora_dropout=settings.lora_dropout,
        lora_target_scope=CANIFINETUNE_SCOPE[settings.lora_targets],
        optimizer=CANIFINETUNE_OPTIMIZER[settings.optimizer],
        gradient_checkpointing=settings.grad_ckpt,
        attention_implementation="flash_attention_2" if settings.attn == "flash" else settings.attn,
        gpu_vram_gb=query.gpu_gib,
        use_network=False,
        override={
            "family": _family(spec),
            "hidden_size": spec.hidden_size,
            "num_hidden_layers": spec.num_hidden_layers,
            "num_attention_heads": spec.num_attention_heads,
            "num_key_value_heads": spec.num_key_value_heads,
            "intermediate_size": spec.intermediate_size,
            "vocab_size": spec.vocab_size,
            "tie_word_embeddings": spec.tie_word_embeddings,
            "num_local_experts": max(spec.num_local_experts, 1),
            "num_experts_per_tok": max(spec.num_experts_per_tok, 1),
            "total_params": spec.num_params,
        },
    )
    memory = estimate(request).memory
    return (memory.total_estimated_gb - memory.safety_margin_gb) * GIB


# --- fitscout -------------------------------------------------------------------------------------------------
def fitscout_estimate(query: Query) -> float:
    from fitscout.memory.estimator import estimate_memory
    from fitscout.model.profile import ModelProfile

    spec, settings = query.spec, query.settings
    if settings.n_gpus > 1:
        raise NotApplicable("single GPU only")
    profile = ModelProfile(
        params=spec.num_params,
        num_layers=spec.num_hidden_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_kv_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size,
        vocab_size=spec.vocab_size,
        tie_word_embeddings=spec.tie_word_embeddings,
        num_experts=max(spec.num_local_experts, 1),
        dtype_bytes=4 if settings.precision == "fp32" else 2,
    )
    estimate = estimate_memory(
        profile,
        method=settings.method,
        micro_batch=settings.micro_batch,
        seq_len=settings.seq_len,
        grad_ckpt=settings.grad_ckpt,
        opt_8bit=settings.optimizer in ("adamw_8bit", "paged_adamw_8bit"),
        lora_rank=settings.lora_r,
    )
    return estimate.total_gb * GIB


# --- ftuneai --------------------------------------------------------------------------------------------------
FTUNE_TARGET = {"qv": "attention", "attn": "attention_all", "all": "all_linear"}
FTUNE_SHARDING = {"none": "none", "ddp": "none", "zero2": "zero_2", "zero3": "zero_3", "fsdp": "fsdp"}


def ftuneai_estimate(query: Query) -> float:
    from ftuneai.core.memory import MemoryEstimator
    from ftuneai.core.models import (
        FineTuneMethod,
        LoRATarget,
        OptimizerType,
        Quantization,
        ShardingStrategy,
        TrainingConfig,
    )
    from ftuneai.core.models import (
        ModelSpec as FtuneModel,
    )

    spec, settings = query.spec, query.settings
    model = FtuneModel(
        name=spec.name,
        parameters=spec.num_params,
        hidden_size=spec.hidden_size,
        num_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_kv_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size,
        vocab_size=spec.vocab_size,
        max_seq_length=spec.max_position_embeddings,
        is_moe=spec.is_moe,
        num_experts=spec.num_local_experts or None,
        num_active_experts=spec.num_experts_per_tok or None,
    )
    optimizer = {"adamw_8bit": "adam_8bit", "paged_adamw_8bit": "adam_8bit", "sgd": "sgd"}.get(
        settings.optimizer, "adamw"
    )
    config = TrainingConfig(
        model=spec.name,
        method=FineTuneMethod(settings.method),
        quantization=Quantization({"none": "none", "int8": "8bit", "nf4": "4bit"}[settings.quant]),
        batch_size=settings.micro_batch,
        seq_length=settings.seq_len,
        gradient_checkpointing=settings.grad_ckpt,
        optimizer=OptimizerType(optimizer),
        lora_rank=settings.lora_r,
        lora_alpha=settings.lora_alpha,
        lora_target=LoRATarget(FTUNE_TARGET[settings.lora_targets]),
        flash_attention=settings.attn == "flash",
        sharding=ShardingStrategy(FTUNE_SHARDING[settings.shard]),
        num_gpus=settings.n_gpus,
    )
    return MemoryEstimator(model, config).estimate().total_gb * GIB


# --- hf-vram-calc ---------------------------------------------------------------------------------------------
@cache
def _hf_vram_calc_parts(spec: ModelSpec) -> tuple[object, int]:
    from hf_vram_calc.calculator import ParameterCalculator
    from hf_vram_calc.parser import ConfigParser

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(spec.to_hf_config()))
        config = ConfigParser.parse_config(folder, spec.name)
    params = ParameterCalculator.calculate_parameters_by_transformers(config)
    if not params:
        raise NotApplicable("could not count the parameters of the config")
    return config, params


def hf_vram_calc_estimate(query: Query) -> float:
    from hf_vram_calc.calculator import LlmodelMemoryResult, VRAMCalculator
    from hf_vram_calc.config import ConfigManager

    settings = query.settings
    if settings.n_gpus > 1:
        raise NotApplicable("no ZeRO/FSDP model (tensor/pipeline parallel only)")
    config, params = _hf_vram_calc_parts(query.spec)
    dtype = {"none": settings.precision, "int8": "int8", "nf4": "int4"}[settings.quant]
    with tempfile.TemporaryDirectory() as folder:
        calculator = VRAMCalculator(ConfigManager(config_dir=folder))
        result = LlmodelMemoryResult(
            dtype, batch_size=settings.micro_batch, sequence_length=settings.seq_len, lora_rank=settings.lora_r
        )
        result.calculate_all(config, params, calculator)
    gib = result.training_memory if settings.method == "full" else result.lora_memory
    return gib * GIB


# --- gpu-estimator --------------------------------------------------------------------------------------------
def gpu_estimator_estimate(query: Query) -> float:
    settings = query.settings
    if settings.method != "full":
        raise NotApplicable("full fine-tuning only")
    if settings.n_gpus > 1:
        raise NotApplicable("no sharding model")
    result = _gpu_estimator().estimate(
        model_params=query.spec.num_params,
        batch_size=settings.micro_batch,
        sequence_length=settings.seq_len,
        precision=settings.precision,
        optimizer="sgd" if settings.optimizer == "sgd" else "adamw",
        gradient_checkpointing=settings.grad_ckpt,
    )
    return result.total_memory_gb * GIB


@cache
def _gpu_estimator():
    from gpu_estimator.estimator import GPUEstimator

    return GPUEstimator()


COMPETITORS = [
    Competitor("accelerate", "accelerate.commands.estimate", accelerate_estimate),
    Competitor("canifinetune", "canifinetune.estimator.memory", canifinetune_estimate),
    Competitor("fitscout", "fitscout.memory.estimator", fitscout_estimate),
    Competitor("ftuneai", "ftuneai.core.memory", ftuneai_estimate),
    Competitor("hf-vram-calc", "hf_vram_calc.calculator", hf_vram_calc_estimate),
    Competitor("gpu-estimator", "gpu_estimator.estimator", gpu_estimator_estimate),
]


def available() -> tuple[list[Competitor], dict[str, str]]:
    """The calculators that import here, and for the others the reason they do not."""
    ready, missing = [], {}
    for competitor in COMPETITORS:
        try:
            importlib.import_module(competitor.module)
        except Exception as error:  # a broken install is a reason to report, not to crash the benchmark
            missing[competitor.name] = f"not installed ({type(error).__name__}: {error}); `pip install -e '.[bench]'`"
        else:
            ready.append(competitor)
    return ready, missing
