"""Llama 3.2 Vision (model_type `mllama`) fine-tuned on text: a Llama 3.1 language model with gated
cross-attention layers to the image interleaved among its self-attention layers.

What `lorafit train` builds, read in transformers 5.25 (models/auto/modeling_auto.py, models/mllama/):
- AutoModelForCausalLM maps `mllama` to MllamaForCausalLM (modeling_auto.py:924), which builds the text model
  alone from the config's text_config (modeling_mllama.py:1176-1178); the hub folder's vision tower and projector
  are weights it does not load ("unexpected" keys; its language weights load under their names). So the vision
  tower costs no memory and the spec has none.
- MllamaTextModel builds a MllamaCrossAttentionDecoderLayer at each index of `cross_attention_layers` and a
  MllamaSelfAttentionDecoderLayer elsewhere (modeling_mllama.py:1034-1040). Its forward skips a cross-attention
  layer when there are no cross_attention_states and nothing cached (modeling_mllama.py:1135-1139): with text rows
  it never runs, so its weights are stored (and packed under QLoRA: its q/k/v/o and MLP are nn.Linear) but it
  holds no activation and costs no FLOPs.
- The embedding has 8 rows past the vocabulary (`vocab_size + 8`, modeling_mllama.py:1032; the converter appends
  the learnable image-token embedding), the LM head `vocab_size`; the two are untied (MllamaTextConfig
  tie_word_embeddings False, and MllamaForCausalLM declares no tied keys).

So `ModelSpec.num_hidden_layers` of an mllama spec counts the self-attention layers, the ones text runs, and
`CrossAttention.layers` holds the config's cross-attention indices (among all `num_hidden_layers +
len(layers)` decoder layers). LoRA adapts the self-attention layers only (train/hf_args.lora_kwargs): the
cross-attention layers' modules have the same names (cross_attn.q_proj, mlp.gate_proj), but adapters there would
never see a gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from lorafit.errors import InvalidConfig

if TYPE_CHECKING:
    from lorafit.models import ModelSpec

MODEL_TYPE = "mllama"
# MllamaTextModel's embedding: nn.Embedding(config.vocab_size + 8, ...) (modeling_mllama.py:1032)
EXTRA_EMBEDDING_ROWS = 8
# MllamaTextConfig.__post_init__'s default, the 11B checkpoint's layout (configuration_mllama.py:133)
DEFAULT_LAYERS = (3, 8, 13, 18, 23, 28, 33, 38)
# Each cross-attention layer: its two RMSNorms (hidden wide), q_norm and k_norm (head_dim wide) and the two tanh
# gates (one value each) beside the linears (MllamaCrossAttentionDecoderLayer, MllamaTextCrossAttention)
GATES = 2
DEFAULT_PAD_TOKEN_ID = 128_004  # MllamaTextConfig (configuration_mllama.py:129)


class CrossAttention(BaseModel):
    """Where a Llama 3.2 Vision language model's cross-attention layers sit (text_config.cross_attention_layers)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: tuple[int, ...] = Field(min_length=1, max_length=1024)

    def kept(self, self_layers: int) -> tuple[int, ...]:
        """The cross-attention layers of a model cut to `self_layers` self-attention layers with the same layout:
        those with at most `self_layers` self-attention layers before them (the trace builds such models)."""
        kept: list[int] = []
        for index in sorted(self.layers):
            if index - len(kept) <= self_layers:
                kept.append(index)
        return tuple(kept)

    def period(self) -> int:
        """Self-attention layers per cross-attention layer where the layout is regular (4 in both checkpoints: one
        cross-attention layer closes every five), else 1."""
        ordered = sorted(self.layers)
        steps = {b - a for a, b in zip(ordered, ordered[1:], strict=False)}
        return steps.pop() - 1 if len(steps) == 1 and ordered[0] == min(steps) - 2 else 1

    def linear_params(self, spec: ModelSpec) -> int:
        """The cross-attention layers' nn.Linear weights: q, k, v, o and the MLP, shaped as a self-attention
        layer's (MllamaTextCrossAttention: head_dim = hidden / heads, k/v num_key_value_heads wide)."""
        one = sum(i * o for i, o in spec.attention_linears().values()) + sum(
            i * o for i, o in spec.mlp_linears().values()
        )
        return len(self.kept(spec.num_hidden_layers)) * one

    def other_params(self, spec: ModelSpec) -> int:
        """Their norms, q/k norms and gates (the embedding's extra rows are in `ModelSpec.embedding_params`)."""
        one = 2 * spec.hidden_size + 2 * spec.head_size + GATES
        return len(self.kept(spec.num_hidden_layers)) * one

    def hf_keys(self, self_layers: int, vocab_size: int) -> dict[str, Any]:
        """text_config keys: all the decoder layers, and which of them cross-attend; a shrunken vocabulary (a tiny
        test model) has no rows for MllamaTextConfig's default token ids (bos 128000, eos 128001, pad 128004)."""
        kept = self.kept(self_layers)
        keys: dict[str, Any] = {"num_hidden_layers": self_layers + len(kept), "cross_attention_layers": list(kept)}
        if vocab_size <= DEFAULT_PAD_TOKEN_ID:
            keys |= {"bos_token_id": 0, "eos_token_id": None, "pad_token_id": None}  # bos must be a whole number
        return keys


def read_text_config(config: dict[str, Any], file: object) -> tuple[dict[str, Any], CrossAttention] | None:
    """An mllama config.json's text_config with num_hidden_layers counting its self-attention layers, and its
    cross-attention layers; None for any other config."""
    if config.get("model_type") != MODEL_TYPE:
        return None
    text = config.get("text_config")
    text = dict(text) if isinstance(text, dict) else {}
    text = {key: value for key, value in text.items() if value is not None}
    # MllamaTextConfig's defaults (configuration_mllama.py:112-133), for keys the file leaves out
    defaults = {
        "vocab_size": 128_256,
        "hidden_size": 4096,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14_336,
        "max_position_embeddings": 131_072,
        "tie_word_embeddings": False,
    }
    text = defaults | text
    layers = text.pop("cross_attention_layers", list(DEFAULT_LAYERS))
    total = text["num_hidden_layers"]
    if (
        not isinstance(layers, list)
        or not layers
        or any(type(index) is not int for index in layers)
        or type(total) is not int
        or len(set(layers)) != len(layers)
        or not all(0 <= index < total for index in layers)
        or len(layers) >= total
    ):
        raise InvalidConfig(
            f"{file}: text_config.cross_attention_layers must list distinct layer numbers below num_hidden_layers "
            "and leave at least one self-attention layer"
        )
    text["num_hidden_layers"] = total - len(layers)
    text.pop("head_dim", None)  # MllamaTextConfig has none: its heads are hidden_size / num_attention_heads wide
    text["model_type"] = "llama"
    return text, CrossAttention(layers=tuple(layers))
