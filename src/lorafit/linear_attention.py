"""The linear-attention layers of a hybrid model (Qwen3.5's text model): Gated DeltaNet blocks that take the place
of attention in all but every `full_attention_interval`-th layer.

Shapes as transformers 5.25 builds them (models/qwen3_5/modeling_qwen3_5.py, Qwen3_5GatedDeltaNet; Qwen3-Next's
Qwen3NextGatedDeltaNet is the same block): in_proj_qkv (hidden -> 2 key_dim + value_dim), in_proj_z (hidden ->
value_dim, the output gate), in_proj_b and in_proj_a (hidden -> one value per value head: the write strength beta
and the decay's input), out_proj (value_dim -> hidden), all bias-free `nn.Linear`s; a depthwise causal Conv1d over
the q/k/v channels (conv_dim x kernel, no bias), `dt_bias` and `A_log` (one per value head) and the gated RMSNorm's
head_v_dim-wide weight. The full-attention layers are Qwen3's with an output gate (q_proj twice as wide). Every
layer has the same MLP. The counts are checked against the meta-device build in tests/test_qwen35.py.

The hybrid MoE families (Qwen3-Next, Qwen3.5 MoE: models/qwen3_next, models/qwen3_5_moe) run the same block, and
in every layer a sparse MoE block whose routed experts are Qwen3-MoE's (ModelSpec's MoE terms) plus a shared
SwiGLU expert (`mlp.shared_expert`: gate_proj, up_proj, down_proj, shared_expert_intermediate_size wide) scaled by
sigmoid(`mlp.shared_expert_gate`(x)), a hidden -> 1 `nn.Linear`: all four bias-free Linears, which 4-bit packs.
Qwen3-Next fuses the DeltaNet inputs: in_proj_qkvz (hidden -> 2 key_dim + 2 value_dim) and in_proj_ba (hidden ->
2 value heads), the same weights as Qwen3.5's four. Counts checked in tests/test_qwen_hybrid_moe.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from lorafit.errors import InvalidConfig

if TYPE_CHECKING:
    from lorafit.model_spec import LoraTargets, ModelSpec

# The config.json keys of the block (Qwen3_5TextConfig), the field names here
KEYS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
# The hybrid families whose every MLP is the sparse MoE block with a gated shared expert
MOE_FAMILIES = ("qwen3_next", "qwen3_5_moe_text")
# Qwen3_5TextConfig.__post_init__: with no `layer_types`, every `full_attention_interval`-th layer (default 4) is
# full attention, the others linear
DEFAULT_INTERVAL = 4
# The projections LoRA adapts in a linear-attention layer ("all" and "attn"): the two wide inputs and the output;
# in_proj_b / in_proj_a are one column per value head, too narrow for a rank-r adapter to be worth it
LORA_NAMES = ("in_proj_qkv", "in_proj_z", "out_proj")
# Qwen3-Next's: its fused input in_proj_qkvz carries what in_proj_qkv and in_proj_z do
FUSED_LORA_NAMES = ("in_proj_qkvz", "out_proj")
# The families whose DeltaNet inputs are fused (catalog/architectures.toml)
FUSED_FAMILIES = ("qwen3_next",)


class LinearAttention(BaseModel):
    """A hybrid's Gated DeltaNet block shape and where its full-attention layers fall."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    linear_num_key_heads: int = Field(gt=0, le=1024)
    linear_num_value_heads: int = Field(gt=0, le=1024)
    linear_key_head_dim: int = Field(gt=0, le=4096)
    linear_value_head_dim: int = Field(gt=0, le=4096)
    linear_conv_kernel_dim: int = Field(gt=0, le=64)
    full_attention_interval: int = Field(default=DEFAULT_INTERVAL, gt=0, le=1024)
    fused_inputs: bool = Field(default=False, description="Qwen3-Next's in_proj_qkvz / in_proj_ba")
    shared_expert_intermediate_size: int | None = Field(
        default=None, gt=0, le=1 << 18, description="a hybrid MoE's gated shared expert (Qwen3-Next, Qwen3.5 MoE)"
    )

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """The channels the causal convolution runs over: q, k and v together."""
        return 2 * self.key_dim + self.value_dim

    def full_layers(self, layers: int) -> int:
        """Layers i with (i + 1) % interval == 0 are full attention."""
        return layers // self.full_attention_interval

    def linears(self, hidden: int) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear-attention projection, by transformers' module name."""
        heads = self.linear_num_value_heads
        if self.fused_inputs:
            return {
                "in_proj_qkvz": (hidden, self.conv_dim + self.value_dim),
                "in_proj_ba": (hidden, 2 * heads),
                "out_proj": (self.value_dim, hidden),
            }
        return {
            "in_proj_qkv": (hidden, self.conv_dim),
            "in_proj_z": (hidden, self.value_dim),
            "in_proj_b": (hidden, heads),
            "in_proj_a": (hidden, heads),
            "out_proj": (self.value_dim, hidden),
        }

    @property
    def lora_names(self) -> tuple[str, ...]:
        return FUSED_LORA_NAMES if self.fused_inputs else LORA_NAMES

    def shared_expert_linears(self, hidden: int) -> dict[str, tuple[int, int]]:
        """(in, out) of a hybrid MoE's shared expert and its gate, by module name under `mlp` (none without)."""
        width = self.shared_expert_intermediate_size
        if width is None:
            return {}
        return {
            "shared_expert.gate_proj": (hidden, width),
            "shared_expert.up_proj": (hidden, width),
            "shared_expert.down_proj": (width, hidden),
            "shared_expert_gate": (hidden, 1),
        }

    def other_params(self) -> int:
        """Conv1d weight, dt_bias, A_log and the gated norm's weight: 16/32-bit under QLoRA."""
        return (
            self.conv_dim * self.linear_conv_kernel_dim + 2 * self.linear_num_value_heads + self.linear_value_head_dim
        )

    def layer_types(self, layers: int) -> list[str]:
        interval = self.full_attention_interval
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]

    def hf_keys(self, layers: int) -> dict[str, Any]:
        """The config.json keys transformers builds the block from."""
        keys = {key: getattr(self, key) for key in KEYS} | {"layer_types": self.layer_types(layers)}
        width = self.shared_expert_intermediate_size
        return keys | ({"shared_expert_intermediate_size": width} if width is not None else {})


