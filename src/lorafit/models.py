"""Model architectures: one `ModelSpec` per model, from the catalog, a hub id naming a preset or one of its
variants, or a config.json.

The fields carry the names of the Hugging Face `config.json` keys, so a catalog entry and a local config read
the same way. Parameter counts are computed from the shapes of the real modules (tested against published
counts). The families lorafit models are data (catalog/architectures.toml): code asks a family's traits, not its
name. Families lorafit does not model are data too (catalog/models.toml, `[[unmodelled]]`), so asking for
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
from functools import cache, lru_cache, wraps
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError

from lorafit import families, gemma4, mla, mllama
from lorafit import linear_attention as hybrid
from lorafit.errors import InvalidConfig, UnknownModel
from lorafit.families import Architecture, ArchitectureSpec, known_architecture
from lorafit.messages import say
from lorafit.vision import TEXT_ARCHITECTURE, TEXT_DEFAULTS, TIED_BY_DEFAULT, VisionTower, read_vision

LoraTargets = Literal["all", "attn", "qv", "experts"]

# The largest value of each dimension that lorafit plans, several times what any released model has (Llama 3.1
# 405B: 126 layers, hidden 16384, intermediate 53248, 128 heads; Gemma 3: vocabulary 262208, head_dim 256; Kimi K2:
# 384 experts, 8 per token; Llama 4 Scout: a 10M-token context). A config.json past them is a mistake or an attack:
# a billion layers would take the planner minutes and gigabytes before it said anything.
DIMENSION_LIMITS: dict[str, int] = {
    "num_hidden_layers": 1024,
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 18,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 4096,
    "vocab_size": 1 << 21,
    "max_position_embeddings": 1 << 26,
    "num_local_experts": 4096,
    "num_experts_per_tok": 4096,
    "moe_intermediate_size": 1 << 18,
}
# A config.json is a few kB; reading stops well past that, so a device or a huge file named by mistake is refused.
CONFIG_JSON_MAX_BYTES = 16 << 20


# The planner asks the same spec for its shapes thousands of times a plan; a spec is frozen (and hashable), so its
# derived counts are memoised by value (not on the instance, which `model_copy` would carry over stale).
@lru_cache(maxsize=4096)
def _memoised(method: Any, spec: ModelSpec, args: tuple[Any, ...]) -> Any:
    return method(spec, *args)


def memoised(method: Any) -> Any:
    @wraps(method)
    def by_value(self: ModelSpec, *args: Any) -> Any:
        return _memoised(method, self, args)

    return by_value


class PreQuantized(BaseModel):
    """A checkpoint whose weights are stored already quantised by bitsandbytes (unsloth's `*-bnb-4bit` repos, a
    folder saved from a 4-bit model): its base is frozen in that form, so only QLoRA over it trains it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    quant: Literal["nf4", "fp4", "int8"]  # fp4: bitsandbytes' default 4-bit type, which lorafit does not train
    double_quant: bool = False
    base: str | None = Field(default=None, description="the 16-bit checkpoint that LoRA or full fine-tuning needs")

    def refusal(self, name: str, what: str) -> str:
        """One line: why `what` cannot train this checkpoint, and what would."""
        instead = say("plan.base_named", base=self.base) if self.base else say("model.base_unnamed")
        bits = 4 if self.quant == "nf4" else 8
        said = {"setting_method": "--method", "setting_quant": "--quant", "quant": self.quant, "base": instead}
        return say("error.prequantized", what=what, model=name, bits=bits, **said)


