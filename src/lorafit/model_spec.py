"""The shape of one model (`ModelSpec`): the fields of its Hugging Face config.json and every count derived from
them (parameters, what LoRA adapts, what bitsandbytes packs, the config transformers builds). Where the specs come
from (the catalog, hub ids, a config.json) is `models.py`.
"""

from __future__ import annotations

from functools import lru_cache, wraps
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator

from lorafit import families, gemma4, mla, mllama
from lorafit import linear_attention as hybrid
from lorafit.errors import InvalidConfig
from lorafit.families import Architecture, ArchitectureSpec, known_architecture
from lorafit.messages import say
from lorafit.vision import VisionTower

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
    # the decoder's linear weights the checkpoint keeps 16-bit (its config.json's llm_int8_skip_modules: Unsloth's
    # dynamic 4-bit repos name a few layers there); None: not known (a repo name without its config.json, not in
    # catalog/unsloth_dynamic.toml)
    kept_16bit_params: int | None = Field(default=None, ge=0)

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
        tower = self.vision.params(self.hidden_size) if self.vision else 0
        return tower + sum(gemma4.tower_deltas(self))  # and Gemma 4 E2B / E4B's audio tower

    @property
    def kept_16bit_params(self) -> int:
        """The decoder's linear weights a pre-quantised checkpoint keeps 16-bit (PreQuantized.kept_16bit_params;
        0 where not known or none)."""
        return (self.prequantized.kept_16bit_params or 0) if self.prequantized else 0

    @property
    @memoised
    def quantized_linear_params(self) -> int:
        """Every weight bitsandbytes packs: the decoder's linears (but those a pre-quantised checkpoint keeps
        16-bit) and the vision tower's and projector's (`vision.py`: transformers' quantizer skips neither)."""
        vision = self.vision.linear_params(self.hidden_size) if self.vision else 0
        vision += self.cross_attention.linear_params(self) if self.cross_attention else 0
        vision += gemma4.tower_deltas(self)[0]  # Gemma 4 E2B / E4B: the audio tower; their layers differ
        blocks = (
            gemma4.block_totals(self)[0] if self.global_layers else self.num_hidden_layers * self.layer_linear_params
        )
        return blocks - self.kept_16bit_params + vision + mla.dense_deltas(self)[0]

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
        text += gemma4.per_layer_table_params(self)  # Gemma 4 E2B / E4B's per-layer embedding table
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
            **gemma4.wrapper_keys(self),
        }
