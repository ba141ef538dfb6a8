"""Reading an axolotl config into lorafit's settings (see lorafit.configs)."""

from __future__ import annotations

from lorafit import options
from lorafit.configs.reading import (
    Reading,
    Unmappable,
    as_names,
    is_on,
    lora_targets,
    projections_of,
    quant_of_switches,
    set_deepspeed,
    set_fsdp,
    set_hf_mixed_precision,
    set_hf_optimizer,
    set_method,
    shown_value,
)

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
    "lora_modules_to_save": "fully trained modules other than the embeddings and LM head are not modelled",
    "peft_use_dora": "DoRA's magnitude vectors and extra activations are not modelled",
    "relora": "ReLoRA restarts are not modelled",
    "neftune_noise_alpha": "NEFTune's noised embeddings are not modelled",
    "rl": "preference and RL training (a reference model, paired rows) is not modelled",
}
AXOLOTL_PARALLEL = ("sequence_parallel_degree", "context_parallel_size", "tensor_parallel_size")


def read_axolotl(reading: Reading) -> None:
    """axolotl: `adapter` and `load_in_4bit`/`load_in_8bit` make the method; its own names for the rest."""
    reading.copy(AXOLOTL_SAME)
    reading.values.setdefault("seq_len", 512)  # schemas/config.py: sequence_len = 512
    if "micro_batch" not in reading.values or "grad_accum" not in reading.values:
        reading.copy({"batch_size": "batch_size"})  # axolotl needs two of the three; the third follows
    if reading.get("gptq"):
        raise Unmappable("gptq: true: lorafit estimates bitsandbytes bases (load_in_4bit or load_in_8bit)")
    adapter = reading.get("adapter")
    if adapter in ("lora", "qlora"):
        four_bit = "adapter qlora" if adapter == "qlora" else "load_in_4bit" if reading.switch("load_in_4bit") else ""
        set_method(reading, adapters=True, quant=quant_of_switches(reading, four_bit))
        reading.copy(AXOLOTL_LORA_SAME)
        reading.values.setdefault("lora_dropout", 0.0)  # schemas/peft.py validate_lora_dropout: 0.0
        _axolotl_targets(reading)
        _axolotl_bnb_overrides(reading)
    elif adapter:
        raise Unmappable(
            f"adapter {shown_value(adapter)}: lorafit estimates the lora and qlora adapters (or none: full)"
        )
    elif reading.switch("load_in_4bit") or reading.switch("load_in_8bit"):
        raise Unmappable(
            "load_in_4bit / load_in_8bit without an adapter: axolotl trains a quantised base only with LoRA"
        )
    else:
        set_method(reading, adapters=False, quant="none")
    _axolotl_precision(reading)
    for key, attn in AXOLOTL_ATTENTION.items():
        if reading.switch(key):
            reading.values["attn"] = attn
    _axolotl_checkpointing(reading)
    set_hf_optimizer(reading, "optimizer", reading.get("optimizer", "adamw_torch_fused"))  # schemas/training.py
    set_deepspeed(reading, "deepspeed")
    if is_on(reading.get("fsdp")) or is_on(reading.get("fsdp_config")):
        set_fsdp(reading, reading.get("fsdp"), reading.get("fsdp_config"))
    reading.note_switched_on(AXOLOTL_UNMODELLED, modules_to_save="lora_modules_to_save")
    for key in AXOLOTL_PARALLEL:
        if isinstance(degree := reading.get(key), int) and degree > 1:
            reading.note(key, degree, "splitting a layer or a sequence over GPUs is not modelled")
    # sample_packing fills each row to sequence_len: a step of micro_batch x seq_len tokens, which is what lorafit
    # estimates anyway (seq_len is always set above), so it needs no line of its own


def _axolotl_targets(reading: Reading) -> None:
    modules = reading.get("lora_target_modules")
    if reading.switch("lora_target_linear"):
        reading.values["lora_targets"] = "all"
        if modules is not None:  # modules beyond the linear layers (lm_head, ...) are reported
            projections_of(reading, "lora_target_modules", as_names(modules))
    elif modules is not None and (targets := lora_targets(reading, "lora_target_modules", modules)):
        reading.values["lora_targets"] = targets


def _axolotl_bnb_overrides(reading: Reading) -> None:
    """bnb_config_kwargs overrides axolotl's 4-bit config (double quantisation on, nf4: src/axolotl/loaders)."""
    if reading.values.get("quant", options.default_quant(reading.values["method"])) != "nf4":
        return
    if reading.get("bnb_config_kwargs.bnb_4bit_use_double_quant") is not None:
        reading.values["double_quant"] = reading.switch("bnb_config_kwargs.bnb_4bit_use_double_quant")
    if reading.get("bnb_config_kwargs.bnb_4bit_quant_type") == "fp4":
        reading.note("bnb_config_kwargs.bnb_4bit_quant_type", "fp4", "estimated as nf4: the same 4 bits a weight")


def _axolotl_precision(reading: Reading) -> None:
    """bf16/fp16 are the Trainer's autocast; bfloat16/float16 load the model in that dtype without it; with
    neither, axolotl loads and trains in fp32. `bf16: auto` (the default) is bf16 where the GPU has it."""
    bf16, fp16 = reading.get("bf16", "auto"), reading.switch("fp16")
    if bf16 != "auto":
        bf16 = reading.switch("bf16")
    if bf16 is True or fp16:
        set_hf_mixed_precision(reading, bf16=bf16, fp16=fp16)
    elif reading.switch("bfloat16"):
        reading.values |= {"precision": "bf16", "autocast": False}
    elif reading.switch("float16"):
        reading.values |= {"precision": "fp16", "autocast": False}
    elif bf16 is False:
        reading.values |= {"precision": "fp32", "autocast": False}


def _axolotl_checkpointing(reading: Reading) -> None:
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
