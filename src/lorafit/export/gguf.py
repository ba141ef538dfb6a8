"""A transformers model folder (the merged run) to GGUF, written with the `gguf` package.

The tensors stream: each is read from its memory-mapped safetensors shard, reshaped for llama.cpp (the q/k rows
of Llama-style models go back to interleaved rotary pairs), converted to the file's type and written before the
next is read, so the peak memory is one weight matrix, not the model (for an MoE, one projection of one layer's
experts, which llama.cpp holds stacked as one tensor). f32, f16, bf16 and q8_0 are written here
(q8_0 by gguf-py's quantizer, the one llama.cpp's own converter uses); the K-quants come from llama.cpp's
quantizer run on the 16-bit file (`quantize`), since their block search lives only there.

Everything llama.cpp needs besides the weights is read from the folder, and where a file can say one thing and
the tokenizer do another, from behaviour: the pre-tokenizer is the llama.cpp one whose splits of a probe text
equal the Hugging Face pre-tokenizer's, the end-of-turn token is the one the chat template puts after an
assistant reply, add-BOS is whether tokenizing adds it. Architectures and pre-tokenizers are data
(catalog/gguf.toml); anything not in it is refused with a clear line rather than written wrong.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafit.errors import ExportError
from lorafit.export import gguf_hybrid, gguf_mla
from lorafit.export.gguf_catalog import gguf_catalog
from lorafit.export.gguf_layers import (
    feed_forward_length,
    full_head_dim,
    per_layer,
    proportional_factors,
    write_layer_shapes,
)
from lorafit.export.gguf_vocab import Vocabulary, read_vocabulary
from lorafit.export.source import safetensors_header, weight_files
from lorafit.options import GgufType

if TYPE_CHECKING:
    import numpy as np
    import torch

DIRECT: tuple[GgufType, ...] = ("f32", "f16", "bf16", "q8_0")  # written here; the rest by llama.cpp's quantizer
FILE_TYPES: dict[str, int] = {  # llama_ftype values (gguf-py's LlamaFileType)
    "f32": 0,
    "f16": 1,
    "q8_0": 7,
    "q3_k_m": 12,
    "q4_k_s": 14,
    "q4_k_m": 15,
    "q5_k_s": 16,
    "q5_k_m": 17,
    "q6_k": 18,
    "bf16": 32,
}


# --- hyper-parameters ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Architecture:
    model_type: str
    arch: str
    permute_qk: bool
    norm_offset: float
    config: dict[str, Any]  # the language model's (an image-text model's text_config, its defaults filled in)
    entry: dict[str, Any] = field(default_factory=dict)  # the family's entry in catalog/gguf.toml

    @property
    def heads(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def kv_heads(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.heads)

    @property
    def head_dim(self) -> int:
        """Where full-attention layers have their own (catalog layer_shapes: Gemma 4), theirs (key_length)."""
        own = int(self.config.get("head_dim") or self.config["hidden_size"] // self.heads)
        return full_head_dim(self.config, own) if self.entry.get("layer_shapes") else own

    @property
    def layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def experts(self) -> int:
        """The experts per MoE layer (0 for a dense model), under the name each family's config uses."""
        config = self.config
        return int(config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0)

    @property
    def tied(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))

    @property
    def rope(self) -> dict[str, Any]:
        """The rope settings wherever the config keeps them (transformers 5: rope_parameters; 4: rope_scaling);
        for a model with settings per layer type (Gemma 3), the full-attention layers', as llama.cpp reads them."""
        rope = dict(self.config.get("rope_parameters") or self.config.get("rope_scaling") or {})
        return dict(rope.get("full_attention", rope))

    @property
    def sliding_rope_theta(self) -> float | None:
        """The rope base of the sliding-window layers where it is their own (Gemma 3's local base)."""
        sliding = (self.config.get("rope_parameters") or {}).get("sliding_attention") or {}
        theta = sliding.get("rope_theta") or self.config.get("rope_local_base_freq")
        return None if theta is None else float(theta)

    def renamed(self, source: str) -> str | None:
        """The name gguf-py's map knows a saved tensor by: an image-text model's language model under its
        text-only name, None for the tensors of the vision tower and projector (not written)."""
        if source.startswith(tuple(self.entry.get("skip", ()))):
            return None
        for saved, written in self.entry.get("rename_suffix", ()):
            source = source.removesuffix(saved) + written if source.endswith(saved) else source
        for saved, text_only in self.entry.get("rename", ()):
            if source.startswith(saved):
                return text_only + source.removeprefix(saved)
        return source

    @property
    def rope_theta(self) -> float:
        return float(self.config.get("rope_theta") or self.rope.get("rope_theta") or 10000.0)


