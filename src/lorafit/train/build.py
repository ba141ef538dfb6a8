"""Model set-up shared by training and by the `--exact` trace, so both run the same code path.

`settings` is a `lorafit.schema.Settings`: every choice here is read from it, never re-derived.
torch, transformers and peft are imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafit.errors import TrainError
from lorafit.train import hf_args, model_files, savers
from lorafit.train.hf_args import ATTN_IMPLEMENTATION

if TYPE_CHECKING:
    import torch
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig, PretrainedConfig, PreTrainedModel

    from lorafit.models import ModelSpec
    from lorafit.schema import Settings


# The libraries whose advice is for their own developers, not for a person running lorafit (`kernels` is
# what bitsandbytes asks for a CPU kernel when it is imported, and it logs about the Hub; "DeepSpeed" is the
# logger of deepspeed, which transformers imports and which says "Setting accelerator to CPU").
QUIETED_LIBRARIES = (
    "transformers",
    "peft",
    "bitsandbytes",
    "kernels",
    "torch",
    "accelerate",
    "huggingface_hub",
    "trl",
    "deepspeed",
    "DeepSpeed",
)


class _ErrorsOnly(logging.Filter):
    """Kept on a library's logger: a library that sets its own level when it is imported (DeepSpeed sets
    WARNING on its logger) stays as quiet as the level set here would keep it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


_ERRORS_ONLY = _ErrorsOnly()


def quiet_libraries() -> None:
    """Our own progress bar and messages only: the libraries' bars, log lines and warnings go.

    Training, `lorafit chat` and the `--exact` trace call this before they import torch: bitsandbytes logs
    at import time, and deprecation notices (transformers' `gradient_checkpointing_enable` in the trace,
    torch.jit's `script_method` in a resumed run) are about the libraries' APIs, which lorafit pins. Calling it
    again is harmless: `warnings.filterwarnings` replaces an identical filter instead of adding a second."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for library in QUIETED_LIBRARIES:
        logger = logging.getLogger(library)
        logger.setLevel(logging.ERROR)
        logger.addFilter(_ERRORS_ONLY)  # added once: addFilter skips a filter the logger has
        for category in (FutureWarning, UserWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category, module=rf"{library}(\.|$)")
    # Raised by the libraries with a stack level that names the caller's module, so matched by their text.
    warnings.filterwarnings("ignore", message=".*Paged optimizers are not supported on CPU.*")
    warnings.filterwarnings("ignore", message=".*an autograd kernel was not registered.*")
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging as hf_logging

    hub_logging.set_verbosity_error()  # the hub sets its own level when first imported
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def compute_dtype(settings: Settings) -> torch.dtype:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[settings.precision]


def quantization_config(settings: Settings) -> BitsAndBytesConfig | None:
    """bitsandbytes 4-bit NF4 (optionally double-quantised) or 8-bit for the frozen base of QLoRA."""
    from transformers import BitsAndBytesConfig

    kwargs = hf_args.bnb_kwargs(settings)
    if kwargs is None:
        return None
    if "bnb_4bit_compute_dtype" in kwargs:
        kwargs["bnb_4bit_compute_dtype"] = compute_dtype(settings)
    return BitsAndBytesConfig(**kwargs)


def lora_config(spec: ModelSpec, settings: Settings) -> LoraConfig:
    from peft import LoraConfig

    return LoraConfig(**hf_args.lora_kwargs(spec, settings))


def hf_config(spec: ModelSpec, settings: Settings) -> PretrainedConfig:
    """A transformers config for a ModelSpec (for building from scratch: tests, the demo, the trace)."""
    from transformers import AutoConfig

    data = spec.to_hf_config()
    model_type = data.pop("model_type")
    config = AutoConfig.for_model(model_type, **data)
    config._attn_implementation = attn_implementation(settings, data)
    return config


def attn_implementation(settings: Settings, config: dict[str, Any]) -> str | dict[str, str]:
    """The attention `settings` names, for every sub-model but an audio tower (Gemma 4 E2B / E4B), which has eager
    attention only (transformers 5.25 Gemma4AudioModel: _supports_sdpa False; "sdpa" for the whole model raises)."""
    chosen = ATTN_IMPLEMENTATION[settings.attn]
    if not config.get("audio_config"):
        return chosen
    subs = [key for key, value in config.items() if key.endswith("_config") and isinstance(value, dict)]
    return {"": chosen} | {key: chosen for key in subs} | {"audio_config": "eager"}


def check_model_dir(model_dir: Path, allow_pickle: bool = False) -> None:
    """Refuse what would fail late or run untrusted code: no config, no weights, or pickled weights only; and
    what transformers would load wrongly or fail on after the run folder is written (`model_files.check`)."""
    if not (model_dir / "config.json").is_file():
        raise TrainError(f"{model_dir} has no config.json; pass a Hugging Face model directory")
    has_safetensors = any(model_dir.glob("*.safetensors"))
    has_pickle = any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt"))
    if not has_safetensors and not has_pickle:
        raise TrainError(f"{model_dir} has no weights (*.safetensors)")
    if not has_safetensors and not allow_pickle:
        raise TrainError(
            f"{model_dir} holds only pickled .bin weights, which can run code when loaded; "
            "convert them to safetensors or pass --allow-pickle"
        )
    quiet_libraries()  # the check builds the model's skeleton with transformers
    model_files.check(model_dir)


def load_model(
    model_dir: Path,
    settings: Settings,
    *,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    device_map: Any = None,
) -> PreTrainedModel:
    """Load a local model with the quantisation, dtype and attention that `settings` names."""
    model_dir = Path(model_dir)
    check_model_dir(model_dir, allow_pickle=allow_pickle)
    stored = stored_quantization(model_dir, settings, trust_remote_code)
    quantization = stored_mxfp4_config(model_dir, settings) or quantization_config(settings)
    quantized = {"config": stored} if stored is not None else {"quantization_config": quantization}
    auto_class = model_files.auto_model_class(model_files.config_model_type(model_dir))
    attention = attn_implementation(settings, json.loads((model_dir / "config.json").read_text()))
    try:
        model = auto_class.from_pretrained(
            model_dir,
            dtype=compute_dtype(settings),
            **quantized,
            attn_implementation=attention,
            use_safetensors=not allow_pickle or None,
            trust_remote_code=trust_remote_code,
            device_map=device_map,
            local_files_only=True,
        )
    except (OSError, ValueError) as error:
        raise TrainError(f"cannot load model from {model_dir}: {str(error).splitlines()[0]}") from None
    return model


def stored_quantization(model_dir: Path, settings: Settings, trust_remote_code: bool) -> PretrainedConfig | None:
    """The config of a folder saved already quantised by bitsandbytes (a pre-quantised repo such as
    unsloth/...-bnb-4bit), with the plan's compute dtype; None for a 16-bit folder.

    Such weights load as stored, never quantised again: transformers takes the folder's quantization_config and
    ignores (with a warning lorafit silences) a BitsAndBytesConfig passed beside it, compute dtype included. The
    plan has checked that its settings are that storage (options.check_prequantized); the compute dtype is the
    plan's, as it is for a base lorafit quantises itself."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise TrainError(f"cannot load model from {model_dir}: {str(error).splitlines()[0]}") from None
    stored = getattr(config, "quantization_config", None)
    if not isinstance(stored, dict) or stored.get("quant_method") != "bitsandbytes":
        return None
    if stored.get("load_in_4bit"):
        config.quantization_config = stored | {"bnb_4bit_compute_dtype": hf_args.DTYPE_NAMES[settings.precision]}
    return config


