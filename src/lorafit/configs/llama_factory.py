"""Reading a LLaMA-Factory config into lorafit's settings (see lorafit.configs)."""

from __future__ import annotations

from lorafit.configs.reading import (
    Reading,
    Unmappable,
    lora_targets,
    one_of,
    set_deepspeed,
    set_hf_mixed_precision,
    set_hf_optimizer,
    set_method,
    shown_value,
)

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
    "additional_target": "fully trained modules other than the embeddings and LM head are not modelled",
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


def read_llama_factory(reading: Reading) -> None:
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
        set_method(reading, adapters=True, quant=quant)
        reading.copy(LLAMA_FACTORY_LORA_SAME)
        reading.values.setdefault("lora_r", 8)  # finetuning_args.py: lora_rank = 8
        reading.values.setdefault("lora_dropout", 0.0)  # finetuning_args.py: lora_dropout = 0.0
        targets = lora_targets(reading, "lora_target", reading.get("lora_target", "all"))  # finetuning_args.py
        if targets:
            reading.values["lora_targets"] = targets
        if quant == "nf4":
            reading.values["double_quant"] = reading.switch("double_quantization", True)  # model_args.py
    elif finetuning_type == "full":
        if quant != "none":
            raise Unmappable(
                f"quantization_bit {reading.get('quantization_bit')}: LLaMA-Factory quantises only for LoRA"
            )
        set_method(reading, adapters=False, quant="none")
    else:
        raise Unmappable(f"finetuning_type {shown_value(finetuning_type)}: lorafit estimates lora and full fine-tuning")
    if reading.switch("pure_bf16"):
        reading.values |= {"precision": "bf16", "autocast": False}  # bf16 weights, no autocast
    else:
        set_hf_mixed_precision(reading, bf16=reading.switch("bf16"), fp16=reading.switch("fp16"))
    attention = reading.get("flash_attn", "auto")
    if not one_of(attention, LLAMA_FACTORY_ATTENTION):
        raise Unmappable(f"flash_attn {shown_value(attention)}: use one of {', '.join(LLAMA_FACTORY_ATTENTION)}")
    if LLAMA_FACTORY_ATTENTION[attention]:
        reading.values["attn"] = LLAMA_FACTORY_ATTENTION[attention]
    reading.values["grad_ckpt"] = not reading.switch("disable_gradient_checkpointing")
    if reading.switch("enable_liger_kernel"):  # model_args.py; apply_liger_kernel, its fused loss for sft and pt
        reading.values["liger"] = True
    set_hf_optimizer(reading, "optim", reading.get("optim", "adamw"))  # transformers' default: an AdamW
    set_deepspeed(reading, "deepspeed")
    reading.note_switched_on(LLAMA_FACTORY_UNMODELLED, modules_to_save="additional_target")
    # packing and neat_packing fill each row to cutoff_len: what lorafit estimates at seq_len anyway


def _llama_factory_quant(reading: Reading) -> str:
    bits = reading.get("quantization_bit")
    if bits is None:
        return "none"
    if not one_of(bits, LLAMA_FACTORY_QUANT_BITS):
        raise Unmappable(f"quantization_bit {shown_value(bits)}: lorafit estimates 4-bit (nf4) and 8-bit bases")
    method = reading.get("quantization_method", "bnb")
    if method != "bnb":
        reading.note("quantization_method", method, f"estimated as bitsandbytes {LLAMA_FACTORY_QUANT_BITS[bits]}")
    if bits == 4 and reading.get("quantization_type") == "fp4":
        reading.note("quantization_type", "fp4", "estimated as nf4: the same 4 bits a weight")
    return LLAMA_FACTORY_QUANT_BITS[bits]
