"""A base model's folder, checked before a run writes anything: config.json, the tokenizer files and the
weights' headers.

transformers loads some broken folders without a word (a tensor missing from the weights is initialised at
random, and its warning is among the library noise lorafit silences) and fails on others deep inside a run
with its own text ('florp', "look at the above report" with the report silenced). Each problem here is one
line that names the file and what is wrong. The weights are read by their headers (names, dtypes, shapes), in
milliseconds; the tensors the model needs come from the model built on the meta device, which holds no memory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lorafit.errors import TrainError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
UNQUANTISED_DTYPES = {"F64", "F32", "F16", "BF16"}
TOKENIZER_JSON_FILES = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json")
SHOWN = 3  # tensor names quoted in one line
# The share of the tensors the model needs that the weights must hold under the same names before the rest
# are called missing: a checkpoint whose names transformers converts on load (fused experts, a multimodal
# prefix) matches few names exactly, and is left to transformers.
SAME_NAMING = 0.9


def check(model_dir: Path) -> None:
    """Refuse what transformers would load wrongly or fail on late: unreadable tokenizer files, a tokenizer
    class it does not know with no tokenizer.json to fall back on, weights that are cut short, a
    quantization_config over 16-bit weights, a config it cannot build, and tensors missing or of another shape."""
    check_tokenizer(model_dir)
    headers = weight_headers(model_dir)
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return  # the model catalog reports an unreadable config (`models.from_config_json`)
    if not isinstance(config, dict) or not headers:
        return
    check_quantization(model_dir, config, headers)
    check_tensors(model_dir, config, headers)


# --- tokenizer ----------------------------------------------------------------------------------------------
def check_tokenizer(model_dir: Path) -> None:
    """The tokenizer's JSON files parse, and a tokenizer class transformers does not know has tokenizer.json
    beside it (which transformers then loads)."""
    for file_name in TOKENIZER_JSON_FILES:
        _read_json(model_dir / file_name)
    settings = _read_json(model_dir / "tokenizer_config.json")
    name = settings.get("tokenizer_class") if isinstance(settings, dict) else None
    if not isinstance(name, str) or (model_dir / "tokenizer.json").is_file() or settings.get("auto_map"):
        return
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    if tokenizer_class_from_name(name) is None:
        raise TrainError(
            f"{model_dir / 'tokenizer_config.json'} names tokenizer_class {name!r}, which transformers does not "
            "know, and there is no tokenizer.json to load instead; restore the model's tokenizer files"
        )


# --- weights ------------------------------------------------------------------------------------------------
def weight_headers(model_dir: Path) -> dict[Path, dict[str, Any]]:
    """The tensor table of each safetensors file transformers would load (the index's shards, or
    model.safetensors); none for a folder with other weights (pickled .bin: their names need a load)."""
    index = model_dir / INDEX
    if index.is_file():
        weight_map = _read_json(index).get("weight_map") if isinstance(_read_json(index), dict) else None
        if not isinstance(weight_map, dict):
            raise TrainError(f"{index} has no weight_map of tensor names to files; restore it")
        files = [model_dir / name for name in sorted(set(map(str, weight_map.values())))]
        absent = [path.name for path in files if not path.is_file()]
        if absent:
            raise TrainError(f"{model_dir} is missing {', '.join(absent[:SHOWN])}, which {INDEX} names; restore it")
    elif (model_dir / SINGLE).is_file():
        files = [model_dir / SINGLE]
    else:
        return {}
    return {path: read_header(path) for path in files}


def read_header(path: Path) -> dict[str, Any]:
    """The tensors of a safetensors file (name -> dtype, shape, data_offsets), refused if the file is shorter
    than its header says."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else 0
            if length < 2 or 8 + length > size:
                raise TrainError(f"{path} is not a complete safetensors file (its header is cut short); restore it")
            header = json.loads(handle.read(length))
        tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
        end = max((int(entry["data_offsets"][1]) for entry in tensors.values()), default=0)
    except OSError as error:
        raise TrainError(f"cannot read {path}: {error.strerror or error}") from None
    except (ValueError, UnicodeDecodeError, AttributeError, KeyError, TypeError, IndexError):
        raise TrainError(f"{path} is not a safetensors file (its header cannot be read); restore it") from None
    if 8 + length + end > size:
        raise TrainError(
            f"{path} is cut short: its tensors need {8 + length + end:,} bytes, the file holds {size:,}; restore it"
        )
    return tensors


