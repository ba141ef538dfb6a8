"""DeepSeek-style blocks: multi-head latent attention (MLA) and an MoE with shared experts after a few dense layers
(DeepSeek-V2 / V2-Lite / Coder-V2, DeepSeek-V3 / R1, Mistral 4), as transformers 5.25 builds them
(models/deepseek_v2/modeling_deepseek_v2.py DeepseekV2Attention, DeepseekV2Moe, DeepseekV2DecoderLayer;
models/deepseek_v3/modeling_deepseek_v3.py the same modules, whose router adds an `e_score_correction_bias`
buffer, not a parameter; models/mistral4/modeling_mistral4.py the same modules again, with Llama 4's query
scaling).

Attention: q is `q_proj` (h -> heads x (nope + rope)), or, with `q_lora_rank`, `q_a_proj` (h -> q_lora_rank), an
RMSNorm and `q_b_proj`; keys and values come from one latent: `kv_a_proj_with_mqa` (h -> kv_lora_rank + rope),
an RMSNorm of its first kv_lora_rank columns and `kv_b_proj` (kv_lora_rank -> heads x (nope + v)); the rope part
of the key is one head shared by all. `o_proj` takes heads x v. For the estimate the block reads as standard
attention with head_dim = nope + rope and as many key/value heads as heads (what `expand_kv` materialises for
the attention kernel), plus what the latent keeps (`LatentAttention.saved_bytes_per_token`).

MLP: the first `first_k_dense_replace` blocks run a dense SwiGLU of `intermediate_size`; every later one routes
to `num_experts_per_tok` of the fused 3-D experts (as Qwen3-MoE's: bitsandbytes leaves them 16-bit) and always
runs `n_shared_experts` x `moe_intermediate_size` wide shared SwiGLU (three `nn.Linear`, which 4-bit packs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lorafit.errors import InvalidConfig


class Shapes(Protocol):
    """The ModelSpec fields read here (models.py imports this module, not the reverse)."""

    hidden_size: int
    intermediate_size: int
    num_local_experts: int
    num_hidden_layers: int
    latent: LatentAttention | None

    @property
    def architecture(self) -> str: ...

    @property
    def mlp_width(self) -> int: ...

    def layer_linears(self) -> tuple[tuple[str, int, int, int], ...]: ...


class Family(Protocol):
    """The ArchitectureSpec field read here."""

    name: str


# The families of catalog/architectures.toml built of these blocks (a part of models.Architecture)
LatentFamily = Literal["deepseek_v2", "deepseek_v3", "mistral4"]

# The config.json keys a LatentAttention is read from (and written back to for a tiny test model)
LATENT_KEYS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_shared_experts",
    "first_k_dense_replace",
)


class LatentAttention(BaseModel):
    """The keys of a DeepSeek-style config.json that standard attention and MoE do not have."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    q_lora_rank: int | None = Field(default=None, gt=0, le=1 << 16)
    kv_lora_rank: int = Field(gt=0, le=1 << 16)
    qk_nope_head_dim: int = Field(gt=0, le=4096)
    qk_rope_head_dim: int = Field(gt=0, le=4096)
    v_head_dim: int = Field(gt=0, le=4096)
    n_shared_experts: int = Field(default=0, ge=0, le=64)
    first_k_dense_replace: int = Field(default=0, ge=0, le=1024)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def attention_linears(self, hidden: int, heads: int) -> dict[str, tuple[int, int]]:
        """(in, out) of each attention projection, by transformers' module name."""
        q_out = heads * self.qk_head_dim
        if self.q_lora_rank is None:
            q = {"q_proj": (hidden, q_out)}
        else:
            q = {"q_a_proj": (hidden, self.q_lora_rank), "q_b_proj": (self.q_lora_rank, q_out)}
        return q | {
            "kv_a_proj_with_mqa": (hidden, self.kv_lora_rank + self.qk_rope_head_dim),
            "kv_b_proj": (self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim)),
            "o_proj": (heads * self.v_head_dim, hidden),
        }

    @property
    def norm_params(self) -> int:
        """q_a_layernorm (with q_lora_rank) and kv_a_layernorm: one weight per latent column."""
        return (self.q_lora_rank or 0) + self.kv_lora_rank

    def shared_linears(self, hidden: int, expert_width: int) -> dict[str, tuple[int, int]]:
        """The shared experts' SwiGLU (`mlp.shared_experts`), n_shared_experts x moe_intermediate_size wide."""
        width = self.n_shared_experts * expert_width
        if width == 0:
            return {}
        return {
            "shared_experts.gate_proj": (hidden, width),
            "shared_experts.up_proj": (hidden, width),
            "shared_experts.down_proj": (width, hidden),
        }

    def qv_names(self) -> tuple[str, ...]:
        """`--lora-targets qv` on MLA: the query's last projection and kv_b_proj, which makes the values."""
        return ("q_proj" if self.q_lora_rank is None else "q_b_proj", "kv_b_proj")

    def dense_layer_deltas(self, spec: Shapes) -> tuple[int, int]:
        """(linear, other) parameters the `first_k_dense_replace` dense blocks have beyond (or short of) as many
        MoE blocks, which the per-block counts describe: a dense SwiGLU of `intermediate_size` (three Linears)
        instead of the shared experts' Linears, and no router (experts x hidden) nor fused experts."""
        h, experts = spec.hidden_size, spec.num_local_experts
        k = min(self.first_k_dense_replace, spec.num_hidden_layers)
        shared = sum(i * o for i, o in self.shared_linears(h, spec.mlp_width).values())
        routed = experts * h + experts * 3 * h * spec.mlp_width
        return k * (3 * h * spec.intermediate_size - shared), -k * routed

    def saved_bytes_per_token(self, hidden_states_bytes: float, heads: int, attention_bytes: float) -> float:
        """What an MLA block keeps for backward beyond standard attention with head_dim = nope + rope, per token.

        The latent RMSNorms (HF DeepseekV2RMSNorm upcasts to fp32 and saves that copy and the rsqrt) on
        kv_lora_rank (and q_lora_rank) columns; the rope halves of q and k, which `apply_rotary_emb` makes
        from their slices (q: heads x rope; k: one shared head) and the concatenation copies; less the value and
        output columns standard attention would have counted at nope + rope instead of v (`attention_bytes`: the
        attention kernel's element size)."""
        latent = self.kv_lora_rank + (self.q_lora_rank or 0)
        norms = 4 * latent + 4 * (2 if self.q_lora_rank else 1)
        rope = hidden_states_bytes * (heads + 1) * self.qk_rope_head_dim
        narrower_v = 2 * attention_bytes * heads * (self.qk_head_dim - self.v_head_dim)
        return norms + rope - narrower_v


