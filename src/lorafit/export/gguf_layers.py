"""Per-layer attention shapes for GGUF: Gemma 4's full-attention layers have their own head size and KV heads
(transformers 5.25 configuration_gemma4.py: per_layer_config, from global_head_dim / num_global_key_value_heads)
and a "proportional" rope on a quarter of their head. llama.cpp's gemma4 (llama-cpp-python 0.3.36, src/models/
gemma4.cpp load_arch_hparams; conversion/gemma.py Gemma4Model) reads them as head_count_kv per layer, key/value
length for the full layers and *_swa for the sliding ones, and a rope_freqs tensor whose factor 1e30 stops the
rotation of the dimensions transformers leaves unrotated (inv_freq 0)."""

from __future__ import annotations

from typing import Any

from lorafit.errors import ExportError

UNROTATED = 1e30  # llama.cpp divides the angle by the factor: 1e30 leaves the dimension as it is (converter's value)


def overrides(config: dict[str, Any], layer: int) -> dict[str, Any]:
    """The layer's own settings (per_layer_config's keys are ints in memory, strings in config.json, zero-padded
    to the width of the layer count: "05" of 12 layers)."""
    table = {int(key): value for key, value in (config.get("per_layer_config") or {}).items()}
    return dict(table.get(layer) or {})


def per_layer(config: dict[str, Any], key: str, default: int) -> list[int]:
    return [int(overrides(config, layer).get(key, default)) for layer in range(int(config["num_hidden_layers"]))]


def full_head_dim(config: dict[str, Any], sliding_head_dim: int) -> int:
    """The full-attention layers' head size (llama.cpp's key_length; one value for all of them)."""
    full = [i for i, kind in enumerate(config.get("layer_types") or []) if kind == "full_attention"]
    sizes = {int(overrides(config, i).get("head_dim", sliding_head_dim)) for i in full} or {sliding_head_dim}
    if len(sizes) > 1:
        raise ExportError(f"full-attention layers of head sizes {sorted(sizes)}: llama.cpp reads one")
    return sizes.pop()


def proportional_factors(rope: dict[str, Any], head_dim: int) -> list[float]:
    """rope_freqs for a proportional rope: the first partial_rotary_factor of each half rotates as a full-width
    rope would (transformers' _compute_proportional_rope_parameters), the rest not at all."""
    rotated = int(head_dim * float(rope.get("partial_rotary_factor", 1.0)) / 2)
    return [1.0] * rotated + [UNROTATED] * (head_dim // 2 - rotated)


def write_layer_shapes(writer: Any, config: dict[str, Any], sliding_head_dim: int) -> None:
    """The keys llama.cpp's gemma4 requires besides Gemma 3's: the sliding layers' head size and rotated width,
    the per-layer input width and the shared-KV layers (the E2B's and E4B's; 0 for the 31B and 26B-A4B), as
    conversion/gemma.py Gemma4Model.set_gguf_parameters writes them."""
    sliding = (config.get("rope_parameters") or {}).get("sliding_attention") or {}
    writer.add_key_length_swa(sliding_head_dim)
    writer.add_value_length_swa(sliding_head_dim)
    writer.add_rope_dimension_count_swa(int(sliding_head_dim * float(sliding.get("partial_rotary_factor", 1.0))))
    writer.add_embedding_length_per_layer_input(int(config.get("hidden_size_per_layer_input") or 0))
    writer.add_shared_kv_layers(shared_kv_layers(config))


def shared_kv_layers(config: dict[str, Any]) -> int:
    """The shared-KV layer count, where llama.cpp reads the same keys and values as transformers: transformers'
    shared layers read the last unshared layer of their kind (Gemma4TextConfig.kv_sharing_modes), llama.cpp's the
    last unshared layer for a full-attention one and the one before it for a sliding one (llama-model.cpp
    create_memory's reuse for LLM_ARCH_GEMMA4): the same layers where those two end in sliding, full, as the E2B and
    E4B do."""
    shared = int(config.get("num_kv_shared_layers") or 0)
    types = list(config.get("layer_types") or [])
    first = len(types) - shared
    if shared and (first < 2 or types[first - 2 : first] != ["sliding_attention", "full_attention"]):
        raise ExportError(
            f"the last layers before the {shared} shared-KV layers are {types[max(first - 2, 0) : first]}, not a "
            "sliding then a full-attention one: llama.cpp's gemma4 would read other layers' keys and values than "
            "transformers; export --to merged"
        )
    return shared


def feed_forward_length(config: dict[str, Any], layers: int) -> int | list[int]:
    """The MLP width, per layer where the E2B's shared-KV layers have a double-wide one (use_double_wide_mlp;
    conversion/gemma.py writes the same array)."""
    width = int(config["intermediate_size"])
    if not config.get("use_double_wide_mlp") or not config.get("num_kv_shared_layers"):
        return width
    first_shared = layers - int(config["num_kv_shared_layers"])
    return [width if n < first_shared else 2 * width for n in range(layers)]