def check_quantization(model_dir: Path, config: dict[str, Any], headers: dict[Path, dict[str, Any]]) -> None:
    """A quantization_config over 16/32-bit weights makes transformers take the weights as quantised ones."""
    quantization = config.get("quantization_config")
    if not isinstance(quantization, dict):
        return
    dtypes = {str(entry.get("dtype")) for tensors in headers.values() for entry in tensors.values()}
    if dtypes <= UNQUANTISED_DTYPES:
        method = quantization.get("quant_method", "unnamed")
        raise TrainError(
            f"{model_dir / 'config.json'} has a quantization_config ({method}) but the weights are unquantised "
            f"({', '.join(sorted(dtypes))}); remove quantization_config from config.json (--method qlora "
            "quantises the base itself)"
        )


def check_tensors(model_dir: Path, config: dict[str, Any], headers: dict[Path, dict[str, Any]]) -> None:
    """Every tensor the model needs is in the weights, with the shape the config gives it."""
    needed = needed_tensors(model_dir, config)
    if needed is None:
        return
    present = {name: entry for tensors in headers.values() for name, entry in tensors.items()}
    names = {name for group in needed for name in group}
    if len(names & present.keys()) < SAME_NAMING * len(names):
        return  # names transformers converts on load: its own check applies
    missing = [group[0] for group in needed if not any(name in present for name in group)]
    if missing:
        shown = ", ".join(missing[:SHOWN]) + (f" and {len(missing) - SHOWN} more" if len(missing) > SHOWN else "")
        raise TrainError(
            f"{model_dir} lacks tensor{'s' if len(missing) > 1 else ''} {shown} in its weights (transformers would "
            f"start {'them' if len(missing) > 1 else 'it'} from random values); restore the complete model files"
        )
    if isinstance(config.get("quantization_config"), dict):
        return  # quantised weights are stored packed, in other shapes
    for group, shape in needed.items():
        for name in group:
            if name in present and list(present[name].get("shape", [])) != shape:
                raise TrainError(
                    f"{model_dir}: tensor {name} has shape {present[name].get('shape')} in the weights, but "
                    f"config.json makes it {shape}; the weights and config.json are of different models"
                )


def auto_model_class(model_type: object) -> Any:
    """transformers' auto class that builds a model_type for training on text: AutoModelForCausalLM, or, for an
    image-text model that has no causal-LM entry (Mistral 3, Qwen2.5-VL), AutoModelForImageTextToText, whose
    class (Mistral3ForConditionalGeneration, ...) trains on text rows alone. Gemma 3 is in both tables, as the same
    Gemma3ForConditionalGeneration."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def config_model_type(model_dir: Path) -> object:
    """The model_type of a folder's config.json (None where it cannot be read: the loader then says why)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def needed_tensors(model_dir: Path, data: dict[str, Any]) -> dict[tuple[str, ...], list[int]] | None:
    """The tensors the model of config.json (`data`) loads, names that share one tensor (tied embeddings)
    together, with their shapes, from the model built on the meta device. None for a model type transformers
    does not know (the catalog says so in its words) or one that brings its own code."""
    import torch
    from transformers import CONFIG_MAPPING, AutoConfig

    if data.get("model_type") not in CONFIG_MAPPING or "auto_map" in data:
        return None
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the meta model is built in full precision
        with torch.device("meta"):
            model = auto_model_class(data.get("model_type")).from_config(config)
    except (ValueError, KeyError, AttributeError, TypeError, AssertionError, OSError) as error:
        raise TrainError(
            f"{model_dir / 'config.json'}: transformers cannot build this model: {_reason(error)}"
        ) from None
    ignored = getattr(model, "_keys_to_ignore_on_load_missing", None) or []
    groups: dict[int, list[str]] = {}
    shapes: dict[int, list[int]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if any(_matches(pattern, name) for pattern in ignored):
            continue
        groups.setdefault(id(tensor), []).append(name)
        shapes[id(tensor)] = list(tensor.shape)
    return {tuple(names): shapes[key] for key, names in groups.items()}


def _matches(pattern: str, name: str) -> bool:
    import re

    return re.search(pattern, name) is not None


def _reason(error: BaseException) -> str:
    if isinstance(error, KeyError):
        return f"it names {error.args[0]!r}, which this transformers does not know"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _read_json(path: Path) -> Any:
    """A JSON file of the model folder, refused in one line naming it when it does not parse."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except OSError as error:
        raise TrainError(f"cannot read {path}: {error.strerror or error}") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise TrainError(f"{path} is not valid JSON ({error}); restore the model's file") from None
