"""What an export starts from: a run folder (or one of its checkpoints), the adapter in it and the base it was
trained against - found, and checked to belong together, before anything is read in bulk or written.

A QLoRA run trains on a 4-bit copy the trainer makes from the 16-bit base at load time; the adapter names that
16-bit folder, so the merge goes into the original weights, never into dequantised NF4 ones. Only a base that
is stored quantised (a `quantization_config` in its config.json) has no 16-bit weights to merge into.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafit.errors import ExportError, LorafitError
from lorafit.train import runfolder
from lorafit.train.chat import base_dir_of, check_folder, run_folder
from lorafit.vision import IMAGE_TEXT_FAMILIES

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter as peft saved it: per base weight name, the A and B tensor names and the scale of B @ A."""

    path: Path
    config: dict[str, Any]
    pairs: dict[str, tuple[str, str]]  # base tensor name -> (lora_A name, lora_B name) in adapter_model.safetensors
    scales: dict[str, float]  # base tensor name -> alpha / r (or alpha / sqrt(r) for rsLoRA)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class RunSource:
    run_dir: Path
    model_dir: Path  # the 16-bit base for an adapter; the run folder itself for a full fine-tune
    adapter: Adapter | None
    tokenizer_dir: Path  # the run's tokenizer (with the chat template it trained with), else the base's
    quantized_base: bool  # the base is stored quantised: the merge dequantises it

    @property
    def folders(self) -> dict[Path, str]:
        """The folders an export reads from, which its output must never replace, each said in words."""
        named = {self.tokenizer_dir: f"the tokenizer it reads ({self.tokenizer_dir})"}
        named[self.model_dir] = f"the base model ({self.model_dir})"
        named[run_folder(self.run_dir)] = f"the run ({run_folder(self.run_dir)})"
        return named | {self.run_dir: f"the run being exported ({self.run_dir})"}


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file: per tensor its dtype, shape and byte offsets (read, not loaded)."""
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > 100 * 2**20:
                raise ValueError("header too long")
            header = json.loads(handle.read(length))
    except (OSError, ValueError, struct.error) as error:
        raise ExportError(f"{path} is not a readable safetensors file ({error})") from None
    header.pop("__metadata__", None)
    return header


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors shards of a model folder, in the order of its index (or the single file)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError):
            raise ExportError(f"{index} is not a readable safetensors index") from None
        files = [model_dir / name for name in names]
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            raise ExportError(f"{model_dir} is missing shards its index names: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ExportError(f"{model_dir} has no model.safetensors (nor an index of shards)")


def tensor_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    return {
        name: tuple(entry["shape"])
        for path in weight_files(model_dir)
        for name, entry in safetensors_header(path).items()
    }


def read_adapter(run_dir: Path) -> Adapter:
    """The adapter's tensors paired per base weight, with the scale peft applies (rank and alpha patterns too)."""
    config_path = run_dir / "adapter_config.json"
    weights = run_dir / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise ExportError(f"{run_dir} has {config_path.name} but no {ADAPTER_WEIGHTS}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        raise ExportError(f"{config_path} is not readable JSON") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ExportError(f"{config_path}: a {config.get('peft_type')} adapter; lorafit merges LoRA adapters")
    if config.get("use_dora"):
        raise ExportError(f"{config_path}: a DoRA adapter; lorafit merges plain LoRA adapters")
    header = safetensors_header(weights)
    pairs: dict[str, tuple[str, str]] = {}
    scales: dict[str, float] = {}
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    for name in header:
        if ".lora_A." not in name:
            if ".lora_B." not in name:
                raise ExportError(
                    f"{weights}: tensor {name} is not a LoRA A/B matrix (embedding adapters and modules_to_save "
                    "are not merged by lorafit)"
                )
            continue
        module = name.split(".lora_A.")[0].removeprefix(PEFT_PREFIX)
        b_name = name.replace(".lora_A.", ".lora_B.")
        if b_name not in header:
            raise ExportError(f"{weights}: {name} has no matching lora_B tensor")
        base_name = module + ".weight"
        pairs[base_name] = (name, b_name)
        short = module.split(".")[-1]
        rank = next((v for k, v in rank_pattern.items() if module.endswith(k) or short == k), r)
        module_alpha = next((v for k, v in alpha_pattern.items() if module.endswith(k) or short == k), alpha)
        scales[base_name] = module_alpha / (rank**0.5 if config.get("use_rslora") else rank)
    if not pairs:
        raise ExportError(f"{weights} holds no LoRA tensors")
    shapes = {name: tuple(entry["shape"]) for name, entry in header.items()}
    return Adapter(weights, config, pairs, scales, shapes)


def check_shapes(adapter: Adapter, base_shapes: dict[str, tuple[int, ...]], base_dir: Path) -> None:
    """Every adapted weight exists in the base with the shape B @ A has: another model under the same path fails."""
    for base_name, (a_name, b_name) in adapter.pairs.items():
        if base_name not in base_shapes:
            raise ExportError(
                f"the adapter adapts {base_name}, which the base model in {base_dir} does not have: "
                "it was trained on another model"
            )
        expected = (adapter.shapes[b_name][0], adapter.shapes[a_name][1])
        if base_shapes[base_name] != expected:
            raise ExportError(
                f"the base model in {base_dir} differs from the one the adapter was trained on: {base_name} is "
                f"{list(base_shapes[base_name])}, the adapter expects {list(expected)}"
            )


def open_run(run_dir: Path) -> RunSource:
    """The run, its adapter and its base, checked: the folder is a run, the base is there and is the same model
    (the digest the run recorded, else the shapes), the weights are safetensors."""
    run_dir = Path(run_dir).expanduser()
    if not run_dir.exists():
        raise ExportError(f"no run folder {run_dir}")
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir} is a file, not a run folder")
    try:
        adapter_config = check_folder(run_dir)
    except LorafitError as error:
        raise ExportError(str(error)) from None
    tokenizer_dir = next(
        (
            folder
            for folder in (run_dir, run_folder(run_dir))
            if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()
        ),
        None,
    )
    if adapter_config is None:  # a full fine-tune: the run folder is the model
        weight_files(run_dir)
        return RunSource(run_dir, run_dir, None, tokenizer_dir or run_dir, _quantized(run_dir))
    try:
        base_dir = base_dir_of(adapter_config)
    except LorafitError as error:
        raise ExportError(str(error)) from None
    _refuse_image_text(base_dir, run_dir)
    adapter = read_adapter(run_dir)
    recorded = (runfolder.read_run_file(run_folder(run_dir)) or {}).get("base_digest")
    if recorded and recorded != runfolder.model_digest(base_dir):
        raise ExportError(
            f"the base model in {base_dir} is not the one this run trained on (its config or weights changed "
            "since): restore that model, or train again on this one"
        )
    quantized = _quantized(base_dir)
    if not quantized:  # packed 4-bit tensors have other shapes; the dequantising merge checks those
        check_shapes(adapter, tensor_shapes(base_dir), base_dir)
    return RunSource(run_dir, base_dir, adapter, tokenizer_dir or base_dir, quantized)


def _refuse_image_text(base_dir: Path, run_dir: Path) -> None:
    """An image-text base (Gemma 3, Mistral Small 3.x, Qwen2.5-VL): transformers saves it under another key layout
    than the modules the adapter names (language_model.model.* for model.language_model.*), which lorafit's merge
    does not translate, and lorafit's GGUF writer has none of these families; peft and llama.cpp do both."""
    try:
        model_type = json.loads((base_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # _quantized says why the config cannot be read
    if model_type in IMAGE_TEXT_FAMILIES:
        raise ExportError(
            f"lorafit cannot export runs on an image-text model ({model_type}) yet; the adapter in {run_dir} "
            "loads with peft (PeftModel.from_pretrained on AutoModelForImageTextToText, then merge_and_unload and "
            "save_pretrained), and llama.cpp's convert_hf_to_gguf.py converts that merged folder"
        )


def _quantized(model_dir: Path) -> bool:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        raise ExportError(f"{model_dir} has no readable config.json") from None
    return bool(config.get("quantization_config"))
