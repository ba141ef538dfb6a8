"""Where a model's `ModelSpec` (model_spec.py) comes from: the catalog, a hub id naming a preset or one of its
variants, a pre-quantised copy's name, or a config.json.

The spec's fields carry the names of the Hugging Face `config.json` keys, so a catalog entry and a local config
read the same way. The families lorafit models are data (catalog/architectures.toml): code asks a family's traits,
not its name. Families lorafit does not model are data too (catalog/models.toml, `[[unmodelled]]`), so asking for
one names the family and a stand-in instead of "not in the catalog".
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import math
import re
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lorafit import families, gemma4, mla, mllama
from lorafit import linear_attention as hybrid
from lorafit.errors import InvalidConfig, UnknownModel
from lorafit.families import Architecture, ArchitectureSpec
from lorafit.messages import say
from lorafit.model_spec import DIMENSION_LIMITS, ModelSpec, PreQuantized
from lorafit.vision import TEXT_ARCHITECTURE, TEXT_DEFAULTS, TIED_BY_DEFAULT, VisionTower, read_vision

# A config.json is a few kB; reading stops well past that, so a device or a huge file named by mistake is refused.
CONFIG_JSON_MAX_BYTES = 16 << 20


# --- loading ------------------------------------------------------------------------------------------------
class Variant(BaseModel):
    """A hub checkpoint with a preset's shapes; only its context length may differ from the preset's."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hf_id: str = Field(pattern=r"^[\w.-]+/[\w.-]+$")
    max_position_embeddings: int | None = Field(default=None, gt=0)


@dataclass(frozen=True)
class UnmodelledFamily:
    """A family the estimator has no terms for, how to recognise it, and the presets closest to it."""

    family: str
    model_types: tuple[str, ...]
    hub_patterns: tuple[str, ...]
    nearest: tuple[str, ...]

    def matches_hub_id(self, hub_id: str) -> bool:
        repo = repo_name(hub_id)
        return any(fnmatch.fnmatchcase(repo, pattern) for pattern in self.hub_patterns)

    def nearest_preset(self, hub_id: str | None = None) -> str:
        """The stand-in closest in size to the "4b" / "135m" in a hub id's name, else the first listed."""
        size = size_in_name(hub_id) if hub_id else None
        if size is None:
            return self.nearest[0]
        presets = catalog()
        return min(self.nearest, key=lambda name: abs(math.log(presets[name].num_params / size)))

    def refusal(self, name: str, model_type: str, hub_id: str | None = None) -> str:
        """The one-line reason, after `name` (the file or the model asked for): the family, its model_type, and
        the preset to estimate instead."""
        nearest = self.nearest_preset(hub_id)
        said = {"family": self.family, "model_type": model_type, "nearest": nearest, "setting_model": "--model"}
        return say("error.unmodelled", name=name, **said)


def repo_name(hub_id: str) -> str:
    """The lower-cased name after the owner (Qwen/Qwen2.5-7B-Instruct -> qwen2.5-7b-instruct), which a mirror
    under another owner keeps."""
    return hub_id.rsplit("/", 1)[-1].lower()


def size_in_name(hub_id: str) -> float | None:
    """The parameter count a hub id's name states ("gemma-3-4b-it" -> 4e9), or None. The first size wins, so
    an MoE's "30B-A3B" reads as its 30B total."""
    found = re.search(r"(?<![a-z0-9.])(\d+(?:\.\d+)?)([bm])(?![a-z])", repo_name(hub_id))
    if found is None:
        return None
    return float(found.group(1)) * (1e9 if found.group(2) == "b" else 1e6)


@cache
def _catalog_file() -> dict:
    text = resources.files("lorafit").joinpath("catalog/models.toml").read_text()
    return tomllib.loads(text)


@cache
def _presets_and_variants() -> tuple[dict[str, ModelSpec], dict[str, tuple[Variant, ...]]]:
    presets: dict[str, ModelSpec] = {}
    variants: dict[str, tuple[Variant, ...]] = {}
    for entry in _catalog_file()["model"]:
        entry = dict(entry)
        listed = entry.pop("variants", [])
        spec = ModelSpec.model_validate(entry)
        key = spec.name.lower()
        presets[key] = spec
        variants[key] = tuple(Variant(hf_id=v) if isinstance(v, str) else Variant.model_validate(v) for v in listed)
    return presets, variants


def catalog() -> dict[str, ModelSpec]:
    """Presets from catalog/models.toml, keyed by lower-case name."""
    return _presets_and_variants()[0]