# The families built of these blocks (catalog/architectures.toml), with their config classes' defaults for the keys
# a config.json leaves out (transformers 5.25 configuration_deepseek_v2.py, configuration_deepseek_v3.py,
# configuration_mistral4.py): a key given as null stays null (q_lora_rank null: no query compression)
# The families whose config class sizes the rotary tables by head_dim = qk_rope_head_dim (latent_keys)
ROPE_HEAD_DIM = ("deepseek_v2", "deepseek_v3")
DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                    "v_head_dim": 128, "n_shared_experts": 2, "first_k_dense_replace": 0},
    "deepseek_v3": {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                    "v_head_dim": 128, "n_shared_experts": 1, "first_k_dense_replace": 3},
    "mistral4": {"q_lora_rank": 1024, "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64,
                 "v_head_dim": 128, "n_shared_experts": 1, "first_k_dense_replace": 0},
}  # fmt: skip


def latent_fields(file: Path, config: dict[str, Any], family: Family) -> dict[str, Any]:
    """The ModelSpec fields of a DeepSeek-style config.json: its latent keys, and head_dim = nope + rope (the
    width q and k have in the attention kernel; DeepseekV2Config itself sets head_dim to the rope part). None for
    another family."""
    if family.name not in DEFAULTS:
        return {}
    keys = DEFAULTS[family.name] | {key: config[key] for key in LATENT_KEYS if key in config}
    try:
        latent = LatentAttention.model_validate(keys)
    except ValidationError as error:
        problem = error.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        raise InvalidConfig(f"{file}: {where}: {problem['msg']}") from None
    return {"latent": latent, "head_dim": latent.qk_head_dim}