def read_linear_attention(file: object, config: dict[str, Any], layers: int, family: str) -> LinearAttention:
    """The block's keys of a hybrid config.json (class defaults for those left out); `layer_types` must be the
    regular pattern of one full-attention layer in every `interval` (every released Qwen3.5 / Qwen3-Next is).
    An MoE hybrid's shared expert is as wide as its config says (Qwen3NextConfig's and Qwen3_5MoeTextConfig's
    default: 512)."""
    fields: dict[str, Any] = {key: config[key] for key in KEYS if config.get(key) is not None}
    fields["fused_inputs"] = family in FUSED_FAMILIES
    if family in MOE_FAMILIES:
        fields["shared_expert_intermediate_size"] = config.get("shared_expert_intermediate_size", 512)
    defaults = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_conv_kernel_dim": 4}
    defaults |= {"linear_key_head_dim": 128, "linear_value_head_dim": 128}  # Qwen3_5TextConfig's defaults
    fields = defaults | fields
    types = config.get("layer_types")
    interval = config.get("full_attention_interval", DEFAULT_INTERVAL)
    if types is not None and isinstance(types, list) and "full_attention" in types:
        interval = types.index("full_attention") + 1
    try:
        block = LinearAttention(**fields, full_attention_interval=interval)
    except ValueError as error:
        raise InvalidConfig(f"{file}: a linear-attention key is not a usable size: {error}") from None
    if types is not None and types != block.layer_types(layers):
        raise InvalidConfig(
            f"{file}: layer_types is not one full-attention layer in every {interval}; lorafit models that "
            "regular pattern only (every released Qwen3.5 has it)"
        )
    if block.linear_num_value_heads % block.linear_num_key_heads:
        raise InvalidConfig(f"{file}: linear_num_value_heads must be a multiple of linear_num_key_heads")
    return block


def _attention_other(plain: ModelSpec) -> int:
    """What a full-attention layer holds besides its linears and norms (ModelSpec.layer_other_params' terms)."""
    other = 2 * plain.head_size if plain.has_qk_norm else 0
    if plain.attention_bias:
        other += plain.q_size + 2 * plain.kv_size + (0 if plain.arch.qkv_bias else plain.hidden_size)
    return other