def variants(name: str) -> tuple[str, ...]:
    """Hub ids of the checkpoints that share preset `name`'s shapes."""
    return tuple(variant.hf_id for variant in _presets_and_variants()[1][name.lower()])


@cache
def hub_index() -> dict[str, ModelSpec]:
    """Every hub id the catalog knows, lower-cased: the presets' own and their variants'. A variant resolves
    to its preset's shapes under its own name and hub id, with its own context length."""
    presets, all_variants = _presets_and_variants()
    index = {spec.hf_id.lower(): spec for spec in presets.values() if spec.hf_id}
    for key, listed in all_variants.items():
        preset = presets[key]
        for variant in listed:
            update: dict = {"name": repo_name(variant.hf_id), "hf_id": variant.hf_id, "variant_of": preset.name}
            if variant.max_position_embeddings is not None:
                update["max_position_embeddings"] = variant.max_position_embeddings
            index[variant.hf_id.lower()] = preset.model_copy(update=update)
    return index


@cache
def unmodelled_families() -> tuple[UnmodelledFamily, ...]:
    """The `[[unmodelled]]` table of catalog/models.toml."""
    return tuple(
        UnmodelledFamily(
            family=row["family"],
            model_types=tuple(row["model_types"]),
            hub_patterns=tuple(pattern.lower() for pattern in row["hub_patterns"]),
            nearest=tuple(row["nearest"]),
        )
        for row in _catalog_file().get("unmodelled", [])
    )


def unmodelled_model_type(model_type: object) -> UnmodelledFamily | None:
    return next((row for row in unmodelled_families() if model_type in row.model_types), None)


