"""The published rows of bench/calibration/measured_memory.csv as lorafit's inputs: reading the CSV (units, metrics,
settings in the words each source used) and mapping each row to the Settings and Runtime of the step it ran
(framework defaults, then what the row, its notes and its sources say: ROW_SETUP, and for the Unsloth rows their
releases, bench/unsloth_releases.py), or to the reason it cannot be (Unmappable, EXCLUDED).
bench/memory_accuracy.py scores the mapped rows; bench/litgpt_trace.py traces the litgpt ones.
"""

from __future__ import annotations

import contextlib
import csv
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lorafit import hardware, models, stacks
from lorafit.errors import LorafitError
from lorafit.memory import CUT_CE_MIN_TOKENS, Runtime
from lorafit.models import ModelSpec
from lorafit.schema import Settings
from torchtune_step import StepRuntime
from unsloth_releases import UNSLOTH_RELEASE_LOSS, shorter_peak_at, with_dynamic_layers

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_CSV = BENCH_DIR / "calibration" / "measured_memory.csv"
EXTRA_MODELS = BENCH_DIR / "calibration_models.toml"

GB = 10**9
MIB = 2**20
Metric = Literal["allocated", "reserved", "device"]
METRICS: tuple[Metric, ...] = ("allocated", "reserved", "device")
SPLITS = ("fit", "check")


# --- parsing the CSV ------------------------------------------------------------------------------------------
def unit_of(metric_text: str) -> tuple[str, int] | None:
    """The unit a row's figure is in, from its `memory_metric` text: GiB (2**30) where the text says so (or names
    torchtune's division by 1024**3), GB (1e9) where it says GB/1e9/MB-divided-by-1000. None: no unit given."""
    text = metric_text
    if "GiB" in text or "1024**3" in text:
        return "GiB", 2**30
    if re.search(r"\bGB\b|1e9|\bMB\b|\bG\b", text):
        return "GB", GB
    return None


def metric_of(metric_text: str) -> str | None:
    """Which figure the row measured: allocated / reserved / device (nvidia-smi), a capacity bound, an OOM, or
    None when the text does not say. torchtune's "Peak Memory Active" is active_bytes.all.peak, the bytes of
    allocated blocks: it is compared with lorafit's allocated peak."""
    text = metric_text.lower()
    if "capacity bound" in text or "fits within" in text:
        return "bound"
    if "oom" in text:
        return "oom"
    if "max_memory_allocated" in text or "memory allocated" in text or "memory active" in text:
        return "allocated"
    if "max_memory_reserved" in text or "memory reserved" in text:
        return "reserved"
    if "nvidia-smi" in text or "screenshot" in text:
        return "device"
    return None


def nvidia_smi_mib(metric_text: str) -> float | None:
    """The second figure of rows that quote nvidia-smi beside allocated: 'nvidia-smi used = 77256 MiB'."""
    match = re.search(r"nvidia-smi used = ([\d.]+) MiB", metric_text)
    return float(match.group(1)) if match else None


def leading_int(text: str) -> int | None:
    match = re.match(r"\s*(\d+)", text)
    return int(match.group(1)) if match else None


def seq_len_of(text: str) -> tuple[int | None, bool]:
    """(length, is_a_maximum): '2048' / '4096 (packed)' -> fixed; '<=512 (dynamic padding)' -> 512, a maximum
    (the benchmark uses the stated maximum and says so); 'alpaca (dynamic; max not stated)' -> None."""
    text = text.strip()
    if match := re.match(r"<=\s*(\d+)", text):
        return int(match.group(1)), True
    return leading_int(text), False


def on_off(text: str) -> bool | None:
    text = text.strip().lower()
    if text.startswith("on"):
        return True
    if text.startswith("off"):
        return False
    return None


def quant_of(text: str) -> str | None:
    text = text.lower()
    if not text or text == "none":
        return "none"
    if "gptq" in text or "2-bit" in text:
        return None
    if "nf4" in text or "4-bit" in text or "4bit" in text:
        return "nf4"
    if "int8" in text or "8-bit" in text:
        return "int8"
    return None


def precision_of(text: str) -> str:
    text = text.lower()
    for name in ("fp32", "fp16", "bf16"):
        if name in text:
            return name
    return "bf16"


def optimizer_of(text: str) -> str:
    text = text.lower().replace("-", "")
    eight_bit = "8bit" in text or "8 bit" in text
    if "paged" in text:
        return "paged_adamw_8bit" if eight_bit else "paged_adamw_32bit"
    if eight_bit:
        return "adamw_8bit"
    if "sgd" in text:
        return "sgd"
    return "adamw"


def targets_of(text: str) -> str:
    text = text.lower()
    if not text:
        return "all"
    if "mlp" in text or "all" in text or "gate" in text:
        return "all"
    if re.search(r"\bk(_proj|ey)?\b", text) or "o_proj" in text or "output_proj" in text:
        return "attn"
    return "qv"


def attention_of(text: str) -> str:
    text = text.lower()
    if "flash" in text:
        return "flash"
    if "eager" in text:
        return "eager"
    return "sdpa"


def gpu_gib_of(text: str) -> float:
    """The row's GPU capacity for the bound checks and the calculators that size overheads from it: the
    catalog's figure for a GPU it knows, else the GB the text states, else 80 (A100/H100 80GB)."""
    for name in ("RTX 4090", "RTX A6000", "A10G", "T4", "H100", "A100"):
        if name.lower() in text.lower():
            with contextlib.suppress(LorafitError):
                spec = hardware.resolve(name if name != "A100" or "40" not in text else "A100 40GB")
                return spec.memory_gib
    if match := re.search(r"(\d+)\s*GB", text):
        return float(match.group(1))
    return 80.0


