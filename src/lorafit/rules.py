"""The rules that tie settings together: a combination no trainer can run, refused with one line that names the
settings and what would work. Each rule applies once every setting it names is set, so the same check refuses a
flag, a YAML key, a `--from` config and a page field alike (`options` runs them when it validates). Pure Python.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lorafit.messages import say


@dataclass(frozen=True)
class Rule:
    """A check over several settings, applied when every one of `names` is set; `check` returns the problem."""

    names: tuple[str, ...]
    check: Callable[[Mapping[str, Any]], str | None]


def _quant_matches_method(v: Mapping[str, Any]) -> str | None:
    method, quant = v["method"], v["quant"]
    if method == "qlora" and quant == "none":
        return say("rule.qlora_needs_quant", setting_method="method", setting_quant="quant")
    if method != "qlora" and quant != "none":
        return say("rule.quant_needs_qlora", setting_method="method", method=method, setting_quant="quant")
    return None


def world_size_of(v: Mapping[str, Any]) -> int:
    """Every GPU of the run: n_gpus on each of `nodes` machines."""
    return (v.get("n_gpus") or 1) * (v.get("nodes") or 1)


def _shard_needs_gpus(v: Mapping[str, Any]) -> str | None:
    # one GPU may still run ZeRO/FSDP for its CPU offload (ZeRO-Offload), never a shard alone
    if world_size_of(v) > 1 or v["shard"] == "none" or (v.get("offload") or "none") != "none":
        return None
    return f"shard {v['shard']} needs n_gpus > 1 (or nodes > 1, or an offload on one GPU); use shard none"


def _gpus_share_the_batch(v: Mapping[str, Any]) -> str | None:
    batch_size, n_gpus, nodes = v["batch_size"], v["n_gpus"], v.get("nodes") or 1
    if batch_size % (n_gpus * nodes) == 0:
        return None
    if nodes > 1:
        return (
            f"n_gpus {n_gpus} x nodes {nodes} = {n_gpus * nodes} GPUs do not divide batch_size {batch_size}: every "
            f"GPU takes the same whole number of sequences per step; use a batch_size that is a multiple of "
            f"{n_gpus * nodes}"
        )
    return (
        f"n_gpus {n_gpus} does not divide batch_size {batch_size}: every GPU takes the same whole number of "
        "sequences per step"
    )


# The most GPUs one machine holds: 8 on HGX/DGX A100, H100 and B200 boards, 16 on the DGX-2 (V100).
MAX_GPUS_PER_NODE = 16
SHARDED_SHARDS = ("zero2", "zero3", "fsdp")  # the shards that keep a part of the states per GPU
OFFLOAD_OPTIMIZERS = ("adamw", "paged_adamw_32bit")  # what an offloaded optimizer can step on the CPU


def _gpus_fit_a_node(v: Mapping[str, Any]) -> str | None:
    n_gpus = v["n_gpus"]
    if n_gpus <= MAX_GPUS_PER_NODE:
        return None
    per_node = 8 if n_gpus % 8 == 0 else MAX_GPUS_PER_NODE
    nodes = math.ceil(n_gpus / per_node) * (v.get("nodes") or 1)
    return (
        f"n_gpus {n_gpus}: n_gpus counts the GPUs of one machine, and none holds more than {MAX_GPUS_PER_NODE}; "
        f"use n_gpus {per_node} with nodes {nodes}"
    )


def _offload_needs_sharding(v: Mapping[str, Any]) -> str | None:
    offload, shard = v["offload"], v["shard"]
    if offload == "none" or shard in SHARDED_SHARDS:
        return None
    nearest = "zero2" if offload == "optimizer" else "zero3"
    return (
        f"offload {offload}: shard {shard} keeps every state on every GPU and has no offload; use shard {nearest} "
        "(DeepSpeed ZeRO) or fsdp"
    )


def _offload_params_needs_sharded_weights(v: Mapping[str, Any]) -> str | None:
    if v["offload"] == "params" and v["shard"] == "zero2":
        return "offload params: ZeRO-2 keeps every weight on every GPU; use shard zero3 (or offload optimizer)"
    return None


def _offload_steps_adamw(v: Mapping[str, Any]) -> str | None:
    if v["offload"] == "none" or v["optimizer"] in OFFLOAD_OPTIMIZERS:
        return None
    return (
        f"offload {v['offload']}: the optimizer steps on the CPU (DeepSpeed's CPU AdamW, or torch's AdamW on FSDP's "
        f"host shards), with 32-bit states; optimizer {v['optimizer']} has no CPU step: use optimizer adamw"
    )


def _quant_shards(v: Mapping[str, Any]) -> str | None:
    if v["quant"] != "int8" or v["shard"] not in ("zero3", "fsdp"):
        return None
    return (
        f"shard {v['shard']} cannot split bitsandbytes' int8 weights (Int8Params keep their scales beside the "
        "weight); use quant nf4 (stored as the compute dtype, which ZeRO-3 and FSDP shard) or shard zero2"
    )


def _micro_batch_splits(v: Mapping[str, Any]) -> str | None:
    per_gpu = v["batch_size"] // (v.get("n_gpus") or 1)
    micro_batch = v["micro_batch"]
    if per_gpu % micro_batch == 0:
        return None
    fitting = [str(b) for b in range(1, per_gpu + 1) if per_gpu % b == 0][:8]
    return (
        f"micro_batch {micro_batch} does not divide batch_size {v['batch_size']}"
        + (f" over {v['n_gpus']} GPUs" if (v.get("n_gpus") or 1) > 1 else "")
        + f": use micro_batch {', '.join(fitting)}, or another batch_size"
    )


def _batch_is_the_product(v: Mapping[str, Any]) -> str | None:
    product = v["micro_batch"] * v["grad_accum"] * (v.get("n_gpus") or 1)
    if product == v["batch_size"]:
        return None
    return (
        f"micro_batch {v['micro_batch']} x grad_accum {v['grad_accum']}"
        + (f" x n_gpus {v['n_gpus']}" if (v.get("n_gpus") or 1) > 1 else "")
        + f" is {product}, not batch_size {v['batch_size']}; leave one of them out"
    )


def _eval_sources(v: Mapping[str, Any]) -> str | None:
    return "give eval_data or eval_split, not both (set eval_split: 0)" if v["eval_split"] else None


def _eval_split_whole(v: Mapping[str, Any]) -> str | None:
    split = v["eval_split"]
    return f"eval_split {split:g}: a share below 1 or a whole number of rows" if split >= 1 and split % 1 else None


def _offload_needs_checkpointing(v: Mapping[str, Any]) -> str | None:
    if v["offload_activations"] and not v["grad_ckpt"]:
        return "offload_activations moves the checkpointed layer inputs to host memory: it needs grad_ckpt on"
    return None


def _embeddings_frozen(v: Mapping[str, Any]) -> str | None:
    if v["offload_embeddings"] and v["method"] == "full":
        return "offload_embeddings keeps frozen embeddings in host memory; full fine-tuning trains them"
    return None


def _embeddings_train_beside_adapters(v: Mapping[str, Any]) -> str | None:
    """train_embeddings: peft's modules_to_save beside LoRA; full fine-tuning trains them already."""
    if v["train_embeddings"] and v["method"] == "full":
        return (
            "train_embeddings trains the embeddings and LM head beside LoRA adapters; full fine-tuning trains them "
            "already: use method lora or qlora"
        )
    return None