def from_config_json(path: Path, name: str | None = None) -> ModelSpec:
    """Read a Hugging Face config.json (or the directory holding one) into a ModelSpec."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise InvalidConfig(f"no config.json in {path}; pass a model directory or its config.json")
    config = read_config_json(file)
    quantization = config.get("quantization_config")
    prequantized = bitsandbytes_quantization(file, quantization)
    # an image-text model lorafit does not model is refused as a whole, before its text model is looked at
    for layer in (config, config.get("text_config")):
        if isinstance(layer, dict) and (family := unmodelled_model_type(layer.get("model_type"))):
            raise InvalidConfig(family.refusal(str(file), layer["model_type"]))
    vision = read_vision(config, file)
    cross = mllama.read_text_config(config, file)
    if vision is not None:
        spec = _image_text_spec(file, config, vision, name)
    elif cross is not None:  # Llama 3.2 Vision: the language model that AutoModelForCausalLM builds (mllama.py)
        spec = _text_spec(file, cross[0], "llama", name).model_copy(update={"cross_attention": cross[1]})
    else:
        config = config.get("text_config", config) if "hidden_size" not in config else config
        model_type = config.get("model_type")
        by_type = families.model_types()
        if model_type not in by_type:
            known = ", ".join(sorted(by_type))
            raise InvalidConfig(say("config.unsupported", file=file, model_type=model_type, known=known))
        spec = _text_spec(file, config, by_type[model_type], name)
    if prequantized is None:
        return spec
    kept = kept_16bit_params(spec, cast(dict, quantization).get("llm_int8_skip_modules") or [])
    return spec.model_copy(update={"prequantized": prequantized.model_copy(update={"kept_16bit_params": kept})})


def _image_text_spec(file: Path, config: dict[str, Any], vision: VisionTower, name: str | None) -> ModelSpec:
    """An image-text config.json: the language model from text_config (Qwen2.5-VL's first configs keep its keys
    at the top), tied as the outer config says, with the vision tower beside it."""
    text = config.get("text_config")
    text = dict(text) if isinstance(text, dict) else dict(config)
    text = TEXT_DEFAULTS.get(vision.family, {}) | {key: value for key, value in text.items() if value is not None}
    by_type, text_type = families.model_types(), text.get("model_type")
    if isinstance(text_type, str) and text_type in by_type:
        architecture = by_type[text_type]
    elif text_type in (None, vision.family, f"{vision.family}_text"):
        architecture = cast(Architecture, TEXT_ARCHITECTURE[vision.family])
    else:
        known = ", ".join(sorted(by_type))
        raise InvalidConfig(
            say("config.vision_text", file=file, family=vision.family, text_type=text_type, known=known)
        )
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", TIED_BY_DEFAULT[vision.family]))
    text["tie_word_embeddings"] = tied
    text["audio_config"] = config.get("audio_config")  # Gemma 4 E2B / E4B: an audio tower beside (gemma4.py)
    return _text_spec(file, text, architecture, name, vision)


def _text_spec(
    file: Path, config: dict[str, Any], architecture: Architecture, name: str | None, vision: VisionTower | None = None
) -> ModelSpec:
    arch = families.architectures()[architecture]
    fields = {
        key: config[key]
        for key in ModelSpec.model_fields
        if key in config and config[key] is not None and key not in ("name", "architecture", *NOT_CONFIG_KEYS)
    }
    fields.setdefault("num_key_value_heads", config.get("num_attention_heads"))
    fields.update(moe_fields(file, config, arch))
    fields.update(gemma4.config_fields(file, config, architecture == "gemma4"))
    fields.update(hybrid.config_fields(file, config, arch.name, arch.attention_output_gate))
    check_dimensions(file, fields)
    if arch.qkv_bias:
        fields["attention_bias"] = True  # Qwen2 always has q/k/v biases; its config has no key for it
    fields.setdefault("tie_word_embeddings", arch.tie_word_embeddings)
    try:
        return ModelSpec(name=name or file.parent.name or file.stem, architecture=architecture, vision=vision, **fields)
    except ValidationError as error:
        problem = error.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        raise InvalidConfig(f"{file}: {where}: {problem['msg']}") from None


# ModelSpec fields that are lorafit's own records, never read from a config.json key of the same name
NOT_CONFIG_KEYS = (
    "variant_of",
    "prequantized",
    "vision",
    "global_layers",
    "latent",
    "linear_attention",
    "cross_attention",
)


def bitsandbytes_quantization(file: Path, quantization: object) -> PreQuantized | None:
    """The bitsandbytes storage a config.json's `quantization_config` states (transformers writes it when a
    4/8-bit model is saved: `load_in_4bit`, `bnb_4bit_quant_type`, `bnb_4bit_use_double_quant`), or None for
    none or another method's (GPTQ, AWQ, MXFP4: not lorafit's to read here)."""
    if not isinstance(quantization, dict):
        return None
    if quantization.get("load_in_8bit"):
        return PreQuantized(quant="int8")
    if not quantization.get("load_in_4bit"):
        return None
    kind = quantization.get("bnb_4bit_quant_type", "fp4")  # BitsAndBytesConfig's default is fp4
    if kind not in ("nf4", "fp4"):
        raise InvalidConfig(say("config.quant_type", file=file, kind=kind))
    return PreQuantized(quant=kind, double_quant=quantization.get("bnb_4bit_use_double_quant") is True)


def kept_16bit_params(spec: ModelSpec, skip: object) -> int | None:
    """How many of the decoder's linear weights a 4-bit checkpoint keeps 16-bit: those of the modules its
    config.json's llm_int8_skip_modules names, matched as transformers matches them (quantizers_utils.py
    should_convert_module @ v5.25.0: a pattern, as a regular expression, that matches the module's dotted name
    from its start up to a dot or the end, or that the name ends with). None where lorafit cannot name every
    layer's modules (a hybrid, per-layer or cross-attention stack) or the list is not a list of names."""
    if not isinstance(skip, list) or not all(isinstance(pattern, str) for pattern in skip):
        return None
    if spec.vision or spec.linear_attention or spec.global_layers or spec.cross_attention or spec.latent:
        return None
    blocks = [("self_attn", spec.attention_linears())] + ([] if spec.is_moe else [("mlp", spec.mlp_linears())])

    def kept(module: str) -> bool:
        return any(_matches_at_start(pattern, module) or module.endswith(pattern) for pattern in skip)

    return sum(
        fan_in * fan_out
        for layer in range(spec.num_hidden_layers)
        for block, linears in blocks
        for name, (fan_in, fan_out) in linears.items()
        if kept(f"model.layers.{layer}.{block}.{name}")
    )


def _matches_at_start(pattern: str, module: str) -> bool:
    try:
        return re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module) is not None
    except re.error:
        return False


def moe_fields(file: Path, config: dict[str, Any], arch: ArchitectureSpec) -> dict[str, Any]:
    """The expert count under the family's own key (Qwen3-MoE's `num_experts`); a config whose MLP is dense in
    some layers (Qwen3-MoE's `mlp_only_layers`, `decoder_sparse_step` > 1) is refused: lorafit plans every layer
    as sparse, as every released Qwen3-MoE checkpoint is."""
    fields: dict[str, Any] = {}
    if arch.experts_key != "num_local_experts" and config.get(arch.experts_key) is not None:
        fields["num_local_experts"] = config[arch.experts_key]
    dense = config.get("mlp_only_layers") or []
    step = config.get("decoder_sparse_step", 1)
    if dense or step not in (1, None):
        raise InvalidConfig(say("config.dense_layers", file=file, dense=dense, step=step))
    return fields | mla.latent_fields(file, config, arch)


