"""The kinds of config file lorafit reads, told apart by their keys (never by the file's name)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lorafit import options

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


def mixed_evidence(config: Mapping[str, Any]) -> str:
    """For a file with lorafit's keys and more of other tools': "LLaMA-Factory's (lora_rank, cutoff_len)"."""
    if not set(config) & LORAFIT_KEYS:
        return ""
    found = [(KIND_TITLES[kind], sorted(set(config) & marks)) for kind, marks in OWN_KEYS.items()]
    return " and ".join(f"{title}'s ({', '.join(keys)})" for title, keys in found if keys)