def stored_mxfp4_config(model_dir: Path, settings: Settings) -> Any:
    """gpt-oss's checkpoints store the experts in MXFP4, which transformers cannot train (its Mxfp4HfQuantizer
    is not trainable): they load dequantised to bf16 (Mxfp4Config(dequantize=True)), as the estimate counts
    them. A checkpoint holds one quantization_config, so 4-bit bitsandbytes cannot be added on top."""
    from transformers import Mxfp4Config

    try:
        stored = json.loads((model_dir / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return None  # check_model_dir has read it already; from_pretrained says what is wrong
    if not isinstance(stored, dict) or stored.get("quant_method") != "mxfp4":
        return None
    if settings.quant != "none":
        raise TrainError(
            f"{model_dir} stores its experts in MXFP4, which transformers trains only dequantised to bf16 and "
            "cannot combine with 4-bit bitsandbytes; use --method lora (or a bf16 copy of the model for qlora)"
        )
    return Mxfp4Config(dequantize=True)


def prepare(model: PreTrainedModel, spec: ModelSpec, settings: Settings) -> PreTrainedModel:
    """Gradient checkpointing and LoRA adapters, the same for training and for the trace.

    With offload_embeddings the frozen input embedding moves to host memory (`savers.keep_embeddings_on_host`).
    We do not call peft's `prepare_model_for_kbit_training`: it upcasts every non-quantised parameter
    (embeddings, LM head, norms) to fp32, which costs 4 bytes x vocab x hidden twice for nothing the adapters
    need. Non-reentrant checkpointing needs no input that requires grad, so nothing else is required.
    """
    from peft import get_peft_model

    model.config.use_cache = False
    if settings.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if settings.method == "full":
        return model
    model = get_peft_model(model, lora_config(spec, settings))
    if settings.offload_embeddings:
        savers.keep_embeddings_on_host(model)
    return model


def parameter_counts(model: PreTrainedModel) -> tuple[int, int]:
    """(all, trained) parameters of the model as its config describes it. bitsandbytes stores a 4-bit weight
    packed two values to a byte, as a uint8 tensor of half the elements: its `quant_state` has the real shape."""
    total = trained = 0
    for parameter in model.parameters():
        quant_state = getattr(parameter, "quant_state", None)
        count = quant_state.shape.numel() if quant_state is not None else parameter.numel()
        total += count
        trained += count if parameter.requires_grad else 0
    return total, trained


# --- shared checks and the optimizer (used by `lorafit train` and by the `--exact` trace) ---------------
def setup_error(spec: ModelSpec, what: str, error: BaseException) -> TrainError:
    """One line a user can act on, for a model or option the set-up cannot build."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    detail = lines[0] if lines else type(error).__name__
    if detail.endswith(":") and len(lines) > 1:  # "Class validation error for validator 'x':" + the reason
        detail = f"{detail} {lines[1]}"
    if len(detail) > 200 and ". " in detail:  # transformers explains at length; the first sentence says it
        detail = detail.split(". ")[0] + "."
    return TrainError(f"{spec.name} ({spec.architecture}): {what}: {detail}")


def check_settings(spec: ModelSpec, settings: Settings) -> None:
    """Refuse, before anything is built, what the set-up cannot run (Settings itself checks the rest)."""
    import importlib.util

    if settings.attn == "flash" and importlib.util.find_spec("flash_attn") is None:
        raise TrainError("--attn flash needs the flash-attn package and a CUDA GPU; use --attn sdpa")


def checked_hf_config(spec: ModelSpec, settings: Settings) -> PretrainedConfig:
    """`hf_config`, with the settings checked and a transformers refusal turned into a TrainError."""
    from huggingface_hub.errors import StrictDataclassError

    check_settings(spec, settings)
    if spec.num_attention_heads % spec.num_key_value_heads:
        raise TrainError(
            f"{spec.name}: num_attention_heads ({spec.num_attention_heads}) is not a multiple of "
            f"num_key_value_heads ({spec.num_key_value_heads}); attention cannot group the heads"
        )
    try:
        return hf_config(spec, settings)
    except (ValueError, TypeError, KeyError, AttributeError, StrictDataclassError) as error:
        raise setup_error(spec, "transformers cannot build it from its config", error) from None


def checked_prepare(model: PreTrainedModel, spec: ModelSpec, settings: Settings) -> PreTrainedModel:
    """`prepare`, with peft's refusals (a LoRA target the model lacks, ...) turned into a TrainError."""
    try:
        return prepare(model, spec, settings)
    except (ValueError, TypeError, KeyError) as error:
        what = f"cannot add LoRA adapters for --lora-targets {settings.lora_targets}"
        raise setup_error(spec, what, error) from None


def build_optimizer(
    model: PreTrainedModel,
    settings: Settings,
    *,
    fused: bool = True,
    learning_rate: float = 2e-4,
    weight_decay: float = 0.0,
    **overrides: Any,
) -> torch.optim.Optimizer:
    """The optimizer transformers.Trainer.create_optimizer builds for `settings.optimizer`.

    The name is the trainer's (`hf_args.optimizer_name`: AdamW fused unless `fused=False`); the class and
    arguments come from `Trainer.get_optimizer_cls_and_kwargs`; the parameters are split into decay / no-decay
    groups the way the Trainer splits them, and under an 8-bit bitsandbytes optimizer the embeddings keep
    32-bit state, as the Trainer registers them. `overrides` go to the optimizer (the trace passes
    foreach=True to run torch's CUDA default on CPU tensors)."""
    from torch import nn
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir="unused",
        optim=hf_args.optimizer_name(settings, fused),
        report_to=[],
        learning_rate=learning_rate,
        weight_decay=weight_decay,
    )
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    optimizer = optimizer_cls(groups, **(kwargs | overrides))
    if "bitsandbytes" in str(optimizer_cls):
        import bitsandbytes

        manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
        # The manager is process-wide and keys overrides by parameter id and (group, index): start clean, so a
        # model built earlier in this process (another trace) cannot hand its overrides to this one.
        manager.initialize()
        if kwargs.get("optim_bits") == 8:
            for module in model.modules():
                if isinstance(module, nn.Embedding):
                    manager.register_module_override(module, "weight", {"optim_bits": 32})
    return optimizer
