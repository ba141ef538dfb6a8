"""Reading a TRL SFTConfig / transformers TrainingArguments config into lorafit's settings (see lorafit.configs)."""

from __future__ import annotations

from lorafit.configs.reading import (
    Reading,
    Unmappable,
    is_on,
    lora_targets,
    one_of,
    quant_of_switches,
    set_deepspeed,
    set_fsdp,
    set_hf_attention,
    set_hf_mixed_precision,
    set_hf_optimizer,
    set_method,
    shown_value,
)

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
    "lora_modules_to_save": "fully trained modules other than the embeddings and LM head are not modelled",
    "use_dora": "DoRA's magnitude vectors and extra activations are not modelled",
}


def read_trl(reading: Reading) -> None:
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
    set_hf_mixed_precision(reading, bf16=bf16, fp16=fp16)
    dtype = _trl_model_dtype(reading)
    if reading.values["autocast"] is False and dtype in TORCH_DTYPES:
        reading.values["precision"] = TORCH_DTYPES[dtype]  # no autocast: the step runs in the model's dtype
    if (attention := reading.get("attn_implementation")) is not None:
        set_hf_attention(reading, "attn_implementation", attention)
    set_hf_optimizer(reading, "optim", reading.get("optim", "adamw"))  # training_args.py: an AdamW
    if reading.switch("use_liger_kernel"):  # training_args.py; SFTTrainer keeps its own fused head
        reading.values["liger"] = True
    if (loss := reading.get("loss_type")) is not None:
        if not one_of(loss, TRL_LOSSES):
            raise Unmappable(f"loss_type {shown_value(loss)}: lorafit estimates {', '.join(TRL_LOSSES)}")
        reading.values["loss"] = TRL_LOSSES[loss]
    set_deepspeed(reading, "deepspeed")
    if is_on(reading.get("fsdp")):
        set_fsdp(reading, reading.get("fsdp"), reading.get("fsdp_config"))
    reading.note_switched_on(TRL_UNMODELLED, modules_to_save="lora_modules_to_save")
    # packing and padding_free fill each row to max_length: what lorafit estimates at seq_len anyway


def _trl_sequence_length(reading: Reading, is_trl: bool) -> None:
    for key in TRL_SEQUENCE_KEYS:
        if reading.has(key):  # stated, even as null (no truncation: the data's longest row)
            if (length := reading.get(key)) is not None:
                reading.values["seq_len"] = length
            return
    if is_trl:
        reading.values["seq_len"] = 1024  # sft_config.py: max_length = 1024


def _trl_method(reading: Reading) -> None:
    if not reading.switch("use_peft"):  # model_config.py: use_peft = False, a full fine-tune
        set_method(reading, adapters=False, quant="none")
        return
    four_bit = reading.switch("load_in_4bit")
    set_method(reading, adapters=True, quant=quant_of_switches(reading, "load_in_4bit" if four_bit else ""))
    reading.copy(TRL_LORA_SAME)
    targets = lora_targets(reading, "lora_target_modules", reading.get("lora_target_modules", ["q_proj", "v_proj"]))
    if targets:
        reading.values["lora_targets"] = targets
    if four_bit:
        reading.values["double_quant"] = reading.switch("use_bnb_nested_quant")  # model_config.py
        if reading.get("bnb_4bit_quant_type") == "fp4":
            reading.note("bnb_4bit_quant_type", "fp4", "estimated as nf4: the same 4 bits a weight")


def _trl_model_dtype(reading: Reading) -> str | None:
    """The dtype the model loads in (`auto`: the one its config.json names); another name is refused."""
    for key in ("dtype", "torch_dtype", "model_init_kwargs.dtype", "model_init_kwargs.torch_dtype"):
        if (dtype := reading.get(key)) is not None:
            if not one_of(dtype, (*TORCH_DTYPES, "auto")):
                raise Unmappable(f"{key} {shown_value(dtype)}: use one of {', '.join(TORCH_DTYPES)} or auto")
            return str(dtype)
    return None
