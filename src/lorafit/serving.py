"""Memory to serve the fine-tuned, merged model: weights in each export format, KV cache, compute buffer.

Answers "GGUF, GPTQ or AWQ, and which cards run it at what context" with numbers. Pure Python, no torch.

GGUF weights are summed tensor by tensor, as llama.cpp's converter names and shapes them, each in the ggml type
llama-quantize would choose for it (`ggml_types`): the file type's base type, except where the "_m"/"_s" mixes
give more bits to the value projections, the down projections and the output matrix, and where a row is not a
multiple of the type's block (fallback). The block sizes and the fallbacks are data (catalog/formats.toml);
the rules are read from src/llama-quant.cpp (llama.cpp commit 007dbbf) and restated here.
tests/test_serving.py checks the sums against the byte sizes of published GGUF files.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import cache, lru_cache
from importlib import resources
from typing import Literal, cast

from pydantic import Field

from lorafit import gemma4, hardware, mla
from lorafit.choices import Frozen
from lorafit.errors import InvalidConfig
from lorafit.gemma4 import layer_view
from lorafit.hardware import GpuSpec
from lorafit.models import ModelSpec
from lorafit.units import gib

Category = Literal[
    "token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_up", "ffn_gate", "ffn_down"
]
Kind = Category | Literal["norm", "bias", "router"]


@cache
def formats() -> dict:
    """catalog/formats.toml: ggml block sizes, fallbacks, GGUF file types, GPTQ/AWQ packing, runtime figures."""
    return tomllib.loads(resources.files("lorafit").joinpath("catalog/formats.toml").read_text())


def gguf_types() -> tuple[str, ...]:
    return tuple(formats()["gguf"])


# --- the tensors of a GGUF file -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Tensor:
    """One tensor as llama.cpp stores it: `row` is ne[0] (the input features of a linear layer, the length that
    must be a multiple of a block), `rows` the product of the other dimensions (experts included)."""

    name: str
    kind: Kind
    row: int
    rows: int = 1
    layer: int | None = None

    @property
    def elements(self) -> int:
        return self.row * self.rows

    @property
    def is_matrix(self) -> bool:
        return self.kind not in ("norm", "bias")


POST_NORMS = ["post_attention_norm", "post_ffw_norm"]  # Gemma 2 and 3
QK_NORMS = ["attn_q_norm", "attn_k_norm"]  # Qwen3, Gemma 3: one head_dim weight each


def deltanet(spec: ModelSpec, n: int) -> list[Tensor]:
    """A hybrid's (Qwen3.5's) linear-attention layer n in place of attention, with llama.cpp's tensor names
    (libllama's blk.%d.attn_qkv / attn_gate / ssm_*): the projections as matrices, the conv, decay and norm in f32."""
    block, h, blk = spec.linear_attention, spec.hidden_size, f"blk.{n}."
    assert block is not None
    heads = block.linear_num_value_heads
    return [
        Tensor(blk + "attn_qkv.weight", "attn_qkv", h, block.conv_dim, n),
        Tensor(blk + "attn_gate.weight", "attn_q", h, block.value_dim, n),
        Tensor(blk + "ssm_beta.weight", "attn_q", h, heads, n),
        Tensor(blk + "ssm_alpha.weight", "attn_q", h, heads, n),
        Tensor(blk + "ssm_out.weight", "attn_output", block.value_dim, h, n),
        Tensor(blk + "ssm_conv1d.weight", "norm", block.conv_dim * block.linear_conv_kernel_dim, layer=n),
        Tensor(blk + "ssm_dt.bias", "bias", heads, layer=n),
        Tensor(blk + "ssm_a", "norm", heads, layer=n),
        Tensor(blk + "ssm_norm.weight", "norm", block.linear_value_head_dim, layer=n),
    ]


def gguf_tensors(spec: ModelSpec) -> list[Tensor]:
    """Every tensor convert_hf_to_gguf.py writes for `spec`, with llama.cpp's names.

    Phi-3's fused projections stay fused (attn_qkv; gate and up as one ffn_up of 2 x intermediate rows);
    Mixtral's experts are one 3-D tensor per projection and layer (ffn_*_exps) with the router (ffn_gate_inp);
    a tied model has no output.weight. Norms and biases are 1-D."""
    h, i, e = spec.hidden_size, spec.mlp_width, max(spec.num_local_experts, 1)
    tensors = [Tensor("token_embd.weight", "token_embd", h, spec.vocab_size)]
    for n in range(spec.num_hidden_layers):
        blk = f"blk.{n}."
        norms = ["attn_norm", "ffn_norm"] + (POST_NORMS if spec.norms_per_layer == 4 else [])
        tensors += [Tensor(blk + name + ".weight", "norm", h, layer=n) for name in norms]
        attn, has_v = layer_view(spec, n)  # Gemma 4's global layers: wider heads, keys as values
        if spec.has_qk_norm:
            tensors += [Tensor(blk + name + ".weight", "norm", attn.head_size, layer=n) for name in QK_NORMS]
        if spec.latent is not None:  # DeepSeek-style latent attention and MLP (mla.py)
            latent = mla.gguf_attention(spec.latent, h, spec.num_attention_heads) + mla.gguf_mlp(spec, n)
            tensors += [Tensor(blk + name + ".weight", cast(Kind, kind), i, o, n) for name, kind, i, o in latent]
        elif spec.arch.fused_qkv:
            tensors.append(Tensor(blk + "attn_qkv.weight", "attn_qkv", h, spec.q_size + 2 * spec.kv_size, n))
        else:
            tensors += [
                # a gated attention (Qwen3.5) makes its output gate in q_proj too: twice the width
                Tensor(
                    blk + "attn_q.weight", "attn_q", h, attn.q_size * (2 if spec.arch.attention_output_gate else 1), n
                ),
                Tensor(blk + "attn_k.weight", "attn_k", h, attn.kv_size, n),
            ]
            tensors += [Tensor(blk + "attn_v.weight", "attn_v", h, attn.kv_size, n)] if has_v else []
        if spec.latent is None:
            tensors.append(Tensor(blk + "attn_output.weight", "attn_output", attn.q_size, h, n))
        if spec.attention_bias:
            tensors += [
                Tensor(blk + "attn_q.bias", "bias", spec.q_size, layer=n),
                Tensor(blk + "attn_k.bias", "bias", spec.kv_size, layer=n),
                Tensor(blk + "attn_v.bias", "bias", spec.kv_size, layer=n),
            ]
        if spec.attention_bias and not spec.arch.qkv_bias:  # Llama-style attention_bias covers o_proj too
            tensors.append(Tensor(blk + "attn_output.bias", "bias", h, layer=n))
        if spec.arch.attention_sinks:  # gpt-oss
            tensors.append(Tensor(blk + "attn_sinks.weight", "bias", spec.num_attention_heads, layer=n))
        if spec.linear_attention and (n + 1) % spec.linear_attention.full_attention_interval:
            tensors = [t for t in tensors if t.layer != n or t.kind == "norm" and t.row == h] + deltanet(spec, n)
        if spec.latent is not None and n < spec.latent.first_k_dense_replace:
            pass  # a dense first block: its SwiGLU is in the latent rows above
        elif spec.is_moe:
            tensors += [
                Tensor(blk + "ffn_gate_inp.weight", "router", h, spec.num_local_experts, n),
                Tensor(blk + "ffn_gate_exps.weight", "ffn_gate", h, i * e, n),
                Tensor(blk + "ffn_up_exps.weight", "ffn_up", h, i * e, n),
                Tensor(blk + "ffn_down_exps.weight", "ffn_down", i, h * e, n),
            ]
            if gemma4.is_moe(spec):  # Gemma 4 26B-A4B: its dense MLP, the router's two scales, three more norms
                tensors += [
                    Tensor(blk + "ffn_gate.weight", "ffn_gate", h, spec.intermediate_size, n),
                    Tensor(blk + "ffn_up.weight", "ffn_up", h, spec.intermediate_size, n),
                    Tensor(blk + "ffn_down.weight", "ffn_down", spec.intermediate_size, h, n),
                    Tensor(blk + "ffn_gate_inp.scale", "norm", h, layer=n),
                    Tensor(blk + "ffn_down_exps.scale", "norm", spec.num_local_experts, layer=n),
                ]
                tensors += [Tensor(blk + f"{name}.weight", "norm", h, layer=n) for name in gemma4.GGUF_MOE_NORMS]
            if spec.arch.moe_biases:  # gpt-oss: the router's and every expert's biases
                tensors += [
                    Tensor(blk + "ffn_gate_inp.bias", "bias", spec.num_local_experts, layer=n),
                    Tensor(blk + "ffn_gate_exps.bias", "bias", i * e, layer=n),
                    Tensor(blk + "ffn_up_exps.bias", "bias", i * e, layer=n),
                    Tensor(blk + "ffn_down_exps.bias", "bias", h * e, layer=n),
                ]
            if spec.linear_attention and spec.linear_attention.shared_expert_intermediate_size:
                # Qwen3-Next's / Qwen3.5 MoE's shared expert and its hidden -> 1 gate, written as a vector
                width = spec.linear_attention.shared_expert_intermediate_size
                tensors += [
                    Tensor(blk + "ffn_gate_shexp.weight", "ffn_gate", h, width, n),
                    Tensor(blk + "ffn_up_shexp.weight", "ffn_up", h, width, n),
                    Tensor(blk + "ffn_down_shexp.weight", "ffn_down", width, h, n),
                    Tensor(blk + "ffn_gate_inp_shexp.weight", "norm", h, layer=n),
                ]
        elif spec.arch.fused_gate_up:
            tensors += [
                Tensor(blk + "ffn_up.weight", "ffn_up", h, 2 * i, n),
                Tensor(blk + "ffn_down.weight", "ffn_down", i, h, n),
            ]
        else:
            tensors += [
                Tensor(blk + "ffn_gate.weight", "ffn_gate", h, i, n),
                Tensor(blk + "ffn_up.weight", "ffn_up", h, i, n),
                Tensor(blk + "ffn_down.weight", "ffn_down", i, h, n),
            ]
    tensors.append(Tensor("output_norm.weight", "norm", h))
    if not spec.tie_word_embeddings:
        tensors.append(Tensor("output.weight", "output", h, spec.vocab_size))
    return per_layer_input_tensors(spec, tensors)


def per_layer_input_tensors(spec: ModelSpec, tensors: list[Tensor]) -> list[Tensor]:
    """Gemma 4 E2B / E4B as llama.cpp's gemma4 stores them (export/gguf_layers.py; gguf-py's names): the shared-KV
    layers without attn_k, attn_v, attn_k_norm, the E2B's MLP there twice as wide, and the per-layer input path.
    llama-quantize has no rule of its own for those tensors: they take the mix's default type, as ffn_up does."""
    layout, h = spec.global_layers, spec.hidden_size
    if layout is None or not (layout.per_layer_input or layout.kv_shared_layers):
        return tensors
    first_shared, p, layers = (
        spec.num_hidden_layers - layout.kv_shared_layers,
        layout.per_layer_input,
        spec.num_hidden_layers,
    )
    dropped = ("attn_k.weight", "attn_v.weight", "attn_k_norm.weight")
    kept = [t for t in tensors if t.layer is None or t.layer < first_shared or not t.name.endswith(dropped)]
    if layout.double_wide_mlp:
        wide = {"ffn_gate": "rows", "ffn_up": "rows", "ffn_down": "row"}
        kept = [
            replace(t, **{wide[t.kind]: 2 * getattr(t, wide[t.kind])})
            if t.layer is not None and t.layer >= first_shared and t.kind in wide
            else t
            for t in kept
        ]
    if not p:
        return kept
    kept += [
        Tensor("per_layer_token_embd.weight", "ffn_up", layers * p, layout.per_layer_vocab),
        Tensor("per_layer_model_proj.weight", "ffn_up", h, layers * p),
        Tensor("per_layer_proj_norm.weight", "norm", p),
    ]
    for n in range(layers):
        kept += [
            Tensor(f"blk.{n}.inp_gate.weight", "ffn_up", h, p, n),
            Tensor(f"blk.{n}.proj.weight", "ffn_down", p, h, n),
            Tensor(f"blk.{n}.post_norm.weight", "norm", h, layer=n),
        ]
    return kept


# --- the ggml type llama-quantize gives each tensor ---------------------------------------------------------
def more_bits(index: int, count: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth of the layers, and every third one between."""
    return index < count // 8 or index >= 7 * count // 8 or (index - count // 8) % 3 == 2


def block(ggml_type: str) -> int:
    return formats()["ggml_type"][ggml_type]["block"]


def fallback(row: int, ggml_type: str) -> str:
    """A type whose block divides `row`: the chosen one, else its 32-weight stand-in, else f16."""
    if row % block(ggml_type) == 0:
        return ggml_type
    stand_in = formats()["ggml_fallback"].get(ggml_type, "f16")
    return stand_in if row % block(stand_in) == 0 else "f16"


def is_70b(spec: ModelSpec) -> bool:
    """llama.cpp's LLM_TYPE_70B, which gets a wider attn_v: a Llama-family model of 80 layers with fewer KV heads
    than heads (Llama 2/3 70B; 80 layers with as many KV heads is the 65B)."""
    return (
        spec.arch.llama_cpp_70b
        and spec.num_hidden_layers == 80
        and (spec.num_key_value_heads < spec.num_attention_heads)
    )


@dataclass(frozen=True)
class Quantizer:
    """How a GGUF file was made, where that changes the types. `imatrix`: an importance matrix was given, and a
    q4_0 file then stores the first eighth of its down projections in q4_1. `legacy_qkv`: the llama.cpp of 2024
    (before its tensor categories) gave Phi-3's fused attn_qkv a rule of its own, q5_k in q4_k_m and q6_k in
    q5_k_m; today it counts as a value projection (half of them q6_k). Published files of both kinds are checked
    in tests/test_serving.py; lorafit's own estimate is today's llama-quantize without an importance matrix."""

    imatrix: bool = False
    legacy_qkv: bool = False


def mix_type(
    tensor: Tensor, file_type: str, spec: ModelSpec, index: int, count: int, how: Quantizer = Quantizer()
) -> str:
    """The type of one quantisable matrix in a quantised file type, before the fallback.

    `index` / `count`: the tensor's place among those of its kind (llama.cpp counts attn_v and ffn_down tensors
    as it meets them; for a dense model which layers get the extra bits changes nothing in the size)."""
    base = formats()["gguf"][file_type]["base"]
    eight_experts = spec.num_local_experts == 8
    if tensor.kind == "output" or (tensor.kind == "token_embd" and spec.tie_word_embeddings):
        # the output matrix (or the tied embedding standing in for it) gets 6 bits, 8 where rows are odd
        if tensor.row % block(base) != 0:
            return "q8_0"
        return base if base == "q8_0" else "q6_k"
    if tensor.kind == "attn_qkv" and how.legacy_qkv:
        return {"q4_k_m": "q5_k", "q5_k_m": "q6_k"}.get(file_type, base)
    if tensor.kind in ("attn_v", "attn_qkv"):  # today's llama.cpp treats the fused qkv as a value projection
        chosen = base
        if file_type in ("q4_k_m", "q5_k_m") and more_bits(index, count):
            chosen = "q6_k"
        elif file_type == "q4_k_s" and index < 4:
            chosen = "q5_k"
        if is_70b(spec) and chosen == "q4_k":
            chosen = "q5_k"
        return "q8_0" if eight_experts else chosen
    if tensor.kind == "attn_k":
        return "q8_0" if eight_experts else base
    if tensor.kind == "ffn_down":
        layer = tensor.layer if spec.is_moe and tensor.layer is not None else index
        if file_type in ("q4_k_m", "q5_k_m") and more_bits(layer, count):
            return "q6_k"
        if file_type == "q4_k_s" and layer < count // 8:
            return "q5_k"
        if how.imatrix and file_type == "q4_0" and layer < count // 8:
            return "q4_1"
        return base
    if tensor.kind == "attn_output" and eight_experts and file_type in ("q4_k_s", "q4_k_m"):
        return "q5_k"
    return base


def ggml_types(spec: ModelSpec, file_type: str, how: Quantizer = Quantizer()) -> list[tuple[Tensor, str]]:
    """Every tensor of the GGUF file with its ggml type.

    f16 files (convert_hf_to_gguf.py --outtype f16): matrices in f16, 1-D tensors and the MoE router in f32.
    Quantised files (llama-quantize from that f16 file): 1-D tensors and the router keep their type, every other
    matrix gets `mix_type`, then `fallback`."""
    if file_type not in formats()["gguf"]:
        raise InvalidConfig(f"no GGUF type {file_type!r}; lorafit sizes {', '.join(gguf_types())}")
    tensors = gguf_tensors(spec)
    counts = {kind: sum(t.kind == kind for t in tensors) for kind in ("attn_v", "attn_qkv", "ffn_down")}
    counts["attn_v"] += counts.pop("attn_qkv")
    counts["ffn_down"] = spec.num_hidden_layers
    seen = {"attn_v": 0, "ffn_down": 0}
    typed = []
    for tensor in tensors:
        if not tensor.is_matrix or tensor.kind == "router":
            typed.append((tensor, "f32"))
            continue
        if file_type == "f16":
            typed.append((tensor, "f16"))
            continue
        counter = "attn_v" if tensor.kind in ("attn_v", "attn_qkv") else tensor.kind
        index = seen.get(counter, 0)
        chosen = mix_type(tensor, file_type, spec, index, counts.get(counter, 0), how)
        if counter in seen:
            seen[counter] += 1
        typed.append((tensor, fallback(tensor.row, chosen)))
    return typed


def tensor_bytes(tensor: Tensor, ggml_type: str) -> int:
    kind = formats()["ggml_type"][ggml_type]
    return tensor.elements // kind["block"] * kind["bytes"]


@lru_cache(maxsize=256)  # every plan of a comparison sizes the same model's files
def gguf_weight_bytes(spec: ModelSpec, file_type: str, how: Quantizer = Quantizer()) -> int:
    """The tensor data of a GGUF file: what llama.cpp loads onto the device. The file adds its metadata (the
    tokenizer's vocabulary and merges, the tensor directory, 32-byte alignment): a few MB, see docs/export.md."""
    return sum(tensor_bytes(tensor, ggml_type) for tensor, ggml_type in ggml_types(spec, file_type, how))


# --- GPTQ / AWQ / 16-bit --------------------------------------------------------------------------------------
def packed_linear_bytes(in_features: int, out_features: int, scheme: dict) -> float:
    """One linear layer in GPTQ/AWQ: int4 codes, per-group fp16 scales and 4-bit zeros, GPTQ's g_idx."""
    groups = math.ceil(in_features / scheme["group_size"])
    codes = in_features * out_features * scheme["bits"] / 8
    per_group = groups * out_features * (scheme["scale_bytes"] + scheme["zero_bits"] / 8)
    return codes + per_group + in_features * scheme["g_idx_bytes"]


def packed_weight_bytes(spec: ModelSpec, scheme_name: Literal["gptq", "awq"]) -> float:
    """Every decoder linear (MoE experts too: AutoGPTQ/AutoAWQ quantise each expert's linears) packed; the rest
    (embeddings, lm_head, norms, biases, router) in fp16."""
    scheme = formats()["packed"][scheme_name]
    per_layer = sum(packed_linear_bytes(i, o, scheme) * n for _, i, o, n in spec.layer_linears())
    packed_params = sum(i * o * n for _, i, o, n in spec.layer_linears()) * spec.num_hidden_layers
    return per_layer * spec.num_hidden_layers + (spec.num_params - packed_params) * 2


def bf16_weight_bytes(spec: ModelSpec) -> int:
    return spec.num_params * 2


# --- KV cache and compute buffer ----------------------------------------------------------------------------
def kv_cache_bytes(spec: ModelSpec, context: int, element_bytes: int = 2) -> int:
    """K and V of every layer for `context` tokens: 2 x layers x kv_heads x head_dim x context x bytes.

    Every layer holds the whole context: sliding-window layers (Mistral v0.1, Gemma 2/3) would need less past
    their window, so for those this is the upper figure."""
    return 2 * spec.num_hidden_layers * spec.num_key_value_heads * spec.head_size * context * element_bytes


def compute_bytes(spec: ModelSpec) -> int:
    """Logits and hidden states of one micro-batch in f32 (formats.toml [compute] gives the model and its check)."""
    compute = formats()["compute"]
    return compute["n_ubatch"] * compute["bytes"] * (spec.vocab_size + spec.hidden_size)


# --- the answer ----------------------------------------------------------------------------------------------
class FormatMemory(Frozen):
    """One export format of the merged model, served at the plan's context."""

    format: str
    runtime: str
    bits_per_weight: float = Field(description="weight bytes x 8 / parameters")
    weights_bytes: int
    weights_gib: float
    kv_cache_gib: float
    compute_gib: float = Field(description="compute buffer (logits + hidden states of a 512-token micro-batch)")
    cuda_context_gib: float
    total_gib: float
    fits_gpu: bool | None = Field(default=None, description="fits the plan's GPU after headroom; None: no GPU")
    smallest_gpu: str | None = Field(default=None, description="the NVIDIA catalog GPU with the least memory it fits")


class Serving(Frozen):
    """Memory to run the merged model in each format at `context` tokens, and the GPUs it fits."""

    context: int
    gpu: str | None = None
    headroom: float
    formats: list[FormatMemory]


def served_formats(spec: ModelSpec) -> list[tuple[str, str, float]]:
    """(format, runtime key, weight bytes) for the table: the shown GGUF types, GPTQ, AWQ, bf16. llama.cpp has
    no Llama 3.2 Vision (catalog/gguf.toml [unsupported]), so it gets no GGUF rows."""
    rows = [
        (f"gguf {name}", "llama_cpp", float(gguf_weight_bytes(spec, name)))
        for name, entry in formats()["gguf"].items()
        if entry["shown"] and spec.cross_attention is None
    ]
    rows += [(name, "hf", packed_weight_bytes(spec, name)) for name in ("gptq", "awq")]
    rows.append(("bf16", "hf", float(bf16_weight_bytes(spec))))
    return rows


def runs_on(gpu: GpuSpec, runtime: str) -> bool:
    """GPTQ/AWQ/bf16 serving (vLLM, transformers) needs CUDA; llama.cpp runs GGUF on Apple GPUs too."""
    return gpu.kind != "apple" or runtime == "llama_cpp"


def smallest_fitting(total_gib: float, headroom: float, gpus: Iterable[GpuSpec]) -> str | None:
    """The NVIDIA catalog card with the least memory that holds `total_gib` (the cheaper of equals)."""
    fitting = [g for g in gpus if g.kind != "apple" and total_gib <= g.usable_gib(headroom)]
    if not fitting:
        return None
    return min(fitting, key=lambda g: (g.memory_gib, g.price_usd or math.inf)).name


def check_context(spec: ModelSpec, context: int) -> None:
    if context > spec.max_position_embeddings:
        raise InvalidConfig(
            f"--serve-context {context} is past {spec.name}'s maximum of {spec.max_position_embeddings} tokens"
        )


def serving(spec: ModelSpec, context: int, gpu: GpuSpec | None = None, headroom: float = 0.1) -> Serving:
    """Every format's weights, KV cache, compute buffer and CUDA context at `context` tokens; whether the sum
    fits `gpu` (the one fits rule: GpuSpec.usable_gib) and the smallest catalog GPU it fits."""
    check_context(spec, context)
    table = formats()
    compute, context_gib = gib(compute_bytes(spec)), table["compute"]["cuda_context_gib"]
    catalog = list(hardware.catalog().values())
    rows = []
    for name, runtime, weights in served_formats(spec):
        kv = gib(kv_cache_bytes(spec, context, table["runtime"][runtime]["kv_bytes"]))
        total = gib(weights) + kv + compute + context_gib
        # llama.cpp keeps an image-text model's vision tower in a separate mmproj file, not loaded for text
        params = spec.num_params - (spec.vision_params if runtime == "llama_cpp" else 0)
        rows.append(
            FormatMemory(
                format=name,
                runtime=table["runtime"][runtime]["label"],
                bits_per_weight=round(weights * 8 / params, 3),
                weights_bytes=round(weights),
                weights_gib=round(gib(weights), 3),
                kv_cache_gib=round(kv, 3),
                compute_gib=round(compute, 3),
                cuda_context_gib=context_gib,
                total_gib=round(total, 3),
                fits_gpu=None if gpu is None else (runs_on(gpu, runtime) and total <= gpu.usable_gib(headroom)),
                smallest_gpu=smallest_fitting(total, headroom, catalog),
            )
        )
    return Serving(context=context, gpu=gpu.name if gpu else None, headroom=headroom, formats=rows)