@dataclass
class Row:
    """One CSV row with its fields parsed (the raw text is kept for the report)."""

    raw: dict[str, str]
    id: str
    kind: str
    model: str
    method: str
    metric: str | None
    unit: tuple[str, int] | None
    peak: float | None
    micro_batch: int | None
    seq_len: int | None
    seq_is_max: bool
    grad_ckpt: bool | None
    n_gpus: int
    split: str  # fit: used to fit or choose something in lorafit; check: not (bench/calibration/README.md)

    @classmethod
    def parse(cls, raw: dict[str, str]) -> Row:
        split = (raw.get("split") or "").strip()
        if split not in SPLITS:
            raise ValueError(f"row {raw.get('id')!r}: split must be 'fit' or 'check', not {split!r}")
        seq_len, seq_is_max = seq_len_of(raw["seq_len"])
        unit = unit_of(raw["memory_metric"])
        if declared := ROW_SETUP.get(raw["id"], {}).get("unit"):
            unit = (declared, {"GiB": 2**30, "GB": GB}[declared])
        return cls(
            raw=raw,
            id=raw["id"],
            kind=raw["kind"],
            model=raw["model"],
            method=raw["method"],
            metric=metric_of(raw["memory_metric"]),
            unit=unit,
            peak=float(raw["peak_gb"]) if raw["peak_gb"].strip() else None,
            micro_batch=leading_int(raw["micro_batch"]),
            seq_len=seq_len,
            seq_is_max=seq_is_max,
            grad_ckpt=on_off(raw["grad_ckpt"]),
            n_gpus=leading_int(raw["n_gpus"]) or 1,
            split=split,
        )


def read_rows(path: Path) -> list[Row]:
    with path.open(newline="") as handle:
        rows = [Row.parse(raw) for raw in csv.DictReader(handle)]
    seen: set[str] = set()
    for row in rows:
        if row.id in seen:
            raise ValueError(f"{path}: row id {row.id!r} appears twice")
        seen.add(row.id)
    return rows


# --- models ---------------------------------------------------------------------------------------------------
# Checkpoints the catalog holds under another name (same shapes; the catalog's `source` lines say so).
MODEL_ALIASES = {
    "meta-llama/Llama-2-7b": "llama-2-7b",
    "Llama-2 7B": "llama-2-7b",
    "meta-llama/Llama-2-70b": "llama-2-70b",
    "meta-llama/Meta-Llama-3-8B": "llama-3.1-8b",
    "meta-llama/Meta-Llama-3-8B-Instruct": "llama-3.1-8b",
    "meta-llama/Meta-Llama-3.1-8B": "llama-3.1-8b",
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b",
    "meta-llama/Llama-3.3-70B-Instruct": "llama-3.1-70b",
    "meta-llama/Meta-Llama-3-70B": "llama-3.1-70b",
    "meta-llama/Llama-3.1-405B-Instruct": "llama-3.1-405b",
    "meta-llama/Llama-3.2-3B-Instruct": "llama-3.2-3b",
    "TinyLlama/TinyLlama-1.1B": "tinyllama-1.1b",
    "mistralai/Mixtral-8x7B-Instruct-v0.1": "mixtral-8x7b",
    "codellama/CodeLlama-34b-hf": "codellama-34b",
    "generic 7B": "llama-2-7b",
    "generic 70B": "llama-2-70b",
}

# Architectures lorafit does not model (src/lorafit/models.py MODEL_TYPES): their rows are excluded.
UNSUPPORTED_MODELS = {
    "Qwen/Qwen-": "Qwen v1 (QWenLMHeadModel, remote code: fused c_attn, w1/w2 MLP) is not a supported architecture",
    "T0_3B": "T5 encoder-decoder is not a supported architecture",
    "mt0-xxl": "mT5 encoder-decoder is not a supported architecture",
    "bloomz": "BLOOM (ALiBi, LayerNorm, GELU MLP) is not a supported architecture",
    "falcon": "Falcon (parallel attention/MLP, LayerNorm) is not a supported architecture",
    "phi-2": "Phi-2 (model_type phi: parallel attention/MLP, LayerNorm, GELU MLP) is not a supported architecture",
    "glm-4": "GLM-4 (chatglm remote code) is not a supported architecture",
    "Olmo-3": "OLMo-3 (olmo3: post-norm, q/k norms) is not a supported architecture",
    "Apertus": "Apertus (xIELU non-gated MLP, q/k norms) is not a supported architecture",
    "Mistral-Small-3.1": "multimodal checkpoint (Mistral3ForConditionalGeneration): the Pixtral vision tower and "
    "projector load beside the text decoder, which is all lorafit models",
}


def extra_models() -> dict[str, ModelSpec]:
    entries = tomllib.loads(EXTRA_MODELS.read_text())["model"]
    return {entry["name"]: ModelSpec.model_validate(entry) for entry in entries}


def resolve_model(name: str) -> ModelSpec | str:
    """The row's ModelSpec, or the reason there is none."""
    for pattern, reason in UNSUPPORTED_MODELS.items():
        if pattern.lower() in name.lower():
            return reason
    key = next((alias for pattern, alias in MODEL_ALIASES.items() if name.startswith(pattern)), name)
    extras = extra_models()
    if key in extras:
        return extras[key]
    try:
        return models.resolve(key)
    except LorafitError as error:
        return f"model not in the catalog or bench/calibration_models.toml ({error})"


