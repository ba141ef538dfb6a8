"""Gemma 4's global layers: every `interval`-th decoder layer attends to the whole context with its own head size
and key/value head count, and (attention_k_eq_v) reuses its keys as values, so it has no v_proj.

Shapes as transformers 5.25 builds them (models/gemma4/modeling_gemma4.py Gemma4TextAttention, configuration
Gemma4TextConfig.__post_init__: per_layer_config gives full-attention layers head_dim = global_head_dim and, with
attention_k_eq_v, num_key_value_heads = num_global_key_value_heads; layer_types defaults to one full-attention
layer in every 6 and forces the last layer to full attention). The sliding-window layers are what `ModelSpec`
counts for a uniform model (Gemma 3's block, with a v_norm that has no weight); the counts are checked against the
meta-device build in tests/test_gemma4.py.

The 26B-A4B (enable_moe_block) runs, in every layer, the dense MLP and an MoE block side by side
(Gemma4TextDecoderLayer): a router (an `nn.Linear` that bitsandbytes packs, an unweighted norm, a scale per hidden
unit and per expert), 128 experts held as two fused 3-D parameters (`experts.gate_up_proj`, `experts.down_proj`,
which bitsandbytes leaves 16-bit, as for every MoE family: `ModelSpec.expert_params`) and three more norms. Its
experts are the ModelSpec's MoE fields; its dense MLP (`intermediate_size` wide) adds `dense_mlp_rows`.

The E2B and E4B (Gemma4TextModel, Gemma4TextDecoderLayer, Gemma4TextAttention, Gemma4TextMLP) add:
- per-layer input embeddings: `embed_tokens_per_layer`, an nn.Embedding of vocab_size_per_layer_input x (layers x
  hidden_size_per_layer_input) that bitsandbytes leaves 16-bit, `per_layer_model_projection` (hidden -> layers x
  256, a Linear) and its norm; in each layer `per_layer_input_gate` (hidden -> 256), `per_layer_projection` (256 ->
  hidden), both Linears, and `post_per_layer_input_norm`;
- shared-KV layers: the last num_kv_shared_layers layers (config.kv_sharing_modes "reuse") have no k_proj, v_proj,
  k_norm, v_norm and read the keys/values of the last unshared layer of their kind; with use_double_wide_mlp (the
  E2B) their MLP is 2 x intermediate_size wide;
- an audio tower (Gemma4AudioModel from the default Gemma4AudioConfig) and embed_audio, stored, never run for text.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lorafit.errors import InvalidConfig

if TYPE_CHECKING:
    from lorafit.model_spec import LoraTargets, ModelSpec

# Gemma4TextConfig: sliding_window_pattern 6 when layer_types is not given
DEFAULT_INTERVAL = 6
# Gemma4TextConfig's defaults for a config.json that leaves the E sizes' keys out (configuration_gemma4.py)
PER_LAYER_INPUT_DEFAULT = 256
PER_LAYER_VOCAB_DEFAULT = 262_144
# The audio tower of the default Gemma4AudioConfig (the E2B's and E4B's, convert_gemma4_weights.py
# _DEFAULT_AUDIO_CONFIG): the meta-device build with transformers 5.25 (2026-12), split as its quantizer splits it:
# 304,611,328 weights in the Linears bitsandbytes packs, 213,280 in norms, biases, convolutions and scales; its
# output (output_proj_dims 1536) reaches the text model through embed_audio's projection (1536 x hidden).
AUDIO_LINEAR = 304_611_328
AUDIO_OTHER = 213_280
AUDIO_OUTPUT = 1536
# the MoE block's own norms besides the four of every layer: pre_feedforward_layernorm_2, post_feedforward_layernorm_1
# and _2 (Gemma4TextDecoderLayer)
MOE_NORMS = 3
GGUF_MOE_NORMS = ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2")  # their llama.cpp names (gguf-py's map)


class GlobalLayers(BaseModel):
    """Where Gemma 4's full-attention layers fall and their attention shape; its config.json keys by name."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    global_head_dim: int = Field(gt=0, le=4096)
    num_global_key_value_heads: int = Field(gt=0, le=1024)
    attention_k_eq_v: bool
    interval: int = Field(default=DEFAULT_INTERVAL, gt=0, le=1024)
    sliding_window: int = Field(default=512, gt=0, le=1 << 26)
    final_logit_softcapping: float | None = Field(default=None, gt=0)
    # the E2B's and E4B's features (module docstring); off for the 31B and 26B-A4B
    per_layer_input: int = Field(default=0, ge=0, le=1 << 16)  # hidden_size_per_layer_input
    per_layer_vocab: int = Field(default=PER_LAYER_VOCAB_DEFAULT, gt=0, le=1 << 24)  # vocab_size_per_layer_input
    kv_shared_layers: int = Field(default=0, ge=0, le=1024)  # num_kv_shared_layers
    double_wide_mlp: bool = False  # use_double_wide_mlp
    audio: bool = False  # an audio_config: the audio tower is built

    def layer_types(self, layers: int) -> list[str]:
        kinds = ["full_attention" if (i + 1) % self.interval == 0 else "sliding_attention" for i in range(layers)]
        return kinds[:-1] + ["full_attention"]

    def full_layers(self, layers: int) -> int:
        return self.layer_types(layers).count("full_attention")

    def shared_types(self, layers: int) -> list[str]:
        """The kinds of the shared-KV layers (the last `kv_shared_layers`)."""
        return self.layer_types(layers)[layers - self.kv_shared_layers :] if self.kv_shared_layers else []

    def attention_linears(self, spec: ModelSpec) -> dict[str, tuple[int, int]]:
        """(in, out) of a full-attention layer's projections: no v_proj where keys are values."""
        h, q, kv = spec.hidden_size, spec.num_attention_heads * self.global_head_dim, self.kv_size
        linears = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        return {name: dims for name, dims in linears.items() if name != "v_proj" or not self.attention_k_eq_v}

    @property
    def kv_size(self) -> int:
        return self.num_global_key_value_heads * self.global_head_dim


