"""The one place where lorafit's names become transformers / peft / bitsandbytes argument names.

`Settings` (what the planner and the memory model reason about) and `TrainConfig` (schedule, checkpoints)
come in; plain dicts of library keyword arguments go out. No torch import here: `build.py` and the trace
read the same tables, so the trained model and the traced one cannot drift apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lorafit.models import ModelSpec
    from lorafit.schema import Settings
    from lorafit.train.config import TrainConfig

# Settings.attn -> `attn_implementation` of from_pretrained.
ATTN_IMPLEMENTATION = {"sdpa": "sdpa", "flash": "flash_attention_2", "eager": "eager"}

# Settings.precision -> torch dtype name (`torch_dtype` of from_pretrained, bnb compute dtype).
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

# Settings.optimizer -> TrainingArguments.optim. The trace passes fused/foreach itself; the trainer runs
# AdamW fused (`adamw_torch_fused`), which is what memory.Runtime(fused_optimizer=True) models.
HF_OPTIMIZERS = {
    "adamw": "adamw_torch",
    "adamw_8bit": "adamw_bnb_8bit",
    "paged_adamw_8bit": "paged_adamw_8bit",
    "paged_adamw_32bit": "paged_adamw_32bit",
    "sgd": "sgd",
}
FUSED_OPTIMIZERS = {"adamw_torch": "adamw_torch_fused"}

# TrainConfig.lr_scheduler -> TrainingArguments.lr_scheduler_type (the names are the same).
SCHEDULERS = {
    "cosine": "cosine",
    "linear": "linear",
    "constant": "constant",
    "constant_with_warmup": "constant_with_warmup",
}


def bnb_kwargs(settings: Settings) -> dict[str, Any] | None:
    """BitsAndBytesConfig arguments: 4-bit NF4 (optionally double-quantised) or 8-bit, None for 16-bit."""
    if settings.quant == "nf4":
        return {
            "load_in_4bit": True,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": settings.double_quant,
            "bnb_4bit_compute_dtype": DTYPE_NAMES[settings.precision],
            "bnb_4bit_quant_storage": quant_storage(settings),
        }
    if settings.quant == "int8":
        return {"load_in_8bit": True}
    return None


# Settings.shard values that split the weights themselves over the GPUs.
SHARDS_WEIGHTS = ("zero3", "fsdp")


def quant_storage(settings: Settings) -> str:
    """The dtype the packed 4-bit weights are stored in: uint8, except where FSDP or ZeRO-3 shard the weights.
    Those flatten a layer's parameters into one buffer of one dtype and gather them as floats, so the 4-bit
    storage must be the compute dtype (with uint8 FSDP fails: "Must flatten tensors with uniform dtype")."""
    if settings.shard in SHARDS_WEIGHTS and settings.n_gpus * settings.nodes > 1:
        return DTYPE_NAMES[settings.precision]
    return "uint8"


def lora_kwargs(spec: ModelSpec, settings: Settings) -> dict[str, Any]:
    """peft LoraConfig arguments. An MoE's fused experts (not modules) are adapted through `target_parameters`. An
    image-text model's vision tower has modules of the same names (SigLIP's and Pixtral's q_proj, Qwen's
    gate_proj), so its targets are a pattern peft matches against the full module name (`re.fullmatch`) that keeps
    the adapters on the language model; Llama 3.2 Vision's pattern leaves out the cross-attention layers, which
    text rows skip."""
    experts = spec.expert_target_names(settings.lora_targets)
    names = [name for name in spec.lora_target_names(settings.lora_targets) if name not in experts]
    targets: list[str] | str = names
    if spec.vision is not None:
        targets = rf".*\.language_model\..*\.({'|'.join(names)})"
    elif spec.cross_attention is not None:  # Llama 3.2 Vision: the self-attention layers only (mllama.py)
        skipped = "|".join(str(index) for index in spec.cross_attention.kept(spec.num_hidden_layers))
        targets = rf"(.*\.)?layers\.(?!(?:{skipped})\.)\d+\..*\.({'|'.join(names)})"
    kwargs: dict[str, Any] = {
        "r": settings.lora_r,
        "lora_alpha": settings.lora_alpha,
        "lora_dropout": settings.lora_dropout,
        "target_modules": targets,
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    if experts:
        kwargs["target_parameters"] = [f"{spec.arch.experts_module}.{name}" for name in experts]
    if settings.train_embeddings:
        kwargs |= modules_to_save(spec)
    return kwargs


def modules_to_save(spec: ModelSpec) -> dict[str, Any]:
    """train_embeddings: peft trains copies of the input embedding and the LM head in full (ModulesToSaveWrapper).
    Every family lorafit trains names them embed_tokens and lm_head (transformers' Llama-like models; peft
    matches the name's last part). Tied embeddings are one module: ensure_weight_tying makes peft tie the head's
    copy to the embedding's (peft 0.21.2 tuners_utils._add_modules_to_save_to_tie) instead of training two."""
    if spec.tie_word_embeddings:
        return {"modules_to_save": ["embed_tokens"], "ensure_weight_tying": True}
    return {"modules_to_save": ["embed_tokens", "lm_head"]}


def optimizer_name(settings: Settings, fused: bool = True) -> str:
    name = HF_OPTIMIZERS[settings.optimizer]
    return FUSED_OPTIMIZERS.get(name, name) if fused else name


def training_kwargs(
    config: TrainConfig, settings: Settings, *, output_dir: str, on_cuda: bool, eval_steps: int | None
) -> dict[str, Any]:
    """transformers.TrainingArguments for one run. Checkpoint rotation, gradient checkpointing, progress
    and sampling are lorafit's own (atomic saves, build.prepare, its progress bar, a seeded sampler), so the
    Trainer's versions stay off."""
    return {
        "output_dir": output_dir,
        "per_device_train_batch_size": settings.micro_batch,
        "per_device_eval_batch_size": settings.micro_batch,
        # grad_accum counts the micro-batches of one node's GPUs (batch_size = micro_batch x grad_accum x n_gpus);
        # over several nodes each process runs its share (distributed.split_over_nodes makes it whole)
        "gradient_accumulation_steps": settings.grad_accum // settings.nodes,
        "bf16": settings.precision == "bf16",
        "fp16": settings.precision == "fp16",
        "optim": optimizer_name(settings),
        "learning_rate": config.learning_rate,
        "lr_scheduler_type": SCHEDULERS[config.lr_scheduler],
        "warmup_steps": config.warmup_ratio,  # a float below 1 is a share of the steps in transformers 5
        "weight_decay": config.weight_decay,
        "max_grad_norm": config.max_grad_norm,
        "num_train_epochs": config.epochs,
        "max_steps": config.max_steps or -1,
        "seed": config.seed,
        "data_seed": config.seed,
        "logging_steps": config.logging_steps,
        "eval_strategy": "steps" if eval_steps else "no",
        "eval_steps": eval_steps,
        "save_strategy": "steps",
        "save_steps": config.save_steps,
        "save_total_limit": None,
        "gradient_checkpointing": False,
        "use_cpu": not on_cuda,
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_pin_memory": on_cuda,
        "remove_unused_columns": False,
        "label_names": ["labels"],
        # several processes (DDP): every trained parameter gets a gradient in every step, so DDP need not search
        # the graph for unused ones (the Trainer would, for a peft model)
        "ddp_find_unused_parameters": False,
    }