# --- what each row ran: framework defaults, then what the row and its notes say --------------------------------
# Runtime of each framework, as its code at the cited commit runs the step (see Runtime in src/lorafit/memory.py;
# torchtune's optimizer in backward, activation offloading and chunked loss: StepRuntime in bench/torchtune_step.py).
# torchtune (recipes/lora_finetune_single_device.py, full_finetune_single_device.py): the whole model, adapters
# included, is built in bf16 (`utils.set_default_dtype(self._dtype)`), no peft, no kbit preparation; the
# TransformerDecoder upcasts all logits to fp32 (`self.output(h).float()`) for torch.nn.CrossEntropyLoss unless
# the config says CEWithChunkedOutputLoss; torch.optim.AdamW without `fused: True` runs the foreach step.
TORCHTUNE = dict(loss="hf", lora_dtype="compute", kbit_upcast=False, fused_optimizer=False, autocast=False)
# litgpt (litgpt/finetune/lora.py @00af8b0d): `model(input_ids, lm_head_chunk_size=128)` and
# `chunked_cross_entropy`; bf16-true builds adapters in bf16; torch.optim.AdamW (foreach); no kbit preparation;
# QLoRA swaps the optimizer for bnb PagedAdamW (`instantiate_bnb_optimizer`), whose state is paged.
LITGPT = dict(
    loss="chunked_compute",
    lora_dtype="compute",
    kbit_upcast=False,
    fused_optimizer=False,
    autocast=False,
    untied_head=True,
    fused_qkv=True,
    keeps_previous_step=True,
)
# HF Trainer / TRL SFTTrainer with peft (transformers 4.4x): fp32 logits for the loss, adapters autocast to fp32
# by peft, default optim adamw_torch (the foreach step). TRL's peft_module_casting_to_bf16 puts embeddings and
# lm_head back to bf16 after prepare_model_for_kbit_training under bf16=True, so no kbit fp32 upcast stays:
# fms-acceleration's own log confirms it (FMS-06: 4,307,028,992 bytes allocated after training = nf4-dq linears +
# bf16 embeddings/head + fp32 LoRA and its Adam state, within 17 MB; an fp32 upcast would add 0.52 GB).
HF_TRAINER = dict(loss="hf", lora_dtype="fp32", kbit_upcast=False, fused_optimizer=False)

# What the quantised rows' stacks did beyond the framework defaults (Runtime flags in src/lorafit/memory.py):
# - litgpt (LGC rows, 2024) pinned bitsandbytes 0.42, whose MatMul4Bit kept each 4-bit layer's input as a ctx
#   attribute (`ctx.tensors = (A, B)`; 0.43.2 keeps only the weight, so the FMS rows' 0.43.3 does not), under
#   Lightning's BitsandbytesPrecision, which quantises the LM head too, from an fp16 copy (bench/litgpt_trace.py
#   traces that step and checks these flags);
# - TRL's SFTTrainer ran peft's prepare_model_for_kbit_training on a 4-bit model, then peft_module_casting_to_bf16
#   put embeddings and head back to bf16 but kept every module with "norm" in its name in fp32: the fp32 norm
#   weights promote the residual stream to fp32, so each checkpointed layer input is 4 bytes x hidden.
#   fms-acceleration's accelerated-peft-bnb plugin (FMS-10) does its own preparation without dtype casts, so only
#   the TRL baseline rows (FMS-06/07/09, framework_config baseline-peft-bnb) get fp32_norms (ROW_SETUP below).
QUANTIZED_EXTRAS = {
    "LGC": dict(bnb_saves_input=True, quantized_head=True, dequant_copies=2),
    # lit-gpt @8641822 (LGR rows, 2023): bitsandbytes 0.41.1's MatMul4Bit keeps `ctx.tensors = (A, B)` as 0.42
    # does, and lightning @71aed751's BitsandbytesPrecision quantises every nn.Linear (no ignore_modules given)
    # from an fp16 copy (`_quantize_weight`)
    "LGR": dict(bnb_saves_input=True, quantized_head=True, dequant_copies=2),
}
TRL_KBIT = dict(fp32_norms=True)

# Rows of a stack lorafit offers (the CSV's stack column) are estimated as `--stack NAME` with these settings
# the rows share: Unsloth's notebooks run get_peft_model with lora_dropout 0 and gradient accumulation 4 (USN-*);
# its README's context-length table one row a step (USC-*: grad_accum set per row below)
STACK_ROWS: dict[str, dict[str, Any]] = {"unsloth": dict(stack="unsloth", lora_dropout=0.0, grad_accum=4)}

FRAMEWORK_OF_PREFIX = {
    "TT": TORCHTUNE,
    "TTPR": TORCHTUNE,
    "TTD": TORCHTUNE,
    "TAO": TORCHTUNE,
    "LGC": LITGPT,
    "LGR": LITGPT,
    "PFD": HF_TRAINER,
    "PFR": HF_TRAINER,
    "FMS": HF_TRAINER,
    "AX": HF_TRAINER,
    "LFI": HF_TRAINER,
    "US": HF_TRAINER,
    "USB": HF_TRAINER,
    "QW": HF_TRAINER,
    "LF": HF_TRAINER,
}