def block_totals(spec: ModelSpec) -> tuple[int, int]:
    """Weights of all decoder blocks: (their `nn.Linear`s, everything else). A hybrid's full-attention layers
    are what `ModelSpec` counts for a uniform model; each linear-attention layer swaps the attention's
    projections and q/k norms for the DeltaNet block's; an MoE hybrid's every layer adds the shared expert."""
    block, layers = spec.linear_attention, spec.num_hidden_layers
    if block is None:
        return layers * spec.layer_linear_params, layers * spec.layer_other_params
    plain = spec.model_copy(update={"linear_attention": None})
    swapped = layers - block.full_layers(layers)
    attention = sum(i * o for i, o in plain.attention_linears().values())
    mixer = sum(i * o for i, o in block.linears(spec.hidden_size).values())
    shared = sum(i * o for i, o in block.shared_expert_linears(spec.hidden_size).values())
    linear = layers * (plain.layer_linear_params + shared) + swapped * (mixer - attention)
    other = layers * plain.layer_other_params + swapped * (block.other_params() - _attention_other(plain))
    return linear, other


def lora_params(spec: ModelSpec, r: int, targets: LoraTargets) -> int:
    """LoRA A (r x in) and B (out x r) over the targeted modules of each kind of layer, as peft wraps them by name
    (a uniform model's layers are all of the full-attention kind)."""
    block, layers = spec.linear_attention, spec.num_hidden_layers
    names = set(spec.lora_target_names(targets))
    full = block.full_layers(layers) if block else layers
    copies = max(spec.num_local_experts, 1)

    def adapters(modules: dict[str, tuple[int, int]], n: int = 1) -> int:
        return sum(r * (i + o) * n for name, (i, o) in modules.items() if name in names)

    shared = adapters(spec.mlp_linears(), copies)
    shared += adapters(block.shared_expert_linears(spec.hidden_size)) if block else 0
    per_full = adapters(spec.attention_linears()) + shared
    per_linear = adapters(block.linears(spec.hidden_size)) + shared if block else 0
    return full * per_full + (layers - full) * per_linear


def linear_attention_rows(spec: ModelSpec) -> list[tuple[str, int, int, int]]:
    """`ModelSpec.layer_linears` rows of a hybrid's linear-attention projections and, in an MoE hybrid, its
    shared expert's (none for another model)."""
    block = spec.linear_attention
    if block is None:
        return []
    modules = block.linears(spec.hidden_size) | block.shared_expert_linears(spec.hidden_size)
    return [(name, i, o, 1) for name, (i, o) in modules.items()]


def shared_expert_width_share(spec: ModelSpec) -> float:
    """A hybrid MoE's shared expert as a number of routed experts' widths (0 for another model)."""
    block = spec.linear_attention
    width = block.shared_expert_intermediate_size if block else None
    return width / spec.mlp_width if width else 0.0


def config_fields(file: object, config: dict[str, Any], family: str, hybrid: bool) -> dict[str, Any]:
    """The ModelSpec field a hybrid family's config.json sets (its family has the attention output gate)."""
    if not hybrid:
        return {}
    layers = config.get("num_hidden_layers")
    layers = layers if isinstance(layers, int) else 0
    return {"linear_attention": read_linear_attention(file, config, layers, family)}


def chunk_flops_per_token(block: LinearAttention, chunk: int = 64) -> float:
    """Forward FLOPs of one linear-attention layer's chunked gated delta rule per token, its projections aside
    (transformers 5.25 torch_chunk_gated_delta_rule, chunk_size 64). Per value head, with C the chunk, dk and dv
    the head widths: k_beta K^T and Q K^T within the chunk (2 x 2C dk), the two unit-triangular solves against
    v_beta and the decayed k_beta (C (dv + dk): C^2 / 2 multiply-adds per column and chunk), and the scan's
    reads of the recurrent state by k_cumdecay and q (2 x 2 dk dv), the intra-chunk attention times v_new
    (2C dv) and the state update K^T v_new (2 dk dv)."""
    dk, dv = block.linear_key_head_dim, block.linear_value_head_dim
    per_head = 4 * chunk * dk + chunk * (dk + dv) + 2 * chunk * dv + 6 * dk * dv
    return block.linear_num_value_heads * per_head