def hf_keys(spec: ModelSpec) -> dict[str, Any]:
    """The text config keys transformers builds Gemma 4's layers from (the E sizes' features off; the MoE block on
    where the spec has experts)."""
    layout = spec.global_layers
    assert layout is not None
    keys = layout.model_dump(exclude={"interval", "final_logit_softcapping"})
    keys |= {"final_logit_softcapping": layout.final_logit_softcapping}
    keys |= {"layer_types": layout.layer_types(spec.num_hidden_layers), "enable_moe_block": spec.is_moe}
    if spec.is_moe:
        keys |= {"top_k_experts": spec.num_experts_per_tok}
    e_sizes = {"hidden_size_per_layer_input": layout.per_layer_input, "num_kv_shared_layers": layout.kv_shared_layers}
    e_sizes |= {"vocab_size_per_layer_input": layout.per_layer_vocab, "use_double_wide_mlp": layout.double_wide_mlp}
    return keys | e_sizes


def wrapper_keys(spec: ModelSpec) -> dict[str, Any]:
    """The image-text config's audio_config (Gemma4AudioConfig's defaults) where the model has the audio tower."""
    return {"audio_config": {"model_type": "gemma4_audio"}} if spec.global_layers and spec.global_layers.audio else {}


def is_moe(spec: ModelSpec) -> bool:
    """A Gemma 4 with the MoE block beside its dense MLP (the 26B-A4B). By the family's name, as it is asked of
    the spec without its global layers too (`block_totals` counts a sliding layer, `last_layer` the last one)."""
    return spec.architecture == "gemma4" and spec.is_moe


