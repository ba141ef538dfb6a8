"""Reading a torchtune config into lorafit's settings (see lorafit.configs)."""

from __future__ import annotations

from lorafit.configs.reading import Reading, Unmappable, as_names, lora_targets, one_of, set_method, shown_value

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


def read_torchtune(reading: Reading) -> None:
    """torchtune: the model builder's name makes the method (qlora_..., lora_..., else full)."""
    reading.copy(TORCHTUNE_SAME)
    builder = str(reading.get("model._component_", "")).rsplit(".", 1)[-1]
    if builder.startswith(("qlora_", "lora_")):
        quantized = builder.startswith("qlora_") or reading.switch("model.quantize_base")
        set_method(reading, adapters=True, quant="nf4" if quantized else "none")
        reading.copy(TORCHTUNE_LORA_SAME)
        reading.values.setdefault("lora_r", 8)  # _model_builders.py: lora_rank = 8
        reading.values.setdefault("lora_dropout", 0.0)  # _model_builders.py: lora_dropout = 0.0
        _torchtune_targets(reading)
    else:
        set_method(reading, adapters=False, quant="none")
    reading.values["grad_ckpt"] = reading.switch("enable_activation_checkpointing")
    reading.values["autocast"] = False
    if (dtype := reading.get("dtype")) is not None:
        if not one_of(dtype, TORCHTUNE_DTYPES):
            raise Unmappable(f"dtype {shown_value(dtype)}: use one of {', '.join(TORCHTUNE_DTYPES)}")
        reading.values["precision"] = TORCHTUNE_DTYPES[dtype]
    _torchtune_optimizer(reading)
    if (loss := reading.get("loss._component_")) is not None:
        if not one_of(loss, TORCHTUNE_LOSSES):
            raise Unmappable(f"loss {shown_value(loss)}: lorafit estimates {', '.join(TORCHTUNE_LOSSES)}")
        reading.values["loss"] = TORCHTUNE_LOSSES[loss]
    if any(reading.has(key) for key in TORCHTUNE_FSDP_KEYS):  # a config of a distributed recipe
        reading.values["shard"] = "fsdp"
        if reading.switch("fsdp_cpu_offload"):
            reading.values["offload"] = "params"
    reading.note_switched_on(TORCHTUNE_UNMODELLED)


def _torchtune_targets(reading: Reading) -> None:
    modules = as_names(reading.get("model.lora_attn_modules", []))
    if reading.switch("model.apply_lora_to_mlp"):
        modules += ["w1", "w2", "w3"]
    if modules and (targets := lora_targets(reading, "model.lora_attn_modules", modules)):
        reading.values["lora_targets"] = targets


def _torchtune_optimizer(reading: Reading) -> None:
    component = reading.get("optimizer._component_")
    if component is None:
        return
    if not one_of(component, TORCHTUNE_OPTIMIZERS):
        raise Unmappable(f"optimizer {shown_value(component)}: lorafit estimates {', '.join(TORCHTUNE_OPTIMIZERS)}")
    optimizer, fusable = TORCHTUNE_OPTIMIZERS[component]
    reading.values["optimizer"] = optimizer
    if fusable:
        reading.values["fused_optimizer"] = reading.switch("optimizer.fused")  # torch's foreach step
