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
from lorafit.families import architectures, model_types
from lorafit.train import runfolder
from lorafit.train.chat import base_dir_of, check_folder, run_folder

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
    # per-expert base tensor -> (fused parameter, expert, part, experts): transformers saves Qwen3-MoE's and
    # Mixtral's fused experts as experts.N.gate_proj / up_proj / down_proj (part 0 / 1 the halves of gate_up)
    expert_slices: dict[str, tuple[str, int, int, int]] = field(default_factory=dict)
    # base tensor name -> its trained copy in adapter_model.safetensors (modules_to_save: lorafit's
    # train_embeddings), which replaces the base tensor in a merge
    saved: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RunSource:
    run_dir: Path
    model_dir: Path  # the 16-bit base for an adapter; the run folder itself for a full fine-tune
    adapter: Adapter | None
    tokenizer_dir: Path  # the run's tokenizer (with the chat template it trained with), else the base's
    quantized_base: bool  # the base is stored quantised: the merge dequantises it

    @property
    def experts_transposed(self) -> bool:
        """The base stores its fused experts as experts x in x out (gpt-oss), not experts x out x in."""
        try:
            model_type = json.loads((self.model_dir / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            return False
        family = model_types().get(model_type)
        return family is not None and architectures()[family].experts_transposed

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
    saved: dict[str, str] = {}
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    for name in header:
        if ".lora_A." not in name:
            if ".lora_B." not in name:
                saved[saved_module(name, config)] = name
            continue
        module = name.split(".lora_A.")[0].removeprefix(PEFT_PREFIX)
        b_name = name.replace(".lora_A.", ".lora_B.")
        if b_name not in header:
            raise ExportError(f"{weights}: {name} has no matching lora_B tensor")
        base_name = target_parameter(module, config.get("target_parameters") or []) or module + ".weight"
        pairs[base_name] = (name, b_name)
        short = module.split(".")[-1]
        rank = next((v for k, v in rank_pattern.items() if module.endswith(k) or short == k), r)
        module_alpha = next((v for k, v in alpha_pattern.items() if module.endswith(k) or short == k), alpha)
        scales[base_name] = module_alpha / (rank**0.5 if config.get("use_rslora") else rank)
    if not pairs:
        raise ExportError(f"{weights} holds no LoRA tensors")
    shapes = {name: tuple(entry["shape"]) for name, entry in header.items()}
    return Adapter(weights, config, pairs, scales, shapes, saved=saved)


def saved_module(name: str, config: dict[str, Any]) -> str:
    """The base tensor a fully trained copy replaces: peft saves a modules_to_save module's copy under the
    module's own name. Any other tensor is refused."""
    base = name.removeprefix(PEFT_PREFIX)
    module = base.rsplit(".", 1)[0]
    if not any(module == kept or module.endswith("." + kept) for kept in config.get("modules_to_save") or []):
        raise ExportError(
            f"tensor {name} is not a LoRA A/B matrix nor a module of modules_to_save (embedding adapters are not "
            "merged by lorafit)"
        )
    return base


def target_parameter(module: str, targets: list[str]) -> str | None:
    """The parameter a `target_parameters` adapter (an MoE's fused experts) adapts, or None for a module's
    weight. peft nests one ParamWrapper per parameter in the order the module registers its parameters
    (transformers' experts: gate_up_proj, then down_proj), the last outermost: `mlp.experts.lora_A` adapts
    down_proj, `mlp.experts.base_layer.lora_A` gate_up_proj. The adapter_config's list is a set's order, so it
    is put in the module's order first (EXPERT_PARAMETER_ORDER)."""
    depth = 0
    while module.endswith(".base_layer"):
        module, depth = module.removesuffix(".base_layer"), depth + 1
    listed = [target.rsplit(".", 1) for target in targets]
    names = [name for owner, name in listed if module == owner or module.endswith("." + owner)]
    names.sort(key=lambda name: EXPERT_PARAMETER_ORDER.get(name, len(EXPERT_PARAMETER_ORDER)))
    return f"{module}.{names[-1 - depth]}" if depth < len(names) else None


# The order transformers' fused experts register their parameters (Qwen3MoeExperts, MixtralExperts, GptOssExperts
# @ v5.25.0: gate_up_proj before down_proj), which is peft's nesting order.
EXPERT_PARAMETER_ORDER = {"gate_up_proj": 0, "down_proj": 1}


def lora_delta_shape(a_shape: tuple[int, ...], b_shape: tuple[int, ...], base: tuple[int, ...]) -> tuple[int, ...]:
    """The shape B @ A fills: out x in for a Linear; for a 3-D expert parameter (experts x out x in, or
    experts x in x out where transformers stores it transposed, as gpt-oss) the base's own."""
    out_features, in_features = b_shape[0], a_shape[1]
    if len(base) == 3 and set(base[1:]) == {out_features, in_features}:
        return base
    return (out_features, in_features)


EXPERT_PARTS = {"gate_up_proj": (("gate_proj", 0), ("up_proj", 1)), "down_proj": (("down_proj", -1),)}
# The layouts transformers 5.25 saves fused experts in, one tensor per expert and part: (the experts' module path
# as loaded -> as saved, the parts) - the inverse of conversion_mapping.py's "qwen2_moe" (which Qwen3-MoE uses) and
# "mixtral" (block_sparse_moe renamed to mlp, w1 and w3 concatenated into gate_up_proj, w2 into down_proj).
SAVED_EXPERTS: tuple[tuple[tuple[str, str], dict[str, tuple[tuple[str, int], ...]]], ...] = (
    ((".mlp.experts", ".mlp.experts"), EXPERT_PARTS),
    (
        (".mlp.experts", ".block_sparse_moe.experts"),
        {"gate_up_proj": (("w1", 0), ("w3", 1)), "down_proj": (("w2", -1),)},
    ),
)


def per_expert_tensors(adapter: Adapter, base_shapes: dict[str, tuple[int, ...]]) -> Adapter:
    """An adapter of fused experts re-keyed to the per-expert tensors the base is saved as, where it is."""
    pairs, scales, slices = dict(adapter.pairs), dict(adapter.scales), dict(adapter.expert_slices)
    for fused, pair in adapter.pairs.items():
        loaded_owner, name = fused.rsplit(".", 1)
        if fused in base_shapes or name not in EXPERT_PARTS:
            continue
        for (loaded, saved_path), parts in SAVED_EXPERTS:
            if not loaded_owner.endswith(loaded):
                continue
            owner = loaded_owner.removesuffix(loaded) + saved_path
            suffix = f".{parts[name][0][0]}.weight"
            experts = sum(
                tensor.startswith(owner + ".")
                and tensor.endswith(suffix)
                and tensor[len(owner) + 1 : -len(suffix)].isdigit()
                for tensor in base_shapes
            )
            for expert in range(experts):
                for saved, part in parts[name]:
                    tensor = f"{owner}.{expert}.{saved}.weight"
                    pairs[tensor], scales[tensor] = pair, scales[fused]
                    slices[tensor] = (fused, expert, part, experts)
        if any(value[0] == fused for value in slices.values()):
            del pairs[fused], scales[fused]
    return Adapter(adapter.path, adapter.config, pairs, scales, adapter.shapes, slices, saved=adapter.saved)


# An image-text model's language model as transformers 5.25 loads it (the names an adapter uses) -> as it saves
# it: the inverse of the load-time renames in transformers/conversion_mapping.py ("llava", which Gemma 3 and
# Mistral 3 use; "Qwen2VLForConditionalGeneration", which Qwen2.5-VL uses).
SAVED_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "language_model.model."),  # Gemma 3, Mistral 3
    ("lm_head.", "language_model.lm_head."),
    ("model.language_model.", "model."),  # Qwen2-VL, Qwen2.5-VL
    # Llama 3.2 Vision, loaded as MllamaForCausalLM: the checkpoint's `language_model.` prefix is its
    # base_model_prefix, stripped on load (modeling_mllama.py:1170); lm_head is the pair above
    ("model.", "language_model.model."),
)