def dense_mlp_rows(spec: ModelSpec) -> tuple[tuple[str, int, int, int], ...]:
    """The dense MLP that the 26B-A4B runs beside its experts, as `ModelSpec.layer_linears` rows (name, in, out,
    copies), `intermediate_size` wide; none for another model. Named by their parent, as peft matches a name's
    last parts, since the experts' `down_proj` shares the last one."""
    if not is_moe(spec):
        return ()
    h, i = spec.hidden_size, spec.intermediate_size
    return (("mlp.gate_proj", h, i, 1), ("mlp.up_proj", h, i, 1), ("mlp.down_proj", i, h, 1))


def moe_deltas(spec: ModelSpec) -> tuple[int, int]:
    """(linear, other) weights of one 26B-A4B block beyond what `ModelSpec` counts for an MoE: its router is an
    `nn.Linear` (packed by bitsandbytes, not 16-bit as the generic MoE router), plus the block's three norms and
    the router's scales."""
    if not is_moe(spec):
        return 0, 0
    h, experts = spec.hidden_size, spec.num_local_experts
    router = h * experts
    return router, MOE_NORMS * h + h + experts - router


def last_layer(spec: ModelSpec) -> ModelSpec:
    """A uniform model shaped like the last layer, whose backward the memory estimate counts at the end of the
    stack: Gemma 4's last layer is a global one (its wider heads; its v_proj, absent where keys are values, is
    counted as a k-sized copy, as the v_norm output is). Any other model is its own."""
    layout = spec.global_layers
    if layout is None:
        return spec
    wide = {"head_dim": layout.global_head_dim, "num_key_value_heads": layout.num_global_key_value_heads}
    if layout.kv_shared_layers and layout.double_wide_mlp:  # the E2B's last layer: a shared-KV one, MLP 2x wide
        wide |= {"intermediate_size": 2 * spec.intermediate_size}
    return spec.model_copy(update=wide | {"global_layers": None})


def double_wide_view(spec: ModelSpec) -> ModelSpec | None:
    """The E2B's shared-KV layers as a uniform model (their MLP 2 x intermediate_size wide); None for a model
    without double-wide layers."""
    layout = spec.global_layers
    if layout is None or not (layout.kv_shared_layers and layout.double_wide_mlp):
        return None
    return spec.model_copy(update={"intermediate_size": 2 * spec.intermediate_size})


def layer_view(spec: ModelSpec, n: int) -> tuple[ModelSpec, bool]:
    """Layer `n` as a uniform model (a global layer's shape where it is one) and whether it has a v_proj."""
    layout = spec.global_layers
    if layout is None or layout.layer_types(spec.num_hidden_layers)[n] != "full_attention":
        return spec, True
    return last_layer(spec), not layout.attention_k_eq_v


def block_totals(spec: ModelSpec) -> tuple[int, int]:
    """Weights of all decoder blocks: (their `nn.Linear`s, everything else). Each full-attention layer swaps the
    sliding layer's projections and q/k norms (head_dim wide) for its own (global_head_dim wide)."""
    layout = spec.global_layers
    assert layout is not None
    plain = spec.model_copy(update={"global_layers": None})
    layers, full = spec.num_hidden_layers, layout.full_layers(spec.num_hidden_layers)
    sliding = sum(i * o for i, o in plain.attention_linears().values())
    wide = sum(i * o for i, o in layout.attention_linears(spec).values())
    moe_linear, moe_other = moe_deltas(spec)
    linear = layers * (plain.layer_linear_params + moe_linear) + full * (wide - sliding)
    other = layers * (plain.layer_other_params + moe_other) + full * 2 * (layout.global_head_dim - spec.head_size)
    e_linear, e_other = e_deltas(spec)
    return linear + e_linear, other + e_other


def _attention_of(spec: ModelSpec, kind: str) -> tuple[dict[str, tuple[int, int]], int]:
    """A layer's attention projections and head size for its kind (sliding or full attention)."""
    layout = spec.global_layers
    assert layout is not None
    if kind == "full_attention":
        return layout.attention_linears(spec), layout.global_head_dim
    return spec.model_copy(update={"global_layers": None}).attention_linears(), spec.head_size