# --- the ModelSpec hooks: each is nothing for a standard-attention model ---------------------------------------
def shared_rows(spec: Shapes) -> tuple[tuple[str, int, int, int], ...]:
    """The shared experts' linears as `ModelSpec.layer_linears` rows (name, in, out, copies)."""
    if spec.latent is None:
        return ()
    shared = spec.latent.shared_linears(spec.hidden_size, spec.mlp_width)
    return tuple((name, i, o, 1) for name, (i, o) in shared.items())


def dense_deltas(spec: Shapes) -> tuple[int, int]:
    """(linear, other) parameters of the dense first blocks beyond as many MoE blocks; (0, 0) for other models."""
    return spec.latent.dense_layer_deltas(spec) if spec.latent is not None else (0, 0)


def latent_keys(spec: Shapes) -> dict[str, Any]:
    """The config.json keys that rebuild the latent attention (for a tiny test model or the trace). The rotary
    tables are sized by head_dim: the rope part for DeepSeek (DeepseekV2Config sets it so; DeepseekV3Config keeps
    a head_dim it is given), nope + rope for Mistral 4 (ModelSpec.head_dim), whose partial_rotary_factor is
    rope / (nope + rope)."""
    if spec.latent is None:
        return {}
    if spec.architecture not in ROPE_HEAD_DIM:
        return spec.latent.model_dump()
    return spec.latent.model_dump() | {"head_dim": spec.latent.qk_rope_head_dim}


def moe_layers(spec: Shapes) -> int:
    """The blocks that route to experts: all but DeepSeek's `first_k_dense_replace` dense ones."""
    return max(spec.num_hidden_layers - (spec.latent.first_k_dense_replace if spec.latent else 0), 0)


def dense_expert_lora(spec: Shapes, r: int, names: set[str]) -> int:
    """LoRA on the routed experts (`--lora-targets experts`) counted for every block, less the dense first blocks'
    share: they have no fused experts for peft's target_parameters to find."""
    if spec.latent is None:
        return 0
    k = min(spec.latent.first_k_dense_replace, spec.num_hidden_layers)
    return k * sum(r * (i + o) * n for name, i, o, n in spec.layer_linears() if name in names and n > 1)


# --- the GGUF layout (serving.py) ---------------------------------------------------------------------------------
def gguf_attention(latent: LatentAttention, hidden: int, heads: int) -> list[tuple[str, str, int, int]]:
    """(name, kind, in, out) of the latent attention's matrices and norms as llama.cpp's deepseek2 converter names
    them (convert_hf_to_gguf.py DeepseekV2Model: attn_q or attn_q_a + attn_q_a_norm + attn_q_b, attn_kv_a_mqa,
    attn_kv_a_norm, attn_kv_b; newer converters split attn_kv_b into attn_k_b and attn_v_b, the same elements).
    Kinds for the quantisation mix: the projections read as attn_q, the output as attn_output."""
    linears = latent.attention_linears(hidden, heads)
    names = {"q_proj": "attn_q", "q_a_proj": "attn_q_a", "q_b_proj": "attn_q_b"}
    names |= {"kv_a_proj_with_mqa": "attn_kv_a_mqa", "kv_b_proj": "attn_kv_b", "o_proj": "attn_output"}
    rows = [(names[m], "attn_output" if m == "o_proj" else "attn_q", i, o) for m, (i, o) in linears.items()]
    norms = [("attn_kv_a_norm", latent.kv_lora_rank)] + (
        [("attn_q_a_norm", latent.q_lora_rank)] if latent.q_lora_rank else []
    )
    return rows + [(name, "norm", width, 1) for name, width in norms]


def gguf_mlp(spec: Shapes, layer: int) -> list[tuple[str, str, int, int]]:
    """(name, kind, in, out) of a block's MLP tensors beyond the routed experts': a dense first block's SwiGLU
    (ffn_gate, ffn_up, ffn_down; it has no experts), or the shared experts' (ffn_*_shexp)."""
    assert spec.latent is not None
    h = spec.hidden_size
    if layer < spec.latent.first_k_dense_replace:
        i = spec.intermediate_size
        return [("ffn_gate", "ffn_gate", h, i), ("ffn_up", "ffn_up", h, i), ("ffn_down", "ffn_down", i, h)]
    shared = spec.latent.n_shared_experts * spec.mlp_width
    return [
        ("ffn_gate_shexp", "ffn_gate", h, shared),
        ("ffn_up_shexp", "ffn_up", h, shared),
        ("ffn_down_shexp", "ffn_down", shared, h),
    ]
