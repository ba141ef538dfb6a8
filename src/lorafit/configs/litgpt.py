"""Reading a litgpt config into lorafit's settings (see lorafit.configs)."""

from __future__ import annotations

from collections.abc import Mapping

from lorafit.configs.reading import Reading, Unmappable, one_of, set_method, shown_value, targets_covering

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


def read_litgpt(reading: Reading) -> None:
    """litgpt finetune: LoRA keys make it `finetune lora` (else `finetune full`); `quantize` makes it QLoRA."""
    reading.copy(LITGPT_SAME)
    if (checkpoint := reading.get("checkpoint_dir")) is not None:
        # litgpt downloads a hub id to checkpoints/<id> (litgpt/utils.py extend_checkpoint_dir): the id names it
        reading.values["model"] = str(checkpoint).removeprefix("checkpoints/")
    quant, double_quant = _litgpt_quant(reading)
    adapters = bool(LITGPT_LORA_KEYS & set(reading.config)) or quant != "none"
    set_method(reading, adapters=adapters, quant=quant)
    if adapters:
        reading.copy(LITGPT_LORA_SAME)
        reading.values.setdefault("lora_r", 8)  # setup(): lora_r = 8
        _litgpt_targets(reading)
    if double_quant is not None:
        reading.values["double_quant"] = double_quant
    if (precision := reading.get("precision")) is not None:
        if str(precision) not in LITGPT_PRECISIONS:
            raise Unmappable(f"precision {shown_value(precision)}: use one of {', '.join(LITGPT_PRECISIONS)}")
        reading.values["precision"], reading.values["autocast"] = LITGPT_PRECISIONS[str(precision)]
    _litgpt_devices(reading)
    if (global_batch := _whole_number(reading, "train.global_batch_size")) is not None:
        reading.values["batch_size"] = global_batch // (_whole_number(reading, "num_nodes") or 1)  # lorafit's: a node
    _litgpt_optimizer(reading, quantized=quant != "none")
    if reading.switch("lora_head"):
        reading.note("lora_head", True, "LoRA on the LM head is not modelled")


def _whole_number(reading: Reading, key: str) -> int | None:
    value = reading.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise Unmappable(f"{key} {shown_value(value)}: must be a whole number")
    return value


def _litgpt_quant(reading: Reading) -> tuple[str, bool | None]:
    quantize = reading.get("quantize")
    if quantize is None:
        return "none", None
    if not one_of(quantize, LITGPT_QUANTIZE):
        raise Unmappable(f"quantize {shown_value(quantize)}: lorafit estimates {', '.join(LITGPT_QUANTIZE)}")
    if "fp4" in quantize:
        reading.note("quantize", quantize, "estimated as nf4: the same 4 bits a weight")
    return LITGPT_QUANTIZE[quantize]


def _litgpt_targets(reading: Reading) -> None:
    projections: set[str] = set()
    switched_on = []
    for key, (switch_projections, default) in LITGPT_LORA_SWITCHES.items():
        if reading.switch(key, default):
            projections.update(switch_projections)
            switched_on.append(key)
    if targets := targets_covering(reading, ", ".join(switched_on), projections, True):
        reading.values["lora_targets"] = targets


def _litgpt_devices(reading: Reading) -> None:
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


def _litgpt_optimizer(reading: Reading, *, quantized: bool) -> None:
    optimizer = reading.get("optimizer", "AdamW")  # setup(): optimizer = "AdamW"
    class_path = optimizer.get("class_path", "") if isinstance(optimizer, Mapping) else str(optimizer)
    name = str(class_path).rsplit(".", 1)[-1]
    if quantized:  # utils.py instantiate_bnb_optimizer: only AdamW, as bitsandbytes' PagedAdamW
        if "AdamW" not in name:
            raise Unmappable(f"optimizer {shown_value(class_path)}: litgpt trains a quantised model with AdamW only")
        reading.values["optimizer"] = "paged_adamw_32bit"
        return
    if name not in LITGPT_OPTIMIZERS:
        raise Unmappable(f"optimizer {shown_value(class_path)}: lorafit estimates {', '.join(LITGPT_OPTIMIZERS)}")
    reading.values["optimizer"] = LITGPT_OPTIMIZERS[name]
    if reading.values["optimizer"] == "adamw":
        reading.section("optimizer.init_args")
        reading.values["fused_optimizer"] = reading.switch("optimizer.init_args.fused")