def e_deltas(spec: ModelSpec) -> tuple[int, int]:
    """(linear, other) weights the E sizes add to the layers as `block_totals` counts them: the per-layer input
    path (its table is the model's, as the embedding is: `per_layer_table_params`), minus each shared-KV layer's
    k_proj, v_proj and k_norm, plus the E2B's double-wide MLP in those layers."""
    layout = spec.global_layers
    assert layout is not None
    h, p, layers = spec.hidden_size, layout.per_layer_input, spec.num_hidden_layers
    linear = layers * 2 * h * p + h * layers * p  # per_layer_input_gate, per_layer_projection; the model projection
    other = (layers * h + p) if p else 0  # post_per_layer_input_norm; per_layer_projection_norm
    for kind in layout.shared_types(layers):
        projections, head = _attention_of(spec, kind)
        linear -= sum(i * o for name, (i, o) in projections.items() if name in ("k_proj", "v_proj"))
        other -= head  # k_norm (v_norm has no weight)
    if layout.double_wide_mlp:
        linear += layout.kv_shared_layers * 3 * h * spec.intermediate_size
    return linear, other


def per_layer_table_params(spec: ModelSpec) -> int:
    """The E sizes' per-layer embedding table (an nn.Embedding: 16-bit under QLoRA): a model-level weight, as the
    embedding is, not a layer's; looked up, never multiplied (no FLOPs)."""
    layout = spec.global_layers
    return layout.per_layer_vocab * spec.num_hidden_layers * layout.per_layer_input if layout else 0


def tower_deltas(spec: ModelSpec) -> tuple[int, int]:
    """(linear, other) of the E sizes' audio tower and embed_audio. With it, embed_audio's projection is the
    model's last module, which transformers' get_keys_to_not_convert leaves 16-bit, and embed_vision's (which
    `VisionTower` counts as 16-bit) is packed: checked against the meta-device build in tests/test_gemma4.py."""
    layout = spec.global_layers
    if layout is None or not layout.audio:
        return 0, 0
    vision = spec.vision.hidden_size * spec.hidden_size if spec.vision else 0
    return AUDIO_LINEAR + vision, AUDIO_OTHER + AUDIO_OUTPUT * spec.hidden_size - vision


def lora_params(spec: ModelSpec, r: int, targets: LoraTargets) -> int:
    """LoRA A and B over the targeted modules of each kind of layer, as peft wraps them by name (a global layer
    with keys as values has no v_proj to wrap), and over the 26B-A4B's dense MLP and experts (one A and B per
    expert, as peft's target_parameters does for every MoE family)."""
    layout = spec.global_layers
    assert layout is not None
    names = set(spec.lora_target_names(targets))
    layers, full = spec.num_hidden_layers, layout.full_layers(spec.num_hidden_layers)

    def adapters(modules: dict[str, tuple[int, int]]) -> int:
        return sum(r * (i + o) for name, (i, o) in modules.items() if name in names)

    attention = set(spec.attention_linears())
    mlp = sum(r * (i + o) * n for name, i, o, n in spec.layer_linears() if name in names and name not in attention)
    sliding = adapters(spec.attention_linears()) + mlp
    total = full * (adapters(layout.attention_linears(spec)) + mlp) + (layers - full) * sliding
    # the E sizes' shared-KV layers: no k_proj / v_proj to wrap; the E2B's MLP there is twice as wide
    wider = sum(r * spec.intermediate_size for name in spec.mlp_linears() if name in names)
    for kind in layout.shared_types(layers):
        total -= adapters({k: v for k, v in _attention_of(spec, kind)[0].items() if k in ("k_proj", "v_proj")})
        total += wider if layout.double_wide_mlp else 0
    return total