def read_config_json(file: Path) -> dict[str, Any]:
    """The JSON object in `file`, or one line saying why it cannot be read as a config.json."""
    try:
        with file.open("rb") as handle:
            raw = handle.read(CONFIG_JSON_MAX_BYTES + 1)
    except OSError as error:
        raise InvalidConfig(f"cannot read {file}: {error.strerror or error}") from None
    if len(raw) > CONFIG_JSON_MAX_BYTES:
        raise InvalidConfig(f"{file} is over {CONFIG_JSON_MAX_BYTES >> 20} MiB; a config.json is a few kB")
    try:
        config = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InvalidConfig(say("config.not_json", file=file, why=error)) from None
    except ValueError:  # Python refuses to read an integer of more than 4300 digits
        raise InvalidConfig(say("config.long_number", file=file)) from None
    except RecursionError:
        raise InvalidConfig(say("config.too_deep", file=file)) from None
    if not isinstance(config, dict):
        raise InvalidConfig(say("config.not_object", file=file))
    return config


def check_dimensions(file: Path, fields: dict[str, Any]) -> None:
    """Refuse a dimension that is not a whole number (`"hidden_size": "128"`, which transformers cannot build) or
    that is past what any real model has (`DIMENSION_LIMITS`), before anything is planned from it."""
    for key in ("tie_word_embeddings", "attention_bias", "norm_topk_prob"):
        if key in fields and type(fields[key]) is not bool:
            raise InvalidConfig(say("config.bool", file=file, key=key, value=json.dumps(fields[key])[:40]))
    for key, limit in DIMENSION_LIMITS.items():
        value = fields.get(key)
        if value is None:
            continue
        if type(value) is not int:
            raise InvalidConfig(say("config.whole", file=file, key=key, value=json.dumps(value)[:40]))
        if value > limit:
            digits = str(value)
            shown = digits if len(digits) <= 20 else f"{digits[:4]}... ({len(digits)} digits)"
            raise InvalidConfig(say("config.past", file=file, key=key, value=shown, limit=limit))


def resolve(model: str) -> ModelSpec:
    """A preset name, a hub id of a preset or of one of its variants (under any owner, as mirrors such as
    unsloth/... keep the repository name), a pre-quantised copy of one (`*-bnb-4bit`), or a local directory /
    config.json. Never downloads."""
    path = Path(model).expanduser()
    if path.exists():
        return from_config_json(path)
    key = model.strip().lower()
    spec = catalog_entry(key) or prequantized_copy(model.strip())
    if spec is not None:
        return spec
    for family in unmodelled_families():
        if family.matches_hub_id(key):
            raise UnknownModel(family.refusal(model, (*family.model_types, repo_name(key))[0], key))
    base = prequantized_base_name(key)
    what = say("model.copy_not_in_catalog", base=base) if base else say("model.not_in_catalog")
    hint = did_you_mean(base or key)
    raise UnknownModel(say("error.unknown_model", model=model, what=what, hint=hint, setting="--model"))


def catalog_entry(key: str) -> ModelSpec | None:
    """A preset by name, a hub id the catalog lists, or a mirror of either under another owner (the repository
    name, lower-cased: unsloth/llama-3-8b is the llama-3-8b preset)."""
    presets, index = catalog(), hub_index()
    if key in presets:
        return presets[key]
    if key in index:
        return index[key]
    by_repo_name = {repo_name(hub_id): spec for hub_id, spec in index.items()}
    return by_repo_name.get(repo_name(key)) or presets.get(repo_name(key))


# --- pre-quantised copies (a section of its own) ---------------------------------------------------------------
# The repository-name tags of bitsandbytes 4-bit copies, longest first: unsloth/registry/registry.py names
# BNB_QUANTIZED_TAG "bnb-4bit" and UNSLOTH_DYNAMIC_QUANT_TAG "unsloth-bnb-4bit" (its "dynamic 4-bit", which
# leaves a few modules 16-bit through llm_int8_skip_modules; counted here as all 4-bit unless the repo is in
# catalog/unsloth_dynamic.toml), and
# unsloth/models/mapper.py maps each such repo to its 16-bit original (unsloth/llama-3-8b-bnb-4bit ->
# meta-llama/Meta-Llama-3-8B, unsloth/Qwen3-8B-unsloth-bnb-4bit -> Qwen/Qwen3-8B;
# https://github.com/unslothai/unsloth/blob/015bdef0d94a241bcd94eec7a405b1700632180d, read 2026-12).
PREQUANTIZED_SUFFIXES = ("-unsloth-bnb-4bit", "-bnb-4bit")
# What those repos' config.json states: unsloth saves a 4-bit model with quantization_config
# {"load_in_4bit": true, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": true, ...} (unsloth/models/
# loader.py, and llama.py's BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True,
# bnb_4bit_quant_type="nf4"), same commit). A downloaded folder is read from its own config.json instead.
UNSLOTH_4BIT = PreQuantized(quant="nf4", double_quant=True)
# unsloth drops Meta's "Meta-" from some Llama 3 names (unsloth/llama-3-8b-Instruct-bnb-4bit is
# meta-llama/Meta-Llama-3-8B-Instruct in mapper.py): tried when the name alone is not in the catalog.
DROPPED_PREFIXES = ("meta-",)


