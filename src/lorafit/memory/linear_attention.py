"""What a hybrid's Gated DeltaNet layer (Qwen3.5's linear attention) keeps for backward, per token, in place of
attention's saved q, k, v and scores.

Read from the path transformers 5.25 runs without the flash-linear-attention and causal-conv1d packages (the
`use_kernel_func_from_hub_with_fallback` fallbacks of models/qwen3_5/modeling_qwen3_5.py): `causal_conv1d_fn`, a
depthwise `F.conv1d` then SiLU, and `torch_chunk_gated_delta_rule`, which works in fp32 on chunks of C = 64 tokens
(`chunk_size`'s default) and scans the chunks in a Python loop, and `Qwen3_5RMSNormGated`. Per token (c the
compute dtype's bytes; conv = 2 key_dim + value_dim; K = value heads x key head dim, the keys repeated to every
value head; V = value_dim; H = value heads):

- the convolution keeps its input and SiLU the convolution's output: 2c x conv;
- in fp32: l2norm keeps q and k (2 K), k_beta's product the normalised k (K), the QK^T / KK^T matmuls k_beta and
  the scaled q (2 K), the second triangular solve its output k_cumdecay (K), the decayed q and k the scan's
  matmuls read (2 K): 8 x 4K; v (4V), the first solve's output (4V) and each chunk's v_new (4V);
- the C x C per-chunk matrices, 4C bytes per token and head each: the pairwise decay, KK^T, QK^T, the solved
  system and the intra-chunk attention: 5 x 4CH;
- the scan's recurrent state before each chunk (H x key head dim x value head dim in fp32, once per C tokens);
- the gated norm: its fp32 input (4V), the fp32 gate z SiLU keeps (4V) and its output (4V), the normalised
  value in the compute dtype the gate multiplies (cV);
- per head, a handful of fp32 scalars (beta, the decays' exps, the norms' rsqrt, softplus): 11 x 4H.

Checked against the traced step in tests/test_qwen35.py.
"""

from __future__ import annotations

from lorafit.models import ModelSpec
from lorafit.schema import Settings
from lorafit.units import DTYPE_BYTES

CHUNK = 64  # torch_chunk_gated_delta_rule's chunk_size default (transformers 5.25)
FP32 = 4
HEAD_SCALARS = 11  # the per-head fp32 scalars listed above


def deltanet_saved_bytes(spec: ModelSpec, settings: Settings) -> float:
    """Bytes one Gated DeltaNet layer's token mixer saves per token (its LoRA inputs aside)."""
    block = spec.linear_attention
    if block is None:
        return 0.0
    c = DTYPE_BYTES[settings.precision]
    heads = block.linear_num_value_heads
    keys = heads * block.linear_key_head_dim
    values = block.value_dim
    state = FP32 * heads * block.linear_key_head_dim * block.linear_value_head_dim / CHUNK
    chunk_matrices = 5 * FP32 * CHUNK * heads
    norm = 3 * FP32 * values + c * values
    return (
        2 * c * block.conv_dim
        + 8 * FP32 * keys
        + 3 * FP32 * values
        + chunk_matrices
        + state
        + norm
        + HEAD_SCALARS * FP32 * heads
    )


def shared_expert_saved_bytes(spec: ModelSpec, settings: Settings, gated_per_width: float) -> float:
    """Bytes a hybrid MoE's gated shared expert (Qwen3-Next, Qwen3.5 MoE) saves per token beside the routed
    experts: its SwiGLU as a routed expert's (`gated_per_width` x its width), and for sigmoid(gate(x)) x
    shared(x) the shared output (c x hidden) and the sigmoid (c); its frozen Linears nothing under (Q)LoRA, under
    full fine-tuning their inputs (x, shared by gate_proj / up_proj / shared_expert_gate, and down_proj's). Read
    from Qwen3_5MoeSparseMoeBlock.forward; checked against the block's saved tensors in
    tests/test_qwen_hybrid_moe.py."""
    block = spec.linear_attention
    width = block.shared_expert_intermediate_size if block else None
    if width is None:
        return 0.0
    c = DTYPE_BYTES[settings.precision]
    inputs = c * (spec.hidden_size + width) if settings.method == "full" else 0.0
    return gated_per_width * width + c * (spec.hidden_size + 1) + inputs


# The parts of `activation_parts_per_token` that belong to the attention block, which a linear-attention layer
# does not have
ATTENTION_PARTS = ("qkv_inputs", "attention", "o_proj_input", "qk_norms", "output_gate")


def mixed_layer_parts(
    parts: dict[str, float], spec: ModelSpec, settings: Settings, lora_inputs: float
) -> dict[str, float]:
    """A hybrid's parts per token as the mean over its layers: the attention parts in the full-attention layers,
    the DeltaNet block (and `lora_inputs`, its adapted projections' saved inputs) in the others."""
    block = spec.linear_attention
    if block is None:
        return parts
    layers = spec.num_hidden_layers
    full_share = block.full_layers(layers) / layers
    mixed = {name: value * full_share if name in ATTENTION_PARTS else value for name, value in parts.items()}
    mixed["linear_attention"] = (1 - full_share) * (deltanet_saved_bytes(spec, settings) + lora_inputs)
    return mixed