def config_fields(file: object, config: dict[str, Any], gemma4: bool) -> dict[str, Any]:
    """The `global_layers` field of a Gemma 4 text config.json (with the E sizes' per-layer inputs, shared-KV layers
    and audio tower) and, with enable_moe_block, its experts (under Gemma4TextConfig's names num_experts,
    top_k_experts); an irregular layer_types is refused in one line."""
    if not gemma4:
        return {}
    layers = config.get("num_hidden_layers")
    types = config.get("layer_types")
    interval = types.index("full_attention") + 1 if isinstance(types, list) and "full_attention" in types else None
    fields = {
        "global_head_dim": config.get("global_head_dim") or 512,  # Gemma4TextConfig's default
        "num_global_key_value_heads": config.get("num_key_value_heads") or config.get("num_attention_heads"),
        "attention_k_eq_v": config.get("attention_k_eq_v") is True,
        "interval": interval or config.get("sliding_window_pattern") or DEFAULT_INTERVAL,
        "sliding_window": config.get("sliding_window") or 512,
        "final_logit_softcapping": config.get("final_logit_softcapping"),
        "per_layer_input": config.get("hidden_size_per_layer_input", PER_LAYER_INPUT_DEFAULT) or 0,
        "per_layer_vocab": config.get("vocab_size_per_layer_input") or PER_LAYER_VOCAB_DEFAULT,
        "kv_shared_layers": config.get("num_kv_shared_layers") or 0,
        "double_wide_mlp": config.get("use_double_wide_mlp") is True,
        "audio": bool(config.get("audio_config")),
    }
    if fields["attention_k_eq_v"] and config.get("num_global_key_value_heads") is not None:
        fields["num_global_key_value_heads"] = config["num_global_key_value_heads"]
    fields |= _saved_overrides(file, config.get("per_layer_config"), types)
    try:
        layout = GlobalLayers.model_validate(fields)
    except ValidationError as error:
        raise InvalidConfig(f"{file}: a Gemma 4 global-layer key is not usable: {error.errors()[0]['msg']}") from None
    if types is not None and isinstance(layers, int) and types != layout.layer_types(layers):
        raise InvalidConfig(
            f"{file}: layer_types is not one full-attention layer in every {layout.interval} (and the last); "
            "lorafit models that regular pattern only, as every released Gemma 4 has it"
        )
    moe = config.get("enable_moe_block") is True
    experts = {"num_local_experts": config.get("num_experts") or 0, "num_experts_per_tok": config.get("top_k_experts")}
    if moe and not (
        experts["num_local_experts"] and experts["num_experts_per_tok"] and config.get("moe_intermediate_size")
    ):
        raise InvalidConfig(f"{file}: enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
    return {"global_layers": layout} | (experts if moe else {"num_local_experts": 0, "moe_intermediate_size": None})


def _saved_overrides(file: object, per_layer: object, types: object) -> dict[str, Any]:
    """The global layers' head_dim and KV heads from the `per_layer_config` that transformers writes in place of
    global_head_dim / num_global_key_value_heads when it saves a config (layer index -> overrides); they must be
    the same for every full-attention layer and absent from the others, as __post_init__ makes them."""
    if not per_layer:
        return {}
    names = {"head_dim": "global_head_dim", "num_key_value_heads": "num_global_key_value_heads"}
    kinds = types if isinstance(types, list) else []
    overrides = per_layer.values() if isinstance(per_layer, dict) else [None]
    full = {str(i) for i, kind in enumerate(kinds) if kind == "full_attention"}
    if (
        not isinstance(per_layer, dict)
        or {str(int(key)) for key in per_layer if str(key).isdigit()} != full
        or any(not isinstance(entry, dict) or set(entry) - set(names) for entry in overrides)
        or len({json.dumps(entry, sort_keys=True) for entry in overrides}) != 1
    ):
        raise InvalidConfig(
            f"{file}: per_layer_config is not one head_dim / num_key_value_heads override for every full-attention "
            "layer; lorafit models that, as transformers writes it for every released Gemma 4"
        )
    return {names[key]: value for key, value in next(iter(per_layer.values())).items()}