def is_unsloth_dynamic_quant(name: str) -> bool:
    """An Unsloth "dynamic 4-bit" repo (`*-unsloth-bnb-4bit`): some modules stay 16-bit through its config.json's
    llm_int8_skip_modules, chosen per model (unsloth_zoo/vllm_utils.py @ ce232d6c reads them from each repo's
    config; vLLM PR 12974 quotes one: DeepSeek-R1-Distill-Llama-8B's keeps lm_head and model.layers.1.mlp)."""
    return name.lower().endswith(PREQUANTIZED_SUFFIXES[0])


def prequantized_base_name(key: str) -> str | None:
    """The repository name a `*-bnb-4bit` / `*-unsloth-bnb-4bit` name is a copy of, or None for another name."""
    suffix = next((tag for tag in PREQUANTIZED_SUFFIXES if key.lower().endswith(tag)), None)
    return repo_name(key[: -len(suffix)]) if suffix else None


def prequantized_copy(model: str) -> ModelSpec | None:
    """A `*-bnb-4bit` / `*-unsloth-bnb-4bit` repo as its base preset's shapes, recorded as stored NF4 with
    double quantisation; None for another name or a base the catalog does not have."""
    name = prequantized_base_name(model)
    if name is None:
        return None
    base = next(filter(None, (catalog_entry(prefix + name) for prefix in ("", *DROPPED_PREFIXES))), None)
    if base is None:
        return None
    kept = {repo.lower(): n for repo, n in unsloth_dynamic_kept().items()}.get(model.lower())  # None: not known
    update = {
        "name": repo_name(model),
        "hf_id": model if "/" in model else None,
        "variant_of": base.variant_of or base.name,
        "prequantized": UNSLOTH_4BIT.model_copy(update={"base": base.hf_id, "kept_16bit_params": kept}),
    }
    return base.model_copy(update=update)


@cache
def unsloth_dynamic_kept() -> dict[str, int]:
    """catalog/unsloth_dynamic.toml: the weights each catalogued dynamic 4-bit repo of Unsloth's keeps 16-bit, by
    its hub id (measured from Unsloth's notebooks' loading; the file says how)."""
    text = resources.files("lorafit").joinpath("catalog/unsloth_dynamic.toml").read_text()
    return {repo: entry["kept_16bit_params"] for repo, entry in tomllib.loads(text).items()}


@cache
def unsloth_dynamic_copies() -> dict[str, ModelSpec]:
    """Each catalogued dynamic 4-bit repo as a spec, by the repository name of the 16-bit model it copies: its
    mapper maps a model to its `*-unsloth-bnb-4bit` copy, which keeps that name (prequantized_base_name)."""
    copies = {prequantized_base_name(repo): prequantized_copy(repo) for repo in unsloth_dynamic_kept()}
    return {base: copy for base, copy in copies.items() if base and copy}


def unsloth_dynamic_copy(spec: ModelSpec) -> ModelSpec | None:
    """The catalogued dynamic 4-bit repo Unsloth loads for this 16-bit model with load_in_4bit, as a spec; None
    where the catalog has none, or for a checkpoint that is pre-quantised already."""
    if spec.prequantized is not None:
        return None
    return unsloth_dynamic_copies().get(repo_name(spec.hf_id or spec.name))


def did_you_mean(key: str) -> str:
    """Up to three known names: those that extend what was typed ("llama-3.3-70b" -> "...-instruct") first,
    then the closest spellings."""
    names = dict.fromkeys([*catalog(), *(repo_name(hub_id) for hub_id in hub_index())])
    typed = repo_name(key)
    extending = [name for name in names if name.startswith(typed) and name != typed]
    close = difflib.get_close_matches(typed, list(names), n=3, cutoff=0.4)
    picked = list(dict.fromkeys(extending[:3] + close))[:3]
    return say("model.did_you_mean", names=", ".join(picked)) if picked else ""