def _trained_embeddings_stay(v: Mapping[str, Any]) -> str | None:
    if v["train_embeddings"] and v["offload_embeddings"]:
        return "offload_embeddings keeps frozen embeddings in host memory; train_embeddings trains them"
    return None


def _flash_needs_half_precision(v: Mapping[str, Any]) -> str | None:
    if v["attn"] == "flash" and v["precision"] == "fp32":
        return "attn flash: flash attention has no fp32 kernel; use precision bf16 or fp16, or attn sdpa"
    return None


def _fused_step_is_adamw(v: Mapping[str, Any]) -> str | None:
    if v["fused_optimizer"] and v["optimizer"] == "sgd":
        return (
            "fused_optimizer: the fused step is AdamW's (adamw_torch_fused) and optimizer sgd has none; use an adamw "
            "optimizer, or turn fused_optimizer off"
        )
    return None


RULES: tuple[Rule, ...] = (
    Rule(("method", "quant"), _quant_matches_method),
    Rule(("n_gpus",), _gpus_fit_a_node),
    Rule(("n_gpus", "shard"), _shard_needs_gpus),
    Rule(("offload", "shard"), _offload_needs_sharding),
    Rule(("offload", "shard"), _offload_params_needs_sharded_weights),
    Rule(("offload", "optimizer"), _offload_steps_adamw),
    Rule(("quant", "shard"), _quant_shards),
    Rule(("batch_size", "n_gpus"), _gpus_share_the_batch),
    Rule(("batch_size", "micro_batch"), _micro_batch_splits),
    Rule(("batch_size", "micro_batch", "grad_accum"), _batch_is_the_product),
    Rule(("eval_data", "eval_split"), _eval_sources),
    Rule(("eval_split",), _eval_split_whole),
    Rule(("offload_activations", "grad_ckpt"), _offload_needs_checkpointing),
    Rule(("offload_embeddings", "method"), _embeddings_frozen),
    Rule(("train_embeddings", "method"), _embeddings_train_beside_adapters),
    Rule(("train_embeddings", "offload_embeddings"), _trained_embeddings_stay),
    Rule(("attn", "precision"), _flash_needs_half_precision),
    Rule(("fused_optimizer", "optimizer"), _fused_step_is_adamw),
)


def broken_rule(values: Mapping[str, Any]) -> str | None:
    """The first rule that the set values break, as its message."""
    for rule in RULES:
        if all(values.get(name) is not None for name in rule.names):
            problem = rule.check(values)
            if problem:
                return problem
    return None