# Per row: the Settings and Runtime fields the row's columns do not carry, each with the note or source it is
# read from. Fields the columns do carry (method, r, quant, precision, micro batch, sequence, checkpointing,
# attention, GPUs) are parsed from the row and only overridden here where a note corrects them.
ROW_SETUP: dict[str, dict[str, Any]] = {
    # torchtune README @0217d44 - metric not stated; settings from the default configs the notes list
    "TT-01": dict(
        settings=dict(lora_r=8, lora_targets="all", double_quant=True, grad_accum=16),
        notes=["7B_qlora_single_device: r8 q,k,v,output_proj + MLP, AC, grad accum 16; torch.compile"],
    ),
    "TT-02": dict(
        settings=dict(lora_r=8, lora_targets="qv", grad_accum=64),
        notes=["7B_lora_single_device: r8 q,v, AC, grad accum 64"],
    ),
    # PR #961: `tune run full_finetune_single_device --config 7B_full_low_memory batch_size=4`, inputs 2048
    "TTPR-01": dict(
        settings=dict(grad_accum=1),
        runtime=dict(optimizer_in_backward=True),
        notes=[
            "7B_full_low_memory: bnb PagedAdamW (state in managed memory, not allocated) fused into "
            "backward (optimizer_in_bwd=True, needs grad accum 1), AC, nn.CrossEntropyLoss"
        ],
    ),
    "TTPR-02": dict(settings=dict(grad_accum=1), runtime=dict(optimizer_in_backward=True)),
    # torchtune README @1814feb 'Optimization flags' (Llama 3.2 3B, bs 2, seq 4096, A100); the last row's command
    # line gives gradient_accumulation_steps=1 and optimizer._component_=torch.optim.AdamW (foreach for the full
    # recipe's override; the LoRA configs keep `fused: True`).
    "TT-17": dict(settings=dict(grad_accum=1), notes=["packed to 4096, no compile, nn.CrossEntropyLoss, no AC"]),
    "TT-20": dict(
        settings=dict(grad_accum=1),
        runtime=dict(loss="chunked"),
        notes=["packed 4096, CEWithChunkedOutputLoss (8 chunks), AC"],
    ),
    # optimizer_in_bwd steps each parameter inside backward: the foreach temporaries are one parameter's size,
    # which is what fused_optimizer=True describes (no parameter-sized temporaries over the whole model).
    "TT-21": dict(
        settings=dict(grad_accum=1),
        runtime=dict(loss="chunked", optimizer_in_backward=True, fused_optimizer=True),
        notes=["+ optimizer_in_bwd: per-parameter AdamW steps in backward"],
    ),
    "TT-22": dict(
        settings=dict(grad_accum=1),
        runtime=dict(loss="chunked", optimizer_in_backward=True, fused_optimizer=True, activation_offload=True),
        notes=["+ activation offloading (checkpointed inputs in host memory)"],
    ),
    "TT-23": dict(
        settings=dict(grad_accum=1, optimizer="adamw_8bit"),
        runtime=dict(loss="chunked", optimizer_in_backward=True, fused_optimizer=True, activation_offload=True),
        notes=["+ bnb AdamW8bit fused into backward"],
    ),
    "TT-24": dict(
        settings=dict(grad_accum=1, lora_dropout=0.0, lora_targets="all"),
        runtime=dict(loss="chunked", fused_optimizer=True, activation_offload=True),
        notes=[
            "3B_lora config @1814feb: r64 q,v,output_proj + MLP (no k: lorafit's 'all' adds k_proj's "
            "7.3M adapter parameters, ~0.06 GiB with gradients and state), dropout 0.0, AdamW "
            "fused=True; + packed, chunked CE, AC, activation offloading"
        ],
    ),
    "TT-25": dict(
        settings=dict(grad_accum=1, lora_dropout=0.0, lora_targets="all", double_quant=True),
        runtime=dict(loss="chunked", fused_optimizer=True, activation_offload=True),
        notes=[
            "command line in the README; torchao NF4 (64-weight blocks, scalers quantised per 256 as "
            "bnb's double quantisation); no k_proj adapter (as TT-24)"
        ],
    ),
    # torchtune tutorials (llama2/7B_lora_single_device @ff594c2: bs 2, AC, alpaca_cleaned max_seq_len 512,
    # grad accum 64, lora_dropout 0.05 from lora_llama2_7b; 7B_qlora_single_device: grad accum 16)
    "TTD-01": dict(settings=dict(lora_dropout=0.05, grad_accum=64)),
    "TTD-02": dict(
        settings=dict(lora_dropout=0.05, grad_accum=64, lora_targets="all"),
        notes=[
            "'all layers' also adapts the output head (apply_lora_to_output): 0.3M parameters and a "
            "(tokens x 32000) bf16 LoRA output that lorafit's targets do not include"
        ],
    ),
    "TTD-03": dict(settings=dict(lora_dropout=0.05, grad_accum=64)),
    "TTD-04": dict(
        settings=dict(lora_dropout=0.05, grad_accum=64, lora_targets="all"),
        notes=["'all layers' also adapts the output head (2.3M parameters), not in lorafit's targets"],
    ),
    "TTD-05": dict(settings=dict(lora_dropout=0.05, grad_accum=16, double_quant=True)),
    "TTD-06": dict(settings=dict(lora_dropout=0.05, grad_accum=16)),
    # litgpt config_hub/finetune/<model>/<method>.yaml @00af8b0: grad accum = global_batch_size / micro_batch_size,
    # lora_dropout, `quantize: bnb.nf4` (no double quantisation)
    "LGC-01": dict(settings=dict(lora_dropout=0.05, grad_accum=4)),
    "LGC-02": dict(settings=dict(lora_dropout=0.05, grad_accum=4, double_quant=False)),
    "LGC-03": dict(settings=dict(lora_dropout=0.05, grad_accum=8)),
    "LGC-04": dict(settings=dict(lora_dropout=0.05, grad_accum=4, double_quant=False)),
    "LGC-05": dict(settings=dict(lora_dropout=0.05, grad_accum=8)),
    "LGC-06": dict(settings=dict(lora_dropout=0.05, grad_accum=4)),
    "LGC-07": dict(settings=dict(lora_dropout=0.05, grad_accum=4, double_quant=False)),
    "LGC-08": dict(settings=dict(lora_dropout=0.1, grad_accum=6), notes=["also adapts the head (lora_head: true)"]),
    "LGC-09": dict(
        settings=dict(lora_dropout=0.1, grad_accum=6, double_quant=False),
        notes=[
            "also adapts the 256k-vocabulary head (lora_head: true): 4.1M parameters and a "
            "(tokens x 256000) bf16 LoRA output that lorafit's targets do not include"
        ],
    ),
    "LGC-10": dict(
        settings=dict(lora_dropout=0.1, grad_accum=6, double_quant=False, attn="eager"),
        notes=[
            "also adapts the 256k-vocabulary head (lora_head: true), not in lorafit's targets",
            "litgpt's attention takes its eager path for Gemma-2's soft-capping (no SDPA)",
        ],
    ),
    "LGC-12": dict(
        settings=dict(lora_dropout=0.05, grad_accum=1),
        notes=["also adapts the head (lora_head: true): 1.1M parameters, not in lorafit's targets"],
    ),
    "LGC-14": dict(settings=dict(lora_dropout=0.05, grad_accum=8)),
    "LGC-15": dict(settings=dict(lora_dropout=0.05, grad_accum=8)),
    "LGC-16": dict(settings=dict(lora_dropout=0.05, grad_accum=4, double_quant=False)),
    "LGC-17": dict(settings=dict(grad_accum=8)),
    # lit-gpt @8641822 finetune/lora.py (tutorials/resource-tables.md, LGR rows): r8 alpha16 dropout 0.05 on
    # query,value, gradient accumulation 128 / micro batch. Its get_batch puts the longest sample into the first
    # micro-batch (`ix[0] = longest_seq_ix` when iter_num == 0) and pads the batch to it, so the step at that
    # length is the first one: no previous micro-batch's logits and graph are held (keeps_previous_step); every
    # later batch is a random, shorter one
    **{
        f"LGR-{index:02d}": dict(
            settings=dict(lora_dropout=0.05, grad_accum=128 // micro_batch, double_quant=double_quant),
            runtime=dict(keeps_previous_step=False),
            notes=["the longest sample's step is the first (lit-gpt @8641822 get_batch): no previous micro-batch held"],
        )
        for index, micro_batch, double_quant in (
            (1, 1, False),
            (2, 1, False),
            (3, 1, True),
            (4, 2, False),
            (5, 4, False),
            (6, 1, False),
            (7, 1, False),
            (8, 1, True),
            (9, 2, False),
        )
    },
    # peft docs (examples/sft/train.py flags quoted in the notes): dropout 0.1, AC, flash attention, packing.
    # The ZeRO-3 rows launch from an accelerate config (examples/sft/configs/deepspeed_config.yaml,
    # deepspeed_config_z3_qlora.yaml @ 6008f272) that sets no reduce_bucket_size: accelerate's DeepSpeedPlugin
    # writes none, the Trainer fills only "auto" keys, so DeepSpeed's default 5e8 holds (zero/config.py), one
    # buffer of 5e8 bf16 elements (zero/stage3.py) where lorafit's own deepspeed.json writes 5e7. Chosen from
    # those sources; the rows' errors were looked at first, so they stay check rows only on that ground
    "PFD-01": dict(
        settings=dict(lora_dropout=0.1, grad_accum=4, shard="zero3"),
        runtime=dict(zero3_reduce_bucket=500_000_000),
        unit="GiB",
        notes=[
            "DeepSpeed ZeRO-3 over 8 GPUs; nvidia-smi screenshot read as GiB (nvidia-smi prints MiB; "
            "'64 GB (80%)' of an 80 GB H100 is 80% only in GiB)",
            "DeepSpeed's default reduce bucket (5e8): the accelerate config sets none",
        ],
    ),
    "PFD-02": dict(
        settings=dict(lora_dropout=0.1, grad_accum=2, shard="zero3", double_quant=True),
        runtime=dict(zero3_reduce_bucket=500_000_000),
        unit="GiB",
        notes=[
            "DeepSpeed ZeRO-3 (zero3_init_flag) over 2 GPUs, bnb quant_storage bf16; nvidia-smi screenshot read as GiB",
            "DeepSpeed's default reduce bucket (5e8): the accelerate config sets none",
        ],
    ),
    "PFD-04": dict(
        settings=dict(lora_dropout=0.1, grad_accum=2, shard="fsdp", offload="params", double_quant=True),
        notes=[
            "FSDP with fsdp_offload_params over 2 GPUs; the run used FSDP1, whose flat-parameter copies lorafit "
            "does not model"
        ],
    ),
    "PFD-05": dict(settings=dict(lora_dropout=0.1, grad_accum=2, shard="fsdp", double_quant=True)),
    # fms-acceleration scripts/benchmarks (scenarios.yaml, defaults.yaml @24bdadb): r16 alpha 16 dropout 0.1
    # q,k,v,o; grad accum 1; gradient checkpointing; flash attention; packing to 4096. benchmark.py launches
    # through `accelerate launch` (FSDP FULL_SHARD, accelerate.yaml) only when num_gpus > 1 (line 953): one GPU
    # runs plain, two shard with FSDP. baseline-peft-bnb loads nf4 with bnb_4bit_use_double_quant=True
    # (framework_plugin_bnb.py). 'none' scenarios set torch_dtype bfloat16 without bf16=True: pure bf16.
    "FMS-01": dict(settings=dict(grad_accum=1)),
    "FMS-02": dict(settings=dict(grad_accum=1, shard="fsdp")),
    "FMS-03": dict(settings=dict(grad_accum=1, lora_dropout=0.1)),
    "FMS-04": dict(settings=dict(grad_accum=1, lora_dropout=0.1)),
    "FMS-05": dict(settings=dict(grad_accum=1, lora_dropout=0.1, shard="fsdp")),
    "FMS-06": dict(settings=dict(grad_accum=1, lora_dropout=0.1, double_quant=True), runtime=TRL_KBIT),
    "FMS-07": dict(settings=dict(grad_accum=1, lora_dropout=0.1, double_quant=True), runtime=TRL_KBIT),
    "FMS-09": dict(settings=dict(grad_accum=1, lora_dropout=0.1, double_quant=True, shard="fsdp"), runtime=TRL_KBIT),
    "FMS-10": dict(
        settings=dict(grad_accum=1, lora_dropout=0.1, double_quant=True),
        notes=[
            "accelerated-peft-bnb: same bnb nf4-dq loading; the plugin's own kbit preparation "
            "freezes and enables checkpointing without dtype casts (framework_plugin_bnb.py)"
        ],
    ),
    "FMS-11": dict(
        settings=dict(grad_accum=1, lora_dropout=0.1, double_quant=True),
        notes=["transformers 4.48 holds Mixtral's experts as nn.Linear modules, quantised by bnb"],
    ),
    **{f"USC-{n:02d}": dict(settings=dict(grad_accum=1)) for n in range(1, 10)},
    # The notebooks' banners name Unsloth 2024.5-2024.9 under transformers 4.44 (USN-01/04/10 print it; 2024.5 and
    # 2024.7 predate it): each attention layer then built its own rotary embedding, which Unsloth's
    # patch_linear_scaling swaps for its class with cos/sin caches of min(32768, max positions) (Runtime.
    # per_layer_rope_cache; unsloth/models/_utils.py, llama.py, gemma.py @ c7c67447 / 9852fdb6 / dde6a0f0). The
    # later rows (USN-08: 2025.4.4 under 4.51.3; USN-09, USM-*: 2025.9 under 4.55) hold one cache for the model.
    # USN-05 (2024.10.0) prints no transformers version: that release (d2a032e1, 2024-10-14) requires >= 4.44.2
    # and came out before 4.48 (2025-01-10), and its patch_llama_rope_scaling gives Llama 3.2 the same per-layer
    # caches (read 2026-12-06, after its -7.6 % was seen; its own after-loading figure, 2.635 GB against 2.18
    # GiB without them, agrees). Read from those sources after the rows' errors were seen: check rows on that
    # ground only
    **{
        row: dict(
            runtime=dict(per_layer_rope_cache=dtype),
            notes=[f"Unsloth {version}: a rotary cos/sin cache in every attention layer (transformers < 4.48)"],
        )
        for row, version, dtype in (
            ("USN-01", "2024.8", "compute"),
            ("USN-02", "2024.5", "compute"),
            ("USN-03", "2024.5", "compute"),
            ("USN-04", "2024.9.post1", "compute"),
            ("USN-05", "2024.10.0", "compute"),
            ("USN-06", "2024.7", "compute"),
            ("USN-07", "2024.7", "fp32"),  # gemma.py keeps Gemma's RoPE in fp32
            ("USN-10", "2024.9", "compute"),
            # the rows added later whose banners name a release under transformers < 4.48 (2024.1-2024.6 print
            # no transformers version and predate 4.48 as 2024.5 does; gemma.py / gemma2.py keep RoPE in fp32)
            ("USN-11", "2024.5", "compute"),
            ("USN-12", "2024.9.post4", "compute"),
            ("USN-13", "2024.5", "compute"),
            ("USN-14", "2024.8", "compute"),
            ("USN-15", "2024.5", "compute"),
            ("USN-16", "2025.1.5", "compute"),  # under transformers 4.47.1
            ("USN-17", "2024.11.6", "compute"),
            ("USN-18", "2024.6", "compute"),
            ("USN-19", "2024.4", "fp32"),
            ("USN-20", "2024.8", "fp32"),
            ("USN-26", "2024.1", "compute"),
        )
    },
    "USM-02": dict(settings=dict(grad_accum=1)),  # Unsloth's gpt-oss-120b notebook: gradient accumulation 1
    # the later notebooks' gradient accumulation where it is not 4 (their SFTConfig cells)
    "USN-21": dict(settings=dict(grad_accum=8)),
    "USN-27": dict(settings=dict(grad_accum=1)),
    "USN-28": dict(settings=dict(grad_accum=2)),
    "USN-29": dict(settings=dict(grad_accum=2)),
    "USM-11": dict(settings=dict(grad_accum=2)),
    "USM-12": dict(settings=dict(grad_accum=1)),
    # Unsloth 2026.4.4 left Gemma 4's fused 3-D experts 16-bit (transformers' bitsandbytes integration packs
    # nn.Linear only): the notebook's own after-loading figure, 46.4 GB for the 26B-A4B against 18.6 GB for the
    # dense 31B under the same release and load_in_4bit, is the 16-bit experts (~24B parameters x 2 bytes); unsloth_zoo
    # added its NF4 packing of fused experts (temporary_patches/moe_utils_bnb4bit.py) on 2026-05-15 (1d009af0)
    "USM-08": dict(
        runtime=dict(quantized_experts=False),
        notes=["Unsloth 2026.4.4: Gemma 4's experts not packed to 4-bit (46.4 GB reserved after loading)"],
    ),
    # Unsloth context-length table, HF + FA2 columns (kind = estimate): shown beside their bound, not scored
    "US-09": dict(settings=dict(lora_dropout=0.0, grad_accum=1, grad_ckpt=True)),
    "US-11": dict(settings=dict(lora_dropout=0.0, grad_accum=1, grad_ckpt=True)),
    "US-12": dict(settings=dict(lora_dropout=0.0, grad_accum=1, grad_ckpt=True)),
}
COMPILED = (
    "torch.compile on: compiled graphs change which tensors are saved for backward (-15% from TT-17 to "
    "TT-18) and the LoRA recipe also compiles the loss (training.compile_loss in "
    "recipes/lora_finetune_single_device.py @1814feb), the largest term for a 128k vocabulary; lorafit models "
    "eager execution"
)

# Rows whose settings are known but whose figure lorafit does not model: shown with lorafit's figures, not scored.
UNSCORED = {
    "USM-04": "Unsloth forces float32 for Gemma 3 on a card without bf16 (loader.py FORCE_FLOAT32 @ 015bdef0), "
    "which lorafit does not model; the notebook's cells are from different runs (an RTX 3060 banner, a T4 figure)",
    **{
        row: "Unsloth forces float32 for Gemma 3 on a card without bf16 ('Unsloth: Switching to float32 training' in "
        "the notebook's output; loader.py FORCE_FLOAT32), which lorafit does not model"
        for row in ("USN-27", "USN-28", "USN-29")
    },
    "TT-01": COMPILED,
    **{f"TT-{n}": COMPILED for n in range(20, 26)},
    "TTD-05": "the reserved figure was set while loading: 9.13 GB reserved after model init vs 9.29 GB in training "
    "(qlora_finetune.rst table) - torchtune staged bf16 weights on the GPU before NF4 conversion and the "
    "caching allocator kept those blocks; lorafit models the training step",
}

# Rows of supported models that cannot be compared, with the reason (read from the row and its notes).
EXCLUDED = {
    "TT-03": "metric not stated; FSDP over 2 GPUs with the distributed recipe's settings not stated",
    "TT-04": "metric not stated; PagedAdamW can spill to host memory, so the figure tracks the GPU's capacity",
    "TT-05": "metric not stated; the same 24.1 as the single-GPU row, flagged suspicious in the notes",
    "TT-06": "metric not stated; 70B LoRA over 8 GPUs with FSDP settings not stated",
    "TT-07": "metric not stated; 70B full fine-tune over 8 GPUs, checkpointing not stated",
    **{
        f"TT-{n:02d}": "per-row config overrides not stated, and the 4090 and A6000 rows of the same method differ "
        "~2x, so each row's settings cannot be determined"
        for n in range(8, 16)
    },
    "TT-16": "dynamic padding to <=4096 on alpaca: no sample comes near 4096 (the same recipe packed to 4096 needs "
    "60 GiB, TT-17), so the peak's sequence length is unknown",
    "TT-18": "torch.compile without activation checkpointing: compiled graphs change which activations are saved "
    "(-15% against TT-17); lorafit models eager execution",
    "TT-19": "torch.compile without activation checkpointing (as TT-18)",
    "FMS-11": "transformers 4.48 (the row's stack) holds Mixtral's experts as nn.Linear modules, which bnb quantises; "
    "lorafit models transformers 5, whose fused 3-D expert parameters stay in bf16",
    **{
        f"TAO-{n:02d}": "batch size, sequence length (alpaca, dynamic, max not stated), checkpointing and "
        "optimizer_in_bwd not stated"
        for n in range(1, 5)
    },
    "LGC-18": "8.70 GB is below the weights + gradients + AdamW floor of a 1.24B model in bf16 (9.9 GB): "
    "mislabelled (flagged in the notes)",
    "LGC-19": "16.51 GB is below the weights + gradients + AdamW floor of a 3.2B model in bf16 (25.7 GB), which a "
    "24 GB A10G could not hold: mislabelled (flagged in the notes)",
    "PFD-03": "a 72-80 GB range whose top is reached at the FULL_STATE_DICT checkpoint save, not in a training step",
    "FMS-08": "GPTQ 4-bit weights (auto-gptq): lorafit models bitsandbytes nf4/int8",
    "AX-02": "Cut Cross Entropy never materialises the logits; lorafit's loss modes (hf, chunked) do not describe it",
    **{
        f"US-{n:02d}": "the Unsloth README table states neither sequence length nor (A100 rows) batch size"
        for n in range(1, 8)
    },
    "USB-01": "vendor headline with no batch size or sequence length",
    "USB-02": "Unsloth's own kernels (fused loss, offloaded checkpointing): not a runtime lorafit models",
    "USM-07": "the 4-bit 31B model was spread over two T4s by the loader's device map ('Num GPUs used = 2'), and "
    "the figure is GPU 0's share; lorafit models one card per replica",
    "USM-12": "Unsloth's tiled MLP (unsloth_tiled_mlp) and 486,607 tokens, past gpt-oss-20b's 131072 positions: "
    "--stack unsloth neither models the tiling nor scales RoPE",
    # found 2026-12-06, after its error was seen (-15.5 %, then +0.1 % with its 16-bit layers)
    "USN-22": "cells from different runs: the loading cells ran on a T4 (11.898 GB reserved), the training cell's "
    "output on an A100 40 GB ('Peak reserved memory = 14.066 GB', '35.559 % of max memory' = 14.066 / 39.557, 'for "
    "training = 0.0 GB', 261.8 s against the T4 twin USN-23's 2476.6 s); its later cells carry no execution count",
    "USN-25": "cells from different runs: its banner names an A100 40 GB, but its training cell's output is USN-04's "
    "(Qwen2.5-7B Alpaca on a T4: 'Peak reserved memory = 7.893 GB', '53.519 %' of 14.748 GB, 462.3942 s, all the same)",
}


class Unmappable(Exception):
    """The row's settings cannot be determined (the message says what is missing)."""


@dataclass
class Mapping:
    spec: ModelSpec
    settings: Settings
    runtime: Runtime  # a StepRuntime for the calibration rows (torchtune's code paths beside lorafit's)
    notes: list[str] = field(default_factory=list)
    # the row's GPU, for a stack whose step sizes itself by the free memory (Unsloth's fused loss)
    gpu: hardware.GpuSpec | None = None
    # a shorter length whose peak may pass the cap's, for a padded row: Unsloth's cut cross-entropy ran only above
    # CUT_CE_MIN_TOKENS, so a batch at or below it held its logits (shorter_peak_at)
    shorter: Settings | None = None


def prefix_of(row_id: str) -> str:
    return row_id.split("-")[0]


def map_row(row: Row, spec: ModelSpec) -> Mapping:
    """Settings and Runtime of one row: its columns, the framework's defaults, and ROW_SETUP's corrections."""
    raw, setup = row.raw, ROW_SETUP.get(row.id, {})
    notes: list[str] = list(setup.get("notes", []))
    quant = quant_of(raw["quant"])
    if quant is None:
        raise Unmappable(f"quantisation {raw['quant']!r} is not one lorafit models (bitsandbytes nf4/int8)")
    method = row.method
    if method == "lora" and quant != "none":
        raise Unmappable("LoRA on a quantised base")
    if row.micro_batch is None:
        raise Unmappable("micro batch size not stated")
    if row.seq_len is None:
        raise Unmappable(f"sequence length not stated ({raw['seq_len'] or 'blank'})")
    if row.seq_is_max:
        notes.append(f"dynamic padding: the stated maximum {row.seq_len} is used")
    fields: dict[str, Any] = dict(
        method=method,
        quant=quant,
        precision=precision_of(raw["precision"]),
        optimizer=optimizer_of(raw["optimizer"]),
        micro_batch=row.micro_batch,
        seq_len=row.seq_len,
        grad_ckpt=bool(row.grad_ckpt),
        attn=attention_of(raw["attn"]),
        n_gpus=row.n_gpus,
        lora_targets=targets_of(raw["lora_targets"]),
    )
    if row.n_gpus > 1:
        fields["shard"] = "fsdp"
    if lora_r := leading_int(raw["lora_r"]):
        fields["lora_r"] = lora_r
    fields.update(setup.get("settings", {}))
    if method != "full" and "lora_r" not in fields:
        raise Unmappable("LoRA rank not stated")
    if raw["stack"] in STACK_ROWS and prefix_of(row.id) not in FRAMEWORK_OF_PREFIX:
        # a stack lorafit offers: its own Runtime and defaults, as `--stack NAME` estimates it
        fields |= STACK_ROWS[raw["stack"]] | setup.get("settings", {})
        # with what the row's own versions ran beyond the pinned preset (ROW_SETUP's runtime)
        facts = stacks.resolve(raw["stack"]).facts(quant != "none") | setup.get("runtime", {})
        facts |= UNSLOTH_RELEASE_LOSS.get(row.id, {})
        gpu = hardware.custom(gpu_gib_of(raw["gpu"]))  # a card sold as "24 GB" has 24 GiB (hardware.custom)
        settings, runtime = Settings(**fields), Runtime(**facts)
        spec, dynamic = with_dynamic_layers(row.id, raw["notes"], spec, settings, runtime)
        notes += [dynamic] if dynamic else []
        shorter = shorter_peak_at(row.seq_is_max, settings, runtime)
        if shorter:
            notes.append(
                f"cut cross-entropy only above {CUT_CE_MIN_TOKENS} tokens: also estimated at {shorter.seq_len}"
            )
        return Mapping(spec, settings, runtime, notes, gpu, shorter)
    runtime = dict(FRAMEWORK_OF_PREFIX[prefix_of(row.id)])
    if quant != "none":
        runtime.update(QUANTIZED_EXTRAS.get(prefix_of(row.id), {}))
    runtime.update(setup.get("runtime", {}))
    try:
        settings = Settings(**fields)
    except ValueError as error:
        raise Unmappable(f"settings do not validate: {error}") from None
    return Mapping(spec, settings, StepRuntime(**runtime), notes)