def architecture(model_dir: Path, *, dequantised: bool = False) -> Architecture:
    """The family's llama.cpp architecture and the config it is written from; `dequantised`: the folder is a base
    the export dequantises into a 16-bit merged folder first, so its stored quantisation is no reason to refuse."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        raise ExportError(f"{model_dir} has no readable config.json") from None
    if not isinstance(config, dict):
        raise ExportError(f"{model_dir}/config.json is not a JSON object")
    model_type = config.get("model_type", "?")
    known = gguf_catalog()["architectures"]
    if reason := gguf_catalog().get("unsupported", {}).get(model_type):
        raise ExportError(reason)
    if model_type not in known:
        raise ExportError(
            f"lorafit cannot write {model_type!r} models as GGUF yet (it writes: {', '.join(known)}); "
            "export --to merged and convert that folder with llama.cpp's convert_hf_to_gguf.py"
        )
    entry = known[model_type]
    if config.get("quantization_config") and not dequantised:
        raise ExportError(f"{model_dir} holds quantised weights; export --to gguf reads a 16-bit merged folder")
    if entry.get("text_config"):
        config = _text_config(model_dir)
        if inner := entry.get("text_models", {}).get(config.get("model_type")):  # Mistral 3 holding a Mistral 4
            model_type, entry = inner, known[inner]
    for key, what in entry.get("unwritten", {}).items():
        if config.get(key):
            raise ExportError(
                f"lorafit does not write {what} as GGUF yet ({key} = {json.dumps(config[key])}), though llama.cpp's "
                f"{entry['arch']} reads them: export --to merged and convert that folder with llama.cpp's "
                "convert_hf_to_gguf.py"
            )
    for key, expected in entry.get("requires", {}).items():
        if config.get(key, expected) != expected:
            raise ExportError(
                f"llama.cpp's {entry['arch']} computes {model_type} models with {key} = {json.dumps(expected)}, and "
                f"this one has {json.dumps(config.get(key))}: its GGUF would answer differently; export --to merged"
            )
    offset = float(entry.get("norm_offset", 0.0))
    arch = Architecture(model_type, entry["arch"], entry["permute_qk"], offset, config, entry)
    if entry.get("query_scale"):
        _check_query_scale(arch)
    if entry.get("mla"):
        gguf_mla.check(config)
    gguf_hybrid.check(entry, config)
    return arch


def _text_config(model_dir: Path) -> dict[str, Any]:
    """An image-text model's language-model config as transformers fills it (Gemma 3's first config.json files
    name few text keys and leave the rest to Gemma3TextConfig's defaults). Its tie is not read: Mistral3Config
    says tied by default while Mistral Small's checkpoints hold an lm_head, which transformers then keeps untied
    (modeling_utils' tie_weights: both saved and different); a saved lm_head is written, as transformers uses it."""
    from transformers import AutoConfig

    try:
        whole = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise ExportError(f"transformers cannot read {model_dir}/config.json: {str(error).splitlines()[0]}") from None
    vision = getattr(whole, "vision_config", None)
    deepstack = len(getattr(vision, "deepstack_visual_indexes", None) or [])  # Qwen3-VL's
    return dict(whole.get_text_config().to_dict()) | {"deepstack_layers": deepstack}


def _check_query_scale(arch: Architecture) -> None:
    """llama.cpp's gemma3 scales queries by 1 / sqrt(head_dim), or 1 / sqrt(hidden / heads) for its 62-layer 27B
    (src/models/gemma3.cpp, from gemma_pytorch's config); transformers by query_pre_attn_scalar ** -0.5."""
    config = arch.config
    basis = config["hidden_size"] // arch.heads if arch.layers == 62 else arch.head_dim
    scalar = config.get("query_pre_attn_scalar", basis)
    if scalar != basis or config.get("attn_logit_softcapping") is not None:
        raise ExportError(
            f"llama.cpp's {arch.arch} scales attention by 1/sqrt({basis}) without soft-capping, this model by "
            f"1/sqrt({scalar}) (attn_logit_softcapping {config.get('attn_logit_softcapping')}): its GGUF would "
            "answer differently; export --to merged"
        )


def rope_scaling(arch: Architecture) -> tuple[dict[str, Any], list[float] | None]:
    """The rope-scaling keys, and for Llama-3 scaling the per-frequency divisors llama.cpp reads from the
    `rope_freqs` tensor (its formula: transformers' _compute_llama3_parameters, applied to 1 / factor)."""
    rope = arch.rope
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return {}, None
    if kind == "proportional":
        return {}, proportional_factors(rope, arch.head_dim)
    if kind == "linear":
        return {"type": "linear", "factor": float(rope["factor"])}, None
    if kind == "yarn":
        original = rope.get("original_max_position_embeddings") or arch.config.get("max_position_embeddings")
        betas = {key: float(rope[key]) for key in ("beta_fast", "beta_slow") if rope.get(key) is not None}
        return {"type": "yarn", "factor": float(rope["factor"]), "original_context": int(original)} | betas, None
    if kind == "llama3":
        factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        original = float(rope["original_max_position_embeddings"])
        low_wavelen, high_wavelen = original / low, original / high
        divisors = []
        for i in range(0, arch.head_dim, 2):
            wavelen = 2 * math.pi * arch.rope_theta ** (i / arch.head_dim)
            if wavelen < high_wavelen:
                divisors.append(1.0)
            elif wavelen > low_wavelen:
                divisors.append(factor)
            else:
                smooth = (original / wavelen - low) / (high - low)
                divisors.append(1 / ((1 - smooth) / factor + smooth))
        return {}, divisors
    raise ExportError(f"rope scaling {kind!r} is not written by lorafit's GGUF export yet")


# --- tensors ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorPlan:
    name: str  # GGUF name
    source: str  # safetensors name ("" for a tensor made here, such as rope_freqs)
    shard: Path | None
    shape: tuple[int, ...]  # numpy order (rows, columns; experts first for a stacked tensor)
    ggml_type: str  # F32, F16, BF16, Q8_0
    experts: tuple[tuple[str, Path], ...] = ()  # an MoE's per-expert tensors and shards, stacked in this order
    transpose: bool = False  # fused experts stored experts x in x out (gpt-oss): the last two axes swapped
    part: tuple[int, int, int] | None = None  # (start, stop, step) of the output rows taken: gate or up of gate_up


def _ggml_type_for(name: str, shape: tuple[int, ...], file_type: GgufType) -> str:
    """Norms, biases, other 1-D tensors and an MoE's router stay f32 (as llama.cpp's converter keeps them); a matrix
    whose rows are not whole q8_0 blocks falls back to f16."""
    kept = ".ffn_gate_inp." in name or ".ssm_conv1d." in name  # the router; ggml's ssm_conv reads f32 kernels only
    if len(shape) == 1 or file_type == "f32" or not name.endswith(".weight") or kept:
        return "F32"
    if file_type == "q8_0":
        return "Q8_0" if shape[-1] % 32 == 0 else "F16"
    return "BF16" if file_type == "bf16" else "F16"


# transformers saves an MoE's experts one tensor per expert and projection (Qwen3-MoE's mlp.experts.N.gate_proj,
# Mixtral's block_sparse_moe.experts.N.w1); llama.cpp holds each projection as one experts x rows x columns tensor,
# named in gguf-py's map by the path without the expert's number (mlp.experts.gate_proj -> blk.N.ffn_gate_exps).
PER_EXPERT = re.compile(r"^(?P<owner>.+\.experts)\.(?P<expert>\d+)\.(?P<part>.+)$")
# Fused experts, one tensor per projection (gpt-oss: experts x in x out, gate and up interleaved in gate_up_proj's
# output axis, biases as gate_up_proj_bias); llama.cpp's gate and up are separate tensors.
FUSED_EXPERTS = re.compile(r"^(?P<owner>.+\.experts)\.(?P<part>gate_up_proj|down_proj)(?P<bias>_bias)?$")


def tensor_plans(model_dir: Path, arch: Architecture, file_type: GgufType) -> list[TensorPlan]:
    import gguf

    arch_enum = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch.arch)
    names = gguf.get_tensor_name_map(arch_enum, arch.layers)
    plans = []
    stacks: dict[str, dict[int, tuple[str, Path, tuple[int, ...]]]] = {}
    for shard in weight_files(model_dir):
        header = safetensors_header(shard)
        for source in sorted(header, key=lambda key: header[key]["data_offsets"][0]):
            known = arch.renamed(source)
            if known is None or known.endswith(".rotary_emb.inv_freq"):
                continue
            if known == "lm_head.weight" and arch.tied and not arch.entry.get("text_config"):
                continue  # llama.cpp reuses token_embd for the output when there is no output.weight
            shape = tuple(header[source]["shape"])
            if match := PER_EXPERT.match(source):
                stacked = f"{match['owner']}.{match['part']}"
                stacks.setdefault(stacked, {})[int(match["expert"])] = (source, shard, shape)
                continue
            if (match := FUSED_EXPERTS.match(known)) and arch.entry.get("fused_experts"):
                plans += _fused_plans(match, source, shard, shape, arch, names, file_type)
                continue
            name = _gguf_name(names, known) or _block_name(arch.entry, known)
            if hybrid := gguf_hybrid.tensor_name(arch.entry, names, known, shape):
                name, shape = hybrid
            if name is None:
                raise ExportError(f"{shard.name}: no GGUF name for tensor {source} of a {arch.model_type} model")
            plans.append(TensorPlan(name, source, shard, shape, _ggml_type_for(name, shape, file_type)))
    plans += [_stacked_plan(stacked, members, arch, names, file_type) for stacked, members in stacks.items()]
    _, divisors = rope_scaling(arch)
    if divisors is not None:
        plans.append(TensorPlan("rope_freqs.weight", "", None, (len(divisors),), "F32"))
    return plans


