"""The vision tower and projector of an image-text model fine-tuned on text (Gemma 3, Mistral Small 3.1 / 3.2,
Qwen2-VL, Qwen2.5-VL, Qwen3-VL): weights that are loaded, stored (and quantised) with the language model but never
trained and, for text-only rows, never run.

A `VisionTower` holds the vision_config keys that set the tower's weights, named as transformers names them, and
the image-text family (the config.json's top-level `model_type`) whose projector joins it to the language model.
The counts are the shapes of the real modules (transformers 5.25: models/siglip/modeling_siglip.py and
models/gemma3/modeling_gemma3.py Gemma3MultiModalProjector; models/pixtral/modeling_pixtral.py and
models/mistral3/modeling_mistral3.py Mistral3MultiModalProjector, Mistral3PatchMerger;
models/qwen2_5_vl/modeling_qwen2_5_vl.py Qwen2_5_VisionTransformerPretrainedModel;
models/qwen3_vl/modeling_qwen3_vl.py Qwen3VLVisionModel, whose deepstack mergers are copies of the merger that add
the image's features to the first text layers, so with no image they add nothing: Qwen3VLTextModel adds them only
when `deepstack_visual_embeds` is given), checked against the meta-device build in tests/test_vision.py.

What bitsandbytes does with them: transformers' quantizer replaces every `nn.Linear` outside
`get_keys_to_not_convert` (the tied embeddings, the LM head, the last module; quantizers/base.py) and the model's
`_keep_in_fp32_modules` (none for these families), so the tower's and projector's linears are stored in 4 bit
like the language model's; convolutions, norms, biases, position tables and Gemma 3's projection matrix (an
`nn.Parameter`, not a Linear) stay in the compute dtype.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lorafit.errors import InvalidConfig

ImageTextFamily = Literal["gemma3", "mistral3", "qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "gemma4"]

# The language model each image-text family wraps: the lorafit architecture, and the `tie_word_embeddings` that
# transformers 5.25 uses when the config.json does not say (Gemma3Config and Mistral3Config default True,
# Qwen2_5_VLConfig, Qwen3VLConfig and Qwen3VLMoeConfig False; configuration_gemma3.py, configuration_mistral3.py,
# configuration_qwen2_5_vl.py, configuration_qwen3_vl.py, configuration_qwen3_vl_moe.py). Qwen3-VL's text model is
# Qwen3 (q/k norms), Qwen3-VL-MoE's Qwen3-MoE (Qwen3VLMoeTextExperts: fused 3-D experts, as Qwen3MoeExperts).
IMAGE_TEXT_FAMILIES: tuple[str, ...] = (
    "gemma3",
    "mistral3",
    "qwen2_5_vl",
    "qwen2_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "gemma4",
)
TEXT_ARCHITECTURE: dict[str, str] = {
    "gemma3": "gemma3",
    "mistral3": "mistral",
    "qwen2_5_vl": "qwen2",
    "qwen2_vl": "qwen2",
    "qwen3_vl": "qwen3",
    "qwen3_vl_moe": "qwen3_moe",
    "gemma4": "gemma4",
}
TIED_BY_DEFAULT: dict[str, bool] = {
    "gemma3": True,
    "mistral3": True,
    "qwen2_5_vl": False,
    "qwen2_vl": False,
    "qwen3_vl": False,
    "qwen3_vl_moe": False,
    "gemma4": True,  # Gemma4Config
}
QWEN3_VL_FAMILIES = ("qwen3_vl", "qwen3_vl_moe")
# Gemma 3's first config.json files name few text keys and let Gemma3TextConfig's defaults fill the rest
# (configuration_gemma3.py): the defaults, for a text_config that leaves them out
TEXT_DEFAULTS: dict[str, dict[str, int]] = {
    "gemma3": {
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131_072,
    },
}

# vision_config key -> VisionTower field, per family (the key names of SiglipVisionConfig, PixtralVisionConfig,
# Qwen2_5_VLVisionConfig), and the config classes' defaults for a key the config.json leaves out.
_SAME_NAMES = {
    name: name
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "patch_size",
        "image_size",
        "num_channels",
    )
}
_QWEN_VL_NAMES = {
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "depth",
    "num_attention_heads": "num_heads",
    "patch_size": "patch_size",
    "num_channels": "in_channels",
    "temporal_patch_size": "temporal_patch_size",
    "spatial_merge_size": "spatial_merge_size",
}
_KEYS: dict[str, dict[str, str]] = {
    "gemma3": _SAME_NAMES,
    "mistral3": _SAME_NAMES,
    "qwen2_5_vl": _QWEN_VL_NAMES,
    # Qwen3-VL's tower adds a learned position table and the layers its deepstack mergers read
    "qwen3_vl": _QWEN_VL_NAMES
    | {"num_position_embeddings": "num_position_embeddings", "deepstack_visual_indexes": "deepstack_visual_indexes"},
    # Qwen2-VL's: the MLP width is embed_dim x mlp_ratio; vision_config's hidden_size is the merger's output
    "qwen2_vl": {key: name for key, name in _QWEN_VL_NAMES.items() if key != "intermediate_size"}
    | {"hidden_size": "embed_dim"},
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3": {  # SiglipVisionConfig
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "patch_size": 16,
        "image_size": 224,
        "num_channels": 3,
    },
    "mistral3": {  # PixtralVisionConfig; Mistral3Config's spatial_merge_size 2
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "patch_size": 16,
        "image_size": 1024,
        "num_channels": 3,
        "spatial_merge_size": 2,
    },
    "qwen2_5_vl": {  # Qwen2_5_VLVisionConfig
        "hidden_size": 3584,
        "intermediate_size": 3420,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "patch_size": 14,
        "num_channels": 3,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
    },
    "qwen3_vl": {  # Qwen3VLVisionConfig (Qwen3VLMoeVisionConfig has the same defaults)
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "patch_size": 16,
        "num_channels": 3,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": (8, 16, 24),
    },
    "qwen2_vl": {  # Qwen2VLVisionConfig (mlp_ratio 4)
        "hidden_size": 1280,
        "intermediate_size": 4 * 1280,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "patch_size": 14,
        "num_channels": 3,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
    },
}
_KEYS["qwen3_vl_moe"], _DEFAULTS["qwen3_vl_moe"] = _KEYS["qwen3_vl"], _DEFAULTS["qwen3_vl"]
# Gemma 4's own encoder (Gemma4VisionConfig, its defaults): a 2-D position table of position_embedding_size rows
_KEYS["gemma4"] = _SAME_NAMES | {"num_position_embeddings": "position_embedding_size"}
_DEFAULTS["gemma4"] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 16,
    "num_attention_heads": 12,
    "patch_size": 16,
    "num_position_embeddings": 10 * 1024,
}
del _KEYS["gemma4"]["image_size"], _KEYS["gemma4"]["num_channels"]  # it takes any size; patches are RGB


class VisionTower(BaseModel):
    """The vision encoder and projector of an image-text model, as its config.json's vision_config states them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    family: ImageTextFamily = Field(description="the image-text config.json's model_type")
    hidden_size: int = Field(gt=0, le=1 << 16)
    intermediate_size: int = Field(gt=0, le=1 << 18)
    num_hidden_layers: int = Field(gt=0, le=1024)
    num_attention_heads: int = Field(gt=0, le=1024)
    patch_size: int = Field(gt=0, le=1024)
    image_size: int = Field(default=224, gt=0, le=1 << 16)  # SigLIP: its position table has one row per patch
    num_channels: int = Field(default=3, gt=0, le=64)
    spatial_merge_size: int = Field(default=2, gt=0, le=64)  # Pixtral's patch merger, Qwen's merger
    temporal_patch_size: int = Field(default=2, gt=0, le=64)  # Qwen's 3-D patch embedding
    num_position_embeddings: int = Field(default=2304, gt=0, le=1 << 20)  # Qwen3-VL's learned position table
    deepstack_visual_indexes: tuple[int, ...] = Field(default=(), max_length=1024)  # Qwen3-VL: a merger for each

    def linear_params(self, text_hidden: int) -> int:
        """Weights of the tower's and projector's `nn.Linear` layers (biases excluded): what bitsandbytes packs."""
        d, i, n = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        merged = d * self.spatial_merge_size**2
        if self.family == "gemma3":  # SigLIP: q, k, v, out_proj (d x d), fc1 and fc2 (d x i)
            return n * (4 * d * d + 2 * d * i)
        if self.family == "gemma4":  # q, k, v, o, gate, up, down and the patches' input_proj
            return n * (4 * d * d + 3 * d * i) + 3 * self.patch_size**2 * d
        if self.family == "mistral3":  # Pixtral: q, k, v, o and gate, up, down; merging_layer, linear_1, linear_2
            return n * (4 * d * d + 3 * d * i) + merged * d + d * text_hidden + text_hidden * text_hidden
        merger = merged * merged + merged * text_hidden  # Qwen's merger: a two-layer MLP
        if self.family == "qwen2_vl":  # fused qkv (d x 3d), proj, fc1, fc2
            return n * (4 * d * d + 2 * d * i) + merger
        if self.family in QWEN3_VL_FAMILIES:  # qkv, proj, linear_fc1, linear_fc2; the merger and its deepstack copies
            return n * (4 * d * d + 2 * d * i) + (1 + len(self.deepstack_visual_indexes)) * merger
        return n * (4 * d * d + 3 * d * i) + merger  # Qwen2.5-VL: qkv, proj, gate, up, down

    def other_params(self, text_hidden: int) -> int:
        """The tower's and projector's weights outside its linears: patch embedding, positions, norms, biases,
        and Gemma 3's projection matrix (an nn.Parameter)."""
        d, i, n, c, p = (
            self.hidden_size,
            self.intermediate_size,
            self.num_hidden_layers,
            self.num_channels,
            self.patch_size,
        )
        merged = d * self.spatial_merge_size**2
        if self.family == "gemma4":  # the x and y position tables; four norms and the q/k norms of each layer;
            # embed_vision's projection, a Linear that get_keys_to_not_convert leaves 16-bit (the model's last module)
            positions = 2 * self.num_position_embeddings * d
            return positions + n * (4 * d + 2 * (d // self.num_attention_heads)) + d * text_hidden
        if self.family == "gemma3":
            patches = (self.image_size // p) ** 2
            embeddings = c * p * p * d + d + patches * d  # conv with bias, one position per patch
            per_layer = 4 * d + i + d + 2 * 2 * d  # q/k/v/out and fc1/fc2 biases, two LayerNorms (weight and bias)
            projector = d * text_hidden + d  # mm_input_projection_weight, mm_soft_emb_norm
            return embeddings + n * per_layer + 2 * d + projector  # + post_layernorm
        if self.family == "mistral3":
            embeddings = c * p * p * d + d  # conv without bias, ln_pre
            return embeddings + n * 2 * d + d  # attention_norm, ffn_norm; the projector's norm
        patch_embed = c * self.temporal_patch_size * p * p * d  # Conv3d without bias
        if self.family in QWEN3_VL_FAMILIES:  # a biased Conv3d and a learned position table (an nn.Embedding)
            embeddings = patch_embed + d + self.num_position_embeddings * d
            per_layer = 3 * d + d + i + d + 2 * 2 * d  # qkv, proj, fc1, fc2 biases; two LayerNorms
            # the merger's LayerNorm is d wide, each deepstack merger's merged-wide (use_postshuffle_norm)
            deepstack = len(self.deepstack_visual_indexes) * (2 * merged + merged + text_hidden)
            return embeddings + n * per_layer + 2 * d + merged + text_hidden + deepstack
        if self.family == "qwen2_vl":  # biases of qkv, proj, fc1, fc2; two LayerNorms; ln_q (a LayerNorm too)
            return patch_embed + n * (3 * d + d + i + d + 2 * 2 * d) + 2 * d + merged + text_hidden
        per_layer = 3 * d + d + 2 * i + d + 2 * d  # qkv, proj, gate, up, down biases; two RMSNorms
        merger = d + merged + text_hidden  # ln_q, the two biases
        return patch_embed + n * per_layer + merger

    def params(self, text_hidden: int) -> int:
        return self.linear_params(text_hidden) + self.other_params(text_hidden)

    def to_hf_config(self, text_hidden: int) -> dict[str, Any]:
        """The vision_config transformers builds this tower from."""
        keys = _KEYS[self.family]
        config: dict[str, Any] = {key: getattr(self, field) for field, key in keys.items()}
        if "deepstack_visual_indexes" in config:
            config["deepstack_visual_indexes"] = list(self.deepstack_visual_indexes)
        if self.family == "qwen2_5_vl" or self.family in QWEN3_VL_FAMILIES:
            config["out_hidden_size"] = text_hidden  # the merger's output feeds the language model
        elif self.family == "qwen2_vl":
            config |= {"hidden_size": text_hidden, "mlp_ratio": self.intermediate_size // self.hidden_size}
        elif self.family == "gemma3":
            config |= {"model_type": "siglip_vision_model", "vision_use_head": False}
        elif self.family == "mistral3":
            config |= {"model_type": "pixtral", "head_dim": self.hidden_size // self.num_attention_heads}
        elif self.family == "gemma4":
            heads, head_dim = self.num_attention_heads, self.hidden_size // self.num_attention_heads
            config |= {"model_type": "gemma4_vision", "num_key_value_heads": heads, "head_dim": head_dim}
        return config

    def text_keys(self, head_size: int) -> dict[str, Any]:
        """Keys the language model's config needs beside the shapes: Qwen2.5-VL's multimodal rotary embedding
        splits each head's rotary half into [16, 24, 24] (time, height, width) for its 128-wide heads
        (Qwen2_5_VLRotaryEmbedding's default), Qwen3-VL's into [24, 20, 20], interleaved (its checkpoints'
        rope_scaling); a narrower head (a tiny test model) gets the same proportions."""
        half = head_size // 2
        if self.family in QWEN3_VL_FAMILIES:
            time, height = half * 24 // 64, half * 20 // 64
            section = [time, height, half - time - height]
            return {"rope_parameters": {"rope_type": "default", "mrope_section": section, "mrope_interleaved": True}}
        if self.family not in ("qwen2_5_vl", "qwen2_vl"):
            return {}
        time, height = half * 16 // 64, half * 24 // 64
        return {"rope_parameters": {"rope_type": "default", "mrope_section": [time, height, half - time - height]}}

    def wrapper_keys(self) -> dict[str, Any]:
        """The image-text config's own keys that shape the projector."""
        if self.family == "mistral3":
            return {"spatial_merge_size": self.spatial_merge_size, "multimodal_projector_bias": False}
        if self.family == "gemma3":
            # Gemma3MultiModalProjector pools (image_size / patch_size)^2 patches to mm_tokens_per_image tokens
            return {"mm_tokens_per_image": min(256, (self.image_size // self.patch_size) ** 2)}
        return {}


def read_vision(config: dict[str, Any], file: object) -> VisionTower | None:
    """The VisionTower of an image-text config.json whose family lorafit models, or None for any other config.

    A setting that changes the weights in a way the counts do not follow is refused in one line."""
    family = config.get("model_type")
    vision = config.get("vision_config")
    if family not in _KEYS or not isinstance(vision, dict):
        return None
    if family == "gemma3" and vision.get("vision_use_head", True) is not False:
        raise InvalidConfig(f"{file}: vision_config.vision_use_head must be false, as in every Gemma 3 checkpoint")
    if family == "mistral3":
        if config.get("multimodal_projector_bias"):
            raise InvalidConfig(f"{file}: multimodal_projector_bias true is not modelled (Mistral Small 3.x has none)")
        if isinstance(config.get("vision_feature_layer"), list):
            raise InvalidConfig(f"{file}: a list of vision_feature_layer is not modelled (Mistral Small 3.x uses -1)")
    fields: dict[str, Any] = {"family": family} | _DEFAULTS[family]
    for field, key in _KEYS[family].items():
        if vision.get(key) is not None:
            fields[field] = vision[key]
    if family == "qwen2_vl":
        ratio = vision.get("mlp_ratio", 4)
        if type(ratio) not in (int, float) or not 0 < ratio <= 64:
            raise InvalidConfig(f"{file}: vision_config.mlp_ratio must be a number")
        fields["intermediate_size"] = int(fields["hidden_size"] * ratio) if type(fields["hidden_size"]) is int else 0
    if family == "mistral3" and config.get("spatial_merge_size") is not None:
        fields["spatial_merge_size"] = config["spatial_merge_size"]
    stacked = fields.pop("deepstack_visual_indexes", ())
    if not isinstance(stacked, (list, tuple)) or any(type(index) is not int for index in stacked):
        raise InvalidConfig(f"{file}: vision_config.deepstack_visual_indexes must be a list of layer numbers")
    for field, value in fields.items():
        if field != "family" and type(value) is not int:
            raise InvalidConfig(f"{file}: vision_config.{_KEYS[family].get(field, field)} must be a whole number")
    if family in QWEN3_VL_FAMILIES:
        fields["deepstack_visual_indexes"] = tuple(stacked)
    try:
        return VisionTower.model_validate(fields)
    except ValueError as error:
        raise InvalidConfig(f"{file}: vision_config: {str(error).splitlines()[-1].strip()}") from None