def saved_names(adapter: Adapter, base_shapes: dict[str, tuple[int, ...]]) -> Adapter:
    """An adapter of an image-text model re-keyed to the names its base is saved under, where they differ."""
    pairs, scales = {}, {}
    for name, pair in adapter.pairs.items():
        saved = name
        if name not in base_shapes:
            renamed = (
                stored + name.removeprefix(loaded) for loaded, stored in SAVED_PREFIXES if name.startswith(loaded)
            )
            saved = next((candidate for candidate in renamed if candidate in base_shapes), name)
        pairs[saved], scales[saved] = pair, adapter.scales[name]
    return Adapter(
        adapter.path, adapter.config, pairs, scales, adapter.shapes, adapter.expert_slices, saved=adapter.saved
    )


def check_shapes(adapter: Adapter, base_shapes: dict[str, tuple[int, ...]], base_dir: Path) -> None:
    """Every adapted weight exists in the base with the shape B @ A has: another model under the same path fails."""
    for base_name, (a_name, b_name) in adapter.pairs.items():
        if base_name not in base_shapes:
            raise ExportError(
                f"the adapter adapts {base_name}, which the base model in {base_dir} does not have: "
                "it was trained on another model"
            )
        expected = lora_delta_shape(adapter.shapes[a_name], adapter.shapes[b_name], base_shapes[base_name])
        if base_name in adapter.expert_slices:  # one expert's (half of a) slice of the fused delta
            _, _, part, _ = adapter.expert_slices[base_name]
            expected = (expected[0] // (1 if part < 0 else 2), expected[1])
        if base_shapes[base_name] != expected:
            raise ExportError(
                f"the base model in {base_dir} differs from the one the adapter was trained on: {base_name} is "
                f"{list(base_shapes[base_name])}, the adapter expects {list(expected)}"
            )
    for base_name, copy in adapter.saved.items():  # a tied head's copy has no tensor of its own in the base
        if base_name in base_shapes and base_shapes[base_name] != adapter.shapes[copy]:
            raise ExportError(
                f"the base model in {base_dir} differs from the one the adapter was trained on: {base_name} is "
                f"{list(base_shapes[base_name])}, the adapter's trained copy {list(adapter.shapes[copy])}"
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
    adapter = read_adapter(run_dir)
    recorded = (runfolder.read_run_file(run_folder(run_dir)) or {}).get("base_digest")
    if recorded and recorded != runfolder.model_digest(base_dir):
        raise ExportError(
            f"the base model in {base_dir} is not the one this run trained on (its config or weights changed "
            "since): restore that model, or train again on this one"
        )
    quantized = _quantized(base_dir)
    if not quantized:  # packed 4-bit tensors have other shapes; the dequantising merge checks those
        shapes = tensor_shapes(base_dir)
        adapter = saved_names(per_expert_tensors(adapter, shapes), shapes)
        check_shapes(adapter, shapes, base_dir)
    return RunSource(run_dir, base_dir, adapter, tokenizer_dir or base_dir, quantized)


def _quantized(model_dir: Path) -> bool:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        raise ExportError(f"{model_dir} has no readable config.json") from None
    return bool(config.get("quantization_config"))