def _gguf_name(names: Any, known: str) -> str | None:
    """gguf-py's name for a tensor; a bare parameter (gpt-oss's self_attn.sinks) is a `.weight`, as llama.cpp
    names it."""
    name = names.get_name(known, try_suffixes=(".weight", ".bias"))
    return name if name is None or name.endswith((".weight", ".bias")) else name + ".weight"


def _block_name(entry: dict[str, Any], known: str) -> str | None:
    """A block's tensor that gguf-py's map does not name, by the table's `block_names` (Gemma 4's router scales,
    which llama.cpp's converter names by hand)."""
    block = re.match(r"^model\.layers\.(\d+)\.(.+)$", known)
    written = dict(entry.get("block_names", ()))
    return f"blk.{block[1]}.{written[block[2]]}" if block and block[2] in written else None


def _fused_plans(
    match: re.Match[str],
    source: str,
    shard: Path,
    shape: tuple[int, ...],
    arch: Architecture,
    names: Any,
    file_type: GgufType,
) -> list[TensorPlan]:
    """A fused experts tensor as llama.cpp's: transposed to experts x out x in, gate_up split into gate and up."""
    layout = arch.entry["fused_experts"]
    bias = bool(match["bias"])
    transpose = layout["transposed"]
    if transpose == "by_shape":  # experts x out x in has rows 2 x expert width (gate_up) or hidden (down)
        width = int(arch.config[arch.entry.get("expert_width", "moe_intermediate_size")])
        transpose = shape[-2] != (2 * width if match["part"] == "gate_up_proj" else arch.config["hidden_size"])
    transpose = bool(transpose) and not bias
    shape = (*shape[:-2], shape[-1], shape[-2]) if transpose else shape
    axis = -1 if bias else -2
    suffix = ".bias" if bias else ".weight"
    if match["part"] == "down_proj":
        parts = {"down_proj": None}
    else:
        rows = shape[axis]
        interleaved = layout["gate_up"] == "interleaved"
        gate, up = ((0, rows, 2), (1, rows, 2)) if interleaved else ((0, rows // 2, 1), (rows // 2, rows, 1))
        parts = {"gate_proj": gate, "up_proj": up}
    plans = []
    for projection, part in parts.items():
        name = _gguf_name(names, f"{match['owner']}.{projection}{suffix}")
        if name is None:
            raise ExportError(f"no GGUF name for the experts' tensor {source} of a {arch.model_type} model")
        size = list(shape)
        size[axis] = shape[axis] if part is None else len(range(*part))
        ggml = _ggml_type_for(name, tuple(size), file_type)
        plans.append(TensorPlan(name, source, shard, tuple(size), ggml, transpose=transpose, part=part))
    return plans


def _stacked_plan(
    stacked: str,
    members: dict[int, tuple[str, Path, tuple[int, ...]]],
    arch: Architecture,
    names: Any,
    file_type: GgufType,
) -> TensorPlan:
    """One experts x rows x columns tensor from the per-expert tensors saved for it (in any shards)."""
    name = _gguf_name(names, arch.renamed(stacked) or stacked)
    if name is None:
        raise ExportError(f"no GGUF name for the experts' tensor {stacked} of a {arch.model_type} model")
    if sorted(members) != list(range(arch.experts)):
        raise ExportError(
            f"{stacked} is saved for experts {sorted(members)} and the config has {arch.experts}: the folder "
            "is not a whole model"
        )
    sources = [members[expert] for expert in range(arch.experts)]
    if len({shape for _, _, shape in sources}) > 1:
        raise ExportError(f"the experts of {stacked} differ in shape; llama.cpp stacks experts of one shape")
    source, shard, shape = sources[0]
    full = (arch.experts, *shape)
    experts = tuple((name_, path) for name_, path, _ in sources)
    return TensorPlan(name, source, shard, full, _ggml_type_for(name, full, file_type), experts)


def _read(tensors: list[tuple[str, Path | None]]) -> list[torch.Tensor]:
    """The tensors, each shard opened once (a header of a real MoE's shard names thousands of tensors)."""
    from safetensors import safe_open

    loaded = {}
    for shard in dict.fromkeys(shard for _, shard in tensors):
        with safe_open(shard, framework="pt") as handle:
            loaded |= {(name, shard): handle.get_tensor(name) for name, where in tensors if where == shard}
    return [loaded[key] for key in tensors]


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face keeps each head's rotary dimensions as two halves (x[:d/2], x[d/2:]); llama.cpp's normal rope
    rotates adjacent pairs. Row r = h*d + half*(d/2) + j goes to h*d + 2j + half."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def tensor_data(plan: TensorPlan, arch: Architecture) -> np.ndarray:
    """One tensor as the bytes GGUF stores: read, rearranged for llama.cpp, converted to its type."""
    import gguf
    import numpy as np
    import torch

    if plan.source == "":
        _, divisors = rope_scaling(arch)
        return np.asarray(divisors, dtype=np.float32)
    if plan.experts:
        weight = torch.stack(_read(list(plan.experts)))
    else:
        (weight,) = _read([(plan.source, plan.shard)])
    if plan.transpose:
        weight = weight.transpose(-1, -2)
    if plan.part is not None:
        rows = slice(*plan.part)
        weight = (weight[..., rows, :] if weight.dim() == 3 else weight[..., rows]).contiguous()
    if arch.permute_qk and plan.name.endswith(("attn_q.weight", "attn_q.bias")):
        weight = _unpermute(weight, arch.heads)
    elif arch.permute_qk and plan.name.endswith(("attn_k.weight", "attn_k.bias")):
        weight = _unpermute(weight, arch.kv_heads)
    weight = gguf_hybrid.transform(arch.entry, arch.config, plan.name, weight)
    if arch.norm_offset and plan.name.endswith("norm.weight") and not gguf_hybrid.plain_norm(arch.entry, plan.name):
        weight = weight.float() + arch.norm_offset
    if plan.ggml_type == "BF16":
        return weight.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    if plan.ggml_type == "F16":
        return weight.to(torch.float16).numpy()
    values = weight.to(torch.float32).numpy()
    if plan.ggml_type == "F32":
        return values
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)


# --- the file -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Written:
    path: Path
    file_type: GgufType
    bytes: int
    vocabulary: Vocabulary


def write_gguf(
    model_dir: Path, path: Path, file_type: GgufType, *, name: str = "", progress: Callable[[str], None] | None = None
) -> Written:
    """Write `model_dir` (a 16-bit transformers folder) as one GGUF file of `file_type` (f32/f16/bf16/q8_0)."""
    import gguf

    if file_type not in DIRECT:
        raise ExportError(f"internal: {file_type} is made by llama.cpp's quantizer from a 16-bit GGUF")
    arch = architecture(model_dir)
    plans = tensor_plans(model_dir, arch, file_type)
    embedding = next(plan for plan in plans if plan.name == "token_embd.weight")
    vocabulary = read_vocabulary(model_dir, embedding.shape[0])
    if len(vocabulary.tokens) != embedding.shape[0]:
        raise ExportError(
            f"the tokenizer has {len(vocabulary.tokens)} tokens but the embedding {embedding.shape[0]} rows"
        )
    import numpy as np

    writer = gguf.GGUFWriter(path, arch.arch)
    _write_metadata(writer, arch, vocabulary, file_type, name or model_dir.name)
    for plan in plans:
        ggml = gguf.GGMLQuantizationType[plan.ggml_type]
        count = math.prod(plan.shape)
        block, size = gguf.GGML_QUANT_SIZES[ggml]
        nbytes = count // block * size
        if ggml == gguf.GGMLQuantizationType.Q8_0:
            byte_shape = (*plan.shape[:-1], plan.shape[-1] // block * size)
            writer.add_tensor_info(plan.name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=ggml)
        else:
            dtype = {"F32": "float32", "F16": "float16", "BF16": "uint16"}[plan.ggml_type]
            raw = ggml if plan.ggml_type == "BF16" else None
            writer.add_tensor_info(plan.name, plan.shape, np.dtype(dtype), nbytes, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for plan in plans:
        if progress:
            progress(plan.name)
        writer.write_tensor_data(tensor_data(plan, arch))
    writer.close()
    return Written(path, file_type, path.stat().st_size, vocabulary)


def _write_metadata(writer: Any, arch: Architecture, vocabulary: Vocabulary, file_type: GgufType, name: str) -> None:
    import gguf

    config = arch.config
    writer.add_name(name)
    writer.add_file_type(FILE_TYPES[file_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(int(config.get("max_position_embeddings") or 4096))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_block_count(arch.layers)
    writer.add_feed_forward_length(feed_forward_length(config, arch.layers))  # per layer: Gemma 4 E2B
    writer.add_head_count(arch.heads)
    shaped = arch.entry.get("layer_shapes")
    writer.add_head_count_kv(per_layer(config, "num_key_value_heads", arch.kv_heads) if shaped else arch.kv_heads)
    rotated = config.get("qk_rope_head_dim") if arch.entry.get("mla") else None  # Mistral 4's head_dim is q+k wide
    writer.add_rope_dimension_count(int(rotated or gguf_hybrid.rope_dimensions(arch.entry, config, arch.head_dim)))
    writer.add_rope_freq_base(arch.rope_theta)
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps") or 1e-6))
    key_length = gguf_catalog()["architectures"][arch.model_type].get("key_length", False)
    if arch.entry.get("mla"):  # DeepSeek: latent attention's own key, value and router keys
        gguf_mla.write_metadata(writer, config, arch.entry)
    elif arch.head_dim != int(config["hidden_size"]) // arch.heads or key_length:
        writer.add_key_length(arch.head_dim)
        writer.add_value_length(arch.head_dim)
    writer.add_vocab_size(len(vocabulary.tokens))
    _write_attention_layout(writer, arch)
    gguf_hybrid.write_hparams(writer, arch.entry, config)
    if arch.experts:
        writer.add_expert_count(arch.experts)
        writer.add_expert_used_count(int(config[arch.entry.get("experts_used", "num_experts_per_tok")]))
        width = config.get(arch.entry.get("expert_width", "moe_intermediate_size"))
        if width:  # Qwen3-MoE's moe_intermediate_size, gpt-oss's intermediate_size; Mixtral's is the FFN length
            writer.add_expert_feed_forward_length(int(width))
    scaling, _ = rope_scaling(arch)
    if scaling.get("type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    elif scaling.get("type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_context"])
        if "beta_fast" in scaling:
            writer.add_rope_scaling_yarn_beta_fast(scaling["beta_fast"])
        if "beta_slow" in scaling:
            writer.add_rope_scaling_yarn_beta_slow(scaling["beta_slow"])
    writer.add_tokenizer_model(vocabulary.model)
    if vocabulary.pre:
        writer.add_tokenizer_pre(vocabulary.pre)
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types(vocabulary.types)
    if vocabulary.scores is not None:
        writer.add_token_scores(vocabulary.scores)
    if vocabulary.merges:
        writer.add_token_merges(vocabulary.merges)
    adders = {
        "bos": writer.add_bos_token_id,
        "eos": writer.add_eos_token_id,
        "eot": writer.add_eot_token_id,
        "pad": writer.add_pad_token_id,
        "unk": writer.add_unk_token_id,
    }
    for key, token_id in vocabulary.special.items():
        adders[key](token_id)
    writer.add_add_bos_token(vocabulary.add_bos)
    writer.add_add_eos_token(vocabulary.add_eos)
    if vocabulary.add_space_prefix is not None:
        writer.add_add_space_prefix(vocabulary.add_space_prefix)
    if vocabulary.chat_template:
        writer.add_chat_template(vocabulary.chat_template)


def _write_attention_layout(writer: Any, arch: Architecture) -> None:
    """Sliding-window layers (which, how wide, their own rope base) and multi-axis rope sections for the
    architectures whose llama.cpp graph reads them (catalog: sliding_window, rope_sections), and Gemma's final
    logit soft-capping where the config has one."""
    config = arch.config
    layer_types = config.get("layer_types") or []
    if arch.entry.get("sliding_window") and "sliding_attention" in layer_types:
        writer.add_sliding_window(int(config["sliding_window"]))
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in layer_types])
        if arch.sliding_rope_theta is not None:
            writer.add_rope_freq_base_swa(arch.sliding_rope_theta)
    if arch.entry.get("rope_sections"):
        sections = list(arch.rope.get("mrope_section") or [])
        if not sections:
            raise ExportError(
                f"{arch.model_type}: the config has no mrope_section, which llama.cpp's {arch.arch} reads; "
                "export --to merged"
            )
        writer.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])  # time, height, width, unused
    if arch.entry.get("deepstack"):
        writer.add_num_deepstack_layers(int(config["deepstack_layers"]))
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    if arch.entry.get("layer_shapes"):
        write_layer_shapes(writer, config, int(config["head_dim"]))


# --- K-quants through llama.cpp -----------------------------------------------------------------------------
def quantize(source: Path, target: Path, file_type: GgufType, threads: int = 0) -> None:
    """llama.cpp's own quantizer (`llama_model_quantize`), from a 16-bit GGUF to a K-quant mix."""
    import ctypes

    try:
        import llama_cpp
    except ImportError:
        raise ExportError(
            f"--quant {file_type} needs llama.cpp's quantizer: pip install 'lorafit[gguf]' (builds llama-cpp-python)"
        ) from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[file_type]
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if status != 0 or not target.is_file():
        raise ExportError(f"llama.cpp could not quantize {source.name} to {file_type} (status {status})")