class ModelSpec(BaseModel):
    """The shape of a decoder-only transformer, as its config.json states it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    architecture: Annotated[Architecture, PlainValidator(known_architecture)]
    hf_id: str | None = None
    hidden_size: int = Field(gt=0, le=DIMENSION_LIMITS["hidden_size"])
    intermediate_size: int = Field(gt=0, le=DIMENSION_LIMITS["intermediate_size"])
    num_hidden_layers: int = Field(gt=0, le=DIMENSION_LIMITS["num_hidden_layers"])
    num_attention_heads: int = Field(gt=0, le=DIMENSION_LIMITS["num_attention_heads"])
    num_key_value_heads: int = Field(gt=0, le=DIMENSION_LIMITS["num_key_value_heads"])
    head_dim: int | None = Field(default=None, gt=0, le=DIMENSION_LIMITS["head_dim"])
    vocab_size: int = Field(gt=0, le=DIMENSION_LIMITS["vocab_size"])
    tie_word_embeddings: bool = False
    max_position_embeddings: int = Field(gt=0, le=DIMENSION_LIMITS["max_position_embeddings"])
    attention_bias: bool = False
    num_local_experts: int = Field(default=0, ge=0, le=DIMENSION_LIMITS["num_local_experts"])
    num_experts_per_tok: int = Field(default=0, ge=0, le=DIMENSION_LIMITS["num_experts_per_tok"])
    moe_intermediate_size: int | None = Field(default=None, gt=0, le=DIMENSION_LIMITS["moe_intermediate_size"])
    norm_topk_prob: bool = False
    published_params: int | None = None
    source: str | None = None
    variant_of: str | None = Field(default=None, description="the preset whose shapes this hub checkpoint shares")
    prequantized: PreQuantized | None = Field(
        default=None, description="the checkpoint's weights are stored quantised (a pre-quantised repo or folder)"
    )
    vision: VisionTower | None = Field(
        default=None, description="an image-text model's vision tower and projector: stored, frozen, unused by text"
    )
    global_layers: gemma4.GlobalLayers | None = Field(default=None, description="Gemma 4's full-attention layers")
    latent: mla.LatentAttention | None = Field(default=None, description="DeepSeek-style MLA and MoE keys (mla.py)")
    linear_attention: hybrid.LinearAttention | None = Field(default=None, description="a hybrid's DeltaNet layers")
    cross_attention: mllama.CrossAttention | None = Field(
        default=None, description="Llama 3.2 Vision's cross-attention layers (mllama.py): stored, skipped by text"
    )

    # --- derived shapes -------------------------------------------------------------------------------------
    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_size

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    @property
    def mlp_width(self) -> int:
        """The width of the MLP every block runs: one expert's for an MoE (Qwen3-MoE's `moe_intermediate_size`;
        its `intermediate_size` is the width of dense layers, which the released checkpoints do not have)."""
        return self.moe_intermediate_size if self.is_moe and self.moe_intermediate_size else self.intermediate_size

    @property
    def arch(self) -> ArchitectureSpec:
        """The family's traits (catalog/architectures.toml)."""
        return families.architectures()[self.architecture]

    @property
    def norms_per_layer(self) -> int:
        """Gemma-2 and Gemma 3 add a norm after attention and after the MLP (Qwen3 and Gemma 3 also normalise q
        and k per head: `has_qk_norm`)."""
        return self.arch.norms_per_layer

    @property
    def has_qk_norm(self) -> bool:
        """Qwen3 and Gemma 3 RMS-normalise every query and key head (a head_dim-sized weight for each)."""
        return self.arch.qk_norm

    @property
    def logit_softcapping(self) -> bool:
        """Gemma-2 soft-caps the attention scores and the final logits (attn_logit_softcapping 50,
        final_logit_softcapping 30 in every Gemma-2 config.json)."""
        return self.arch.logit_softcapping

    @property
    def attention_implementations(self) -> tuple[str, ...]:
        """Attention kernels transformers offers for this architecture (5.x has no sdpa path for Gemma-2,
        whose logit soft-capping needs the eager or flash kernel)."""
        return self.arch.attention

    def attention_linears(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each attention projection, by Hugging Face module name."""
        h = self.hidden_size
        if self.latent is not None:
            return self.latent.attention_linears(h, self.num_attention_heads)
        if self.arch.fused_qkv:
            return {"qkv_proj": (h, self.q_size + 2 * self.kv_size), "o_proj": (self.q_size, h)}
        return {
            "q_proj": (h, self.q_size * (2 if self.arch.attention_output_gate else 1)),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
        }

    def mlp_linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of one MLP's projections; for MoE, of one expert (there are `num_local_experts`).

        Phi-3 fuses gate and up into one Linear. transformers 5 holds Mixtral's experts the same way, but as
        two fused 3-D parameters of `mlp.experts` (`gate_up_proj`: experts x 2i x h, `down_proj`: experts x h x
        i), not as Linear modules.
        """
        h, i = self.hidden_size, self.mlp_width
        if self.arch.fused_gate_up or self.is_moe:
            return {"gate_up_proj": (h, 2 * i), "down_proj": (i, h)}
        return {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @memoised
    def layer_linears(self) -> tuple[tuple[str, int, int, int], ...]:
        """Every linear layer of one decoder block: (name, in, out, copies). Copies > 1 for MoE experts."""
        copies = max(self.num_local_experts, 1)
        rows = [(name, i, o, 1) for name, (i, o) in self.attention_linears().items()]
        rows += [(name, i, o, copies) for name, (i, o) in self.mlp_linears().items()]
        rows += hybrid.linear_attention_rows(self)  # a hybrid's, in the layers that have them
        return tuple(rows) + mla.shared_rows(self) + gemma4.dense_mlp_rows(self)  # Gemma 4 26B-A4B's dense MLP

    @memoised
    def lora_target_names(self, targets: LoraTargets) -> tuple[str, ...]:
        """The module names LoRA wraps for `--lora-targets`; Phi-3's fused qkv_proj stands in for q and v.

        MoE experts are fused parameters, not modules: peft reaches them only through `target_parameters`,
        whose wrapper refuses lora_dropout, so on an MoE "all" adapts the attention projections, as "attn" does,
        and "experts" adapts the attention and every expert's gate_up_proj and down_proj (`expert_target_names`).
        """
        attn = tuple(self.attention_linears()) + (self.linear_attention.lora_names if self.linear_attention else ())
        if targets == "experts":
            return attn + self.expert_target_names(targets)
        if targets == "all":  # and Gemma 4 26B-A4B's dense MLP, Linear modules beside its experts
            dense = tuple(row[0] for row in gemma4.dense_mlp_rows(self))
            return attn + dense if self.is_moe else attn + tuple(self.mlp_linears())
        if targets == "attn":
            return attn
        return self.latent.qv_names() if self.latent else ("qkv_proj",) if self.arch.fused_qkv else ("q_proj", "v_proj")

    def expert_target_names(self, targets: LoraTargets) -> tuple[str, ...]:
        """The fused expert parameters (of `mlp.experts`) that peft's `target_parameters` adapts for `targets`."""
        return tuple(self.mlp_linears()) if targets == "experts" and self.is_moe else ()

    def check_lora_targets(self, targets: LoraTargets | None, lora_dropout: float | None) -> None:
        """Refuse LoRA targets the stack cannot apply: experts on a dense model, or with dropout (peft's
        ParamWrapper raises "does not work with lora_dropout != 0": dropout cannot be factored out of the
        per-expert weight delta)."""
        if targets != "experts":
            return
        if not self.is_moe:
            raise InvalidConfig(say("error.no_experts", setting="lora_targets", model=self.name))
        if lora_dropout:
            said = {"setting_dropout": "lora_dropout", "dropout": lora_dropout, "model": self.name}
            raise InvalidConfig(say("error.experts_dropout", setting="lora_targets", **said))

    # --- parameter counts -----------------------------------------------------------------------------------
    @property
    def embedding_params(self) -> int:
        extra = mllama.EXTRA_EMBEDDING_ROWS if self.cross_attention else 0  # Llama 3.2 Vision's image-token rows
        return (self.vocab_size + extra) * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    @memoised
    def expert_params(self) -> int:
        """Weights of one block's MoE experts (0 for a dense model)."""
        return self.num_local_experts * sum(i * o for i, o in self.mlp_linears().values()) if self.is_moe else 0

    @property
    def expert_bias_params(self) -> int:
        """gpt-oss's experts add a bias to gate_up (2 x width) and down (hidden) in every expert."""
        if not (self.is_moe and self.arch.moe_biases):
            return 0
        return self.num_local_experts * (2 * self.mlp_width + self.hidden_size)

    @property
    @memoised
    def layer_linear_params(self) -> int:
        """Weights of one block's `nn.Linear` layers, biases excluded: what 4-bit quantisation replaces.

        bitsandbytes replaces `nn.Linear` modules only (transformers' `replace_with_bnb_linear`); the fused 3-D
        MoE experts stay in 16-bit, so they count in `layer_other_params` (`layer_linears()` still lists them).
        """
        if self.global_layers:  # the layers differ: their mean (gemma4.py, linear_attention.py)
            return gemma4.block_totals(self)[0] // self.num_hidden_layers
        if self.linear_attention:
            return hybrid.block_totals(self)[0] // self.num_hidden_layers
        return sum(i * o * n for _, i, o, n in self.layer_linears()) - self.expert_params

    @property
    @memoised
    def layer_other_params(self) -> int:
        """What stays 16/32-bit under QLoRA: norms, attention biases (o_proj's too where `attention_bias` sets it,
        as in Llama and gpt-oss), MoE router and experts, q/k norms, gpt-oss's attention sinks (one per head)."""
        other = self.norms_per_layer * self.hidden_size
        if self.attention_bias:
            other += self.q_size + 2 * self.kv_size + (0 if self.arch.qkv_bias else self.hidden_size)
        if self.is_moe:
            router = (self.hidden_size + (1 if self.arch.moe_biases else 0)) * self.num_local_experts
            other += router + self.expert_params + self.expert_bias_params
        if self.has_qk_norm:
            other += 2 * self.head_size
        if self.arch.attention_sinks:
            other += self.num_attention_heads
        if self.global_layers:
            return gemma4.block_totals(self)[1] // self.num_hidden_layers
        if self.linear_attention:
            return hybrid.block_totals(self)[1] // self.num_hidden_layers
        return other + (self.latent.norm_params if self.latent else 0)

    @property
    @memoised
    def vision_params(self) -> int:
        """An image-text model's vision tower and projector (0 for a text model): loaded, never trained by LoRA,
        and not run for text-only rows."""
        return self.vision.params(self.hidden_size) if self.vision else 0

    @property
    @memoised
    def quantized_linear_params(self) -> int:
        """Every weight bitsandbytes packs: the decoder's linears and the vision tower's and projector's
        (`vision.py`: transformers' quantizer skips neither)."""
        vision = self.vision.linear_params(self.hidden_size) if self.vision else 0
        vision += self.cross_attention.linear_params(self) if self.cross_attention else 0
        return self.num_hidden_layers * self.layer_linear_params + vision + mla.dense_deltas(self)[0]

    @property
    @memoised
    def num_params(self) -> int:
        """Total parameters, counting tied embeddings once (as `model.num_parameters()` does)."""
        per_layer = self.layer_linear_params + self.layer_other_params
        if self.global_layers:
            blocks = sum(gemma4.block_totals(self))
        elif self.linear_attention:
            blocks = sum(hybrid.block_totals(self))
        else:
            blocks = self.num_hidden_layers * per_layer
        text = blocks + self.embedding_params + self.lm_head_params + self.hidden_size  # and the final norm
        text += sum(mla.dense_deltas(self))  # DeepSeek's dense first layers (mla.py)
        return text + self.vision_params + self.cross_attention_params

    @property
    @memoised
    def cross_attention_params(self) -> int:
        """Llama 3.2 Vision's cross-attention layers (0 for any other model): stored, never run for text rows."""
        if not self.cross_attention:
            return 0
        return self.cross_attention.linear_params(self) + self.cross_attention.other_params(self)

    @property
    @memoised
    def active_params(self) -> int:
        """Parameters one text token passes through (MoE routes each token to `num_experts_per_tok` experts; an
        image-text model's vision tower runs only for images)."""
        if not self.is_moe:
            return self.num_params - self.vision_params - self.cross_attention_params
        idle_experts = self.num_local_experts - self.num_experts_per_tok
        one_expert = (self.expert_params + self.expert_bias_params) // self.num_local_experts
        idle = idle_experts * one_expert * mla.moe_layers(self)
        return self.num_params - idle - self.vision_params

    @memoised
    def lora_params(self, r: int, targets: LoraTargets) -> int:
        """LoRA A (r x in) and B (out x r) for each targeted module of every layer (a Gemma 4 or hybrid model's
        layers differ)."""
        if self.global_layers:
            return gemma4.lora_params(self, r, targets)
        if self.linear_attention:
            return hybrid.lora_params(self, r, targets)
        names = set(self.lora_target_names(targets))
        per_layer = sum(r * (i + o) * n for name, i, o, n in self.layer_linears() if name in names)
        return per_layer * self.num_hidden_layers - mla.dense_expert_lora(self, r, names)

    def check_seq_len(self, seq_len: int | None) -> None:
        """Refuse a sequence length past what the model's positions cover."""
        if seq_len is not None and seq_len > self.max_position_embeddings:
            limit = self.max_position_embeddings
            raise InvalidConfig(
                say("error.seq_len_past", setting="--seq-len", seq_len=seq_len, model=self.name, limit=limit)
            )

    def scaled(self, **overrides: int | bool | str | dict) -> ModelSpec:
        """A copy with some fields changed, for tiny test models (as litgpt's `Config.from_name(..., n_layer=2)`)."""
        data = self.model_dump() | {"published_params": None, "name": f"{self.name}-scaled"} | overrides
        return ModelSpec.model_validate(data)

    def to_hf_config(self) -> dict:
        """A config.json dict that transformers' AutoConfig builds the same architecture from."""
        config = {
            "model_type": self.arch.model_types[0],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_size,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
        }
        if self.arch.attention_bias_key:
            config["attention_bias"] = self.attention_bias
        if self.arch.pad_token_id is not None and self.vocab_size <= self.arch.pad_token_id:
            # the config class's default pad id (Phi3Config: 32000): a shrunken vocabulary has no such row
            config["pad_token_id"] = None
        if self.is_moe:
            config |= {self.arch.experts_key: self.num_local_experts} | mla.latent_keys(self)
            config["num_experts_per_tok"] = self.num_experts_per_tok
            if self.moe_intermediate_size is not None:
                config["moe_intermediate_size"] = self.moe_intermediate_size
                config["norm_topk_prob"] = self.norm_topk_prob
        config |= gemma4.hf_keys(self) if self.global_layers else {}
        config |= self.linear_attention.hf_keys(self.num_hidden_layers) if self.linear_attention else {}
        if self.cross_attention is not None:  # Llama 3.2 Vision: MllamaConfig, its vision_config left to defaults
            del config["model_type"], config["head_dim"]  # MllamaTextConfig: head_dim is hidden / heads
            text = config | self.cross_attention.hf_keys(self.num_hidden_layers, self.vocab_size)
            return {"model_type": mllama.MODEL_TYPE, "text_config": text}
        if self.vision is None:
            return config
        # an image-text model: its family's config class takes the text model's keys (the text model_type left
        # to its default) and reads tie_word_embeddings at the top (transformers 5 ties by the outer config)
        del config["model_type"]
        return {
            "model_type": self.vision.family,
            "text_config": config | self.vision.text_keys(self.head_size),
            "vision_config": self.vision.to_hf_config(self.hidden_size),
            "tie_word_embeddings": self.tie_word_embeddings,
            **self.vision.wrapper_keys(),
        }


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
    prequantized = bitsandbytes_quantization(file, config.get("quantization_config"))
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
    return spec.model_copy(update={"prequantized": prequantized}) if prequantized is not None else spec


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
# leaves a few modules 16-bit through llm_int8_skip_modules; counted here as all 4-bit), and
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
    update = {
        "name": repo_name(model),
        "hf_id": model if "/" in model else None,
        "variant_of": base.variant_of or base.name,
        "prequantized": UNSLOTH_4BIT.model_copy(update={"base": base.hf_id}),
    }
    return base.model_copy(update=update)


def did_you_mean(key: str) -> str:
    """Up to three known names: those that extend what was typed ("llama-3.3-70b" -> "...-instruct") first,
    then the closest spellings."""
    names = dict.fromkeys([*catalog(), *(repo_name(hub_id) for hub_id in hub_index())])
    typed = repo_name(key)
    extending = [name for name in names if name.startswith(typed) and name != typed]
    close = difflib.get_close_matches(typed, list(names), n=3, cutoff=0.4)
    picked = list(dict.fromkeys(extending[:3] + close))[:3]
    return say("model.did_you_mean", names=", ".join(picked)) if picked else ""
