"""The linear-attention half of a hybrid model (Qwen3.5's Gated DeltaNet layers) as llama.cpp's qwen35 reads it,
and Qwen3.5 MoE's (qwen35moe: the same layers, the MoE block's shared expert and its gate beside the experts) and
Qwen3-Next's (qwen3next: the fused in_proj_qkvz / in_proj_ba as ssm_in / ssm_beta_alpha, value heads left grouped).

llama.cpp (llama-cpp-python 0.3.36: src/models/qwen35.cpp, conversion/qwen.py Qwen3NextModel and
_LinearAttentionVReorderBase) holds the DeltaNet's decay as A = -exp(A_log) (ssm_a, a bare tensor with no
`.weight`), dt_bias as ssm_dt.bias, the depthwise conv kernel without its singleton axis, and, where a layer has more
value heads than key heads, the value heads "tiled" (v0 of every key group, then v1 of every group, ...) rather than
grouped by key head as transformers keeps them, so that ggml broadcasts the key heads instead of repeating them.
Its gated RMSNorm (ssm_norm) multiplies by w, not by 1 + w as the model's other norms do. The catalog entry's
`linear_attention` table turns this on (catalog/gguf.toml).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lorafit.errors import ExportError

if TYPE_CHECKING:
    import torch

# the default interleaved-rope sections of Qwen3.5 (transformers' Qwen3_5TextConfig; conversion/qwen.py
# _Qwen35MRopeMixin), which llama.cpp's qwen35 loader requires; on text every axis has the token's position
DEFAULT_SECTIONS = [11, 11, 10, 0]


def _table(entry: dict[str, Any]) -> dict[str, Any] | None:
    table = entry.get("linear_attention")
    return table if isinstance(table, dict) else None


def check(entry: dict[str, Any], config: dict[str, Any]) -> None:
    """llama.cpp's qwen35 sizes a value head by the key head (head_v_dim = ssm_d_state): other widths are refused."""
    if _table(entry) is None:
        return
    key, value = config.get("linear_key_head_dim"), config.get("linear_value_head_dim")
    if key != value:
        raise ExportError(
            f"llama.cpp's {entry['arch']} needs linear_key_head_dim = linear_value_head_dim, and this model has "
            f"{key} and {value}: export --to merged"
        )


def tensor_name(
    entry: dict[str, Any], names: Any, known: str, shape: tuple[int, ...]
) -> tuple[str, tuple[int, ...]] | None:
    """The GGUF name and stored shape of a linear-attention parameter, or of a hybrid MoE's shared-expert gate
    (ffn_gate_inp_shexp, a vector in llama.cpp's qwen35moe: the hidden -> 1 Linear squeezed); None for any other
    tensor."""
    table = _table(entry)
    if table is not None and known.endswith(".mlp.shared_expert_gate.weight"):
        return names.get_name(known, try_suffixes=(".weight",)), shape[-1:]
    if table is None or ".linear_attn." not in known:
        return None
    for saved, renamed in table.get("rename", ()):
        if known.endswith(saved):
            known = known.removesuffix(saved) + renamed
    name = names.get_name(known, try_suffixes=(".weight", ".bias"))
    if name is None:
        return None
    if not name.endswith((".weight", ".bias")) and name.split(".")[-1] not in table.get("bare", ()):
        name += ".weight"
    squeezed = tuple(size for size in shape if size != 1) if known.endswith("conv1d.weight") else shape
    return name, squeezed


def plain_norm(entry: dict[str, Any], name: str) -> bool:
    """A norm that multiplies by w as stored (the gated ssm_norm), not shifted by the family's norm_offset."""
    table = _table(entry)
    return table is not None and name.endswith(tuple(table.get("plain_norms", ())))


def _tiled(weight: torch.Tensor, dim: int, key_heads: int, head: int) -> torch.Tensor:
    """Value heads grouped by key head (g0v0, g0v1, g1v0, ...) to tiled (g0v0, g1v0, g0v1, ...) along `dim`."""
    shape = list(weight.shape)
    per_key = shape[dim] // key_heads // head
    grouped = weight.reshape(*shape[:dim], key_heads, per_key, head, *shape[dim + 1 :])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def transform(entry: dict[str, Any], config: dict[str, Any], name: str, weight: torch.Tensor) -> torch.Tensor:
    """A linear-attention tensor as llama.cpp computes with it: A as -exp(A_log), the conv kernel squeezed, the
    value heads tiled where there are more of them than key heads."""
    import torch

    table = _table(entry)
    if table is None or not name.startswith("blk.") or not name.split(".")[2].startswith(("ssm_", "attn_")):
        return weight.reshape(-1) if name.endswith("ffn_gate_inp_shexp.weight") else weight
    part = name.split(".")[2]
    if part == "ssm_a":
        weight = -torch.exp(weight.float())
    if part == "ssm_conv1d":
        weight = weight.reshape(weight.shape[0], -1)
    key_heads, value_heads = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
    if key_heads == value_heads or table.get("grouped"):  # qwen3next reads them grouped by key head
        return weight
    key, head = int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"])
    keys = 2 * key * key_heads  # q and k rows (in_proj_qkv) or channels (conv1d) before the values
    if part in ("attn_qkv", "ssm_conv1d"):
        return torch.cat([weight[:keys], _tiled(weight[keys:], 0, key_heads, head)])
    if part == "attn_gate":
        return _tiled(weight, 0, key_heads, head)
    if part in ("ssm_alpha", "ssm_beta", "ssm_a", "ssm_dt"):
        return _tiled(weight, 0, key_heads, 1)
    if part == "ssm_out":
        return _tiled(weight, 1, key_heads, head)
    return weight


def write_hparams(writer: Any, entry: dict[str, Any], config: dict[str, Any]) -> None:
    """The DeltaNet sizes, which layers are linear attention, and the rope sections llama.cpp's qwen35 requires."""
    if _table(entry) is None:
        return
    writer.add_ssm_conv_kernel(int(config["linear_conv_kernel_dim"]))
    writer.add_ssm_state_size(int(config["linear_key_head_dim"]))
    writer.add_ssm_group_count(int(config["linear_num_key_heads"]))
    writer.add_ssm_time_step_rank(int(config["linear_num_value_heads"]))
    writer.add_ssm_inner_size(int(config["linear_value_head_dim"]) * int(config["linear_num_value_heads"]))
    interval = int(config.get("full_attention_interval") or 4)
    writer.add_full_attention_interval(interval)
    if shared := config.get("shared_expert_intermediate_size"):  # a hybrid MoE's (conversion/qwen.py Qwen2MoeModel)
        writer.add_expert_shared_feed_forward_length(int(shared))
    if layer_types := config.get("layer_types"):  # as llama.cpp's converter writes it (older gguf-py lacks the adder)
        recurrent = [kind == "linear_attention" for kind in layer_types]
        writer.add_array(f"{entry['arch']}.attention.recurrent_layers", recurrent)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    writer.add_rope_dimension_sections((list(rope.get("mrope_section") or DEFAULT_SECTIONS) + [0, 0, 0, 0])[:4])


def rope_dimensions(entry: dict[str, Any], config: dict[str, Any], head_dim: int) -> int:
    """The rotated dimensions of a head: Qwen3.5 rotates partial_rotary_factor of them (a quarter)."""
    if _table(entry) is None:
        return head_dim
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    return int(head_dim * float(factor))
