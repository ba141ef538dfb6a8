"""Analytic peak memory of one training step: one function per term, summed in `estimate()`.

Every term counts the tensors that the real code path (transformers + peft + bitsandbytes, as `train/build.py`
sets it up) keeps alive, derived op by op in docs/memory-model.md and checked against the live-tensor trace of
real steps (`lorafit estimate --exact`, tests/test_trace.py). Pure Python: no torch import, so planning is instant.

Notation (per micro-batch): N tokens (micro_batch x seq_len), L layers, h hidden, q = heads x head_dim,
kv = kv_heads x head_dim, I intermediate, V vocabulary, r LoRA rank, c bytes of the compute dtype.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from lorafit import stacks
from lorafit.hardware import GpuSpec
from lorafit.models import ModelSpec
from lorafit.options import DEFAULT_HEADROOM
from lorafit.schema import Estimate, Settings
from lorafit.units import BYTES_PER_GIB as GIB
from lorafit.units import DTYPE_BYTES, gib

NF4_BLOCK = 64  # bitsandbytes blocksize for 4-bit weights
NESTED_BLOCK = 256  # double quantisation groups 256 absmax values
BNB_8BIT_MIN_SIZE = 4096  # bnb keeps 32-bit optimizer state for tensors smaller than this
BNB_8BIT_BLOCK = 256
HEAD_CHUNK = 128  # litgpt's lm_head_chunk_size: the LM head runs on 128 positions of every row at a time
# lorafit's own chunked loss (settings.loss "chunked", lorafit.train.savers): the LM head and the fp32
# cross-entropy run over chunks of this many tokens of the micro-batch, recomputed in backward
LOSS_CHUNK_TOKENS = 512  # one chunk of a 152k vocabulary: 12 x V x 512 bytes = 0.87 GiB of fp32 logits and gradients
# offload_activations: checkpointed layer inputs on the GPU at once (one being copied back for its layer's
# backward, the next one arriving)
OFFLOAD_LAYERS_ON_GPU = 2
# Unsloth's checkpointing (unsloth_zoo/gradient_checkpointing.py @ ce232d6c, UnslothCheckpointFunction): the last
# layer's input stays on the GPU (LAST_GC_INDEX) and the others come back through GPU buffers A and B, resized
# to a layer input and kept (double buffering when 512 MiB are free): three layer inputs on the GPU
UNSLOTH_LAYERS_ON_GPU = 3
# Unsloth's fused cross-entropy (unsloth_zoo/fused_losses/cross_entropy_loss.py @ ce232d6c, get_chunk_size):
# chunks of at most min(half the free memory, 4 GiB) of fp32 logits, their number a multiple of 4 unless one fits;
# the cap, and the target where no GPU is given (unsloth_chunk_target)
UNSLOTH_CHUNK_TARGET_BYTES = 4 * 2**30


class Runtime(BaseModel):
    """How the framework runs the step. The defaults are lorafit's own trainer; catalog/stacks.toml sets them to
    describe the other stacks `--stack` offers (TRL's fused LM head, peft's fp32 upcast, litgpt's loop, ...).
    Code paths only published benchmark rows ran (torchtune's) are bench/torchtune_step.py's."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # hf: fp32 copy of all logits; chunked_compute: the head runs in chunks whose logits stay in the compute
    # dtype through the loss (litgpt); fused_logprob: TRL's fused LM head (trl.trainer.utils.add_fused_lm_head),
    # which folds 32768-wide vocabulary tiles of the logits into per-token log-probabilities and never holds the
    # full logits (fused_head_bytes)
    # fused_chunked: Unsloth's fused cross-entropy (unsloth_fused_ce_loss), the head and the fp32 loss over chunks
    # of at most 4 GiB of fp32 logits, the hidden states' gradient computed in forward (fused_chunked_loss_bytes);
    # liger_fused: Liger's fused linear cross-entropy, which makes the hidden states' gradient in the forward, a
    # chunk of logits at a time (liger_loss_bytes)
    loss: Literal["hf", "chunked_compute", "fused_logprob", "fused_chunked", "liger_fused"] = "hf"
    # Liger's RMSNorm, SwiGLU and rotary kernels (use_liger_kernel; catalog/stacks.toml [liger]): the norms save
    # their input in its own dtype and one fp32 rsqrt per row, SwiGLU saves gate and up only
    liger_kernels: bool = False
    kbit_upcast: bool = False  # peft prepare_model_for_kbit_training: non-quantised params to fp32
    lora_dtype: Literal["fp32", "compute"] = "fp32"  # peft autocasts adapters to fp32 by default
    fused_optimizer: bool = True  # adamw_torch_fused: no param-sized temporaries in the step
    # the model runs under torch.compile: Inductor fuses chains of elementwise ops into one kernel each, which
    # the time model counts (timing.py); the memory model does not model compile's own buffers
    compiled: bool = False
    amp_master_fp32: bool = False  # fp32 master weights with a bf16/fp16 autocast copy
    device: Literal["cuda", "cpu"] = "cuda"  # CPU dropout keeps a float mask where CUDA keeps a bool one
    # the HF Trainer with bf16/fp16 runs the forward under torch.autocast: peft's fp32 adapter matmuls then
    # save their inputs in the compute dtype
    autocast: bool = True
    # peft's kbit preparation followed by TRL's peft_module_casting_to_bf16 leaves the RMSNorm weights in fp32:
    # `weight * x.to(bf16)` then promotes every norm output, and with it the residual stream, to fp32
    fp32_norms: bool = False
    # peft's prepare_model_for_kbit_training upcasts the embeddings too, so the residual stream is fp32 from the
    # first layer on, and bitsandbytes' Linear4bit returns its output in its input's dtype (`.to(inp_dtype)`):
    # gate and up come out fp32 and SwiGLU saves its three tensors in fp32 (autocast runs only the matmuls and
    # the attention in the compute dtype)
    fp32_stream: bool = False
    # transformers' enable_input_require_grads (peft's kbit preparation with reentrant checkpointing, and the peft
    # QLoRA scripts' own call in their plain loops): the embeddings' output requires grad, so the first layer saves
    # for backward what every other layer does (its input norm, its adapters' dropout masks)
    input_grads: bool = False
    # bitsandbytes before 0.43.2 kept each 4/8-bit layer's input for backward as a ctx attribute
    # (`ctx.tensors = (A, B)`): it lives as long as the graph does, not only until that layer's backward
    bnb_saves_input: bool = False
    # litgpt's GPT has its own lm_head even where the checkpoint ties it to the embeddings
    untied_head: bool = False
    # Lightning's BitsandbytesPrecision (litgpt) converts every nn.Linear, the LM head too, and quantises from
    # an fp16 copy: each dequantisation makes an fp16 weight and then its cast to the compute dtype, two
    # copies at once
    quantized_head: bool = False
    dequant_copies: int = Field(default=1, ge=1)
    # litgpt's fused qkv projection: one LoRA (one dropout) for all adapted q/k/v, k and v repeated to every
    # head and copied, v a view of the fused output when there are as many kv heads as heads
    fused_qkv: bool = False
    # litgpt's loop keeps `logits` and `loss` of the last micro-batch until the next forward and loss replace
    # them: its logits, and through the loss its graph (with the bnb inputs held there), live through the
    # next forward
    keeps_previous_step: bool = False
    # CUDA context, cuBLAS/cuDNN workspaces and the kernel images a training step loads (flash-attn, bnb, fused
    # optimizers): nvidia-smi minus reserved; see device_bytes for the measurement
    cuda_context_gib: float = 0.9
    nccl_gib: float = 1.2  # NCCL buffers and the collective streams' pools, per GPU, when training on several
    # the shards under which a 4/8-bit base is loaded whole onto every GPU before it is sharded: transformers
    # quantises it on the process's GPU (bitsandbytes' device_map), accelerate's FSDP2 keeps bitsandbytes'
    # Params4bit off the meta device, and DeepSpeed moves a model that ZeRO-3 did not build whole to the GPU.
    # A shard not listed loads the base in host memory and moves it to the GPUs one sharded layer at a time
    quantized_whole_on_gpu: tuple[str, ...] = ("zero3",)
    # Unsloth's gradient checkpointing ("unsloth"): every checkpointed layer input but the last goes to pinned host
    # memory, whatever offload_activations says (checkpointed_layers_on_gpu)
    offloaded_checkpoints: bool = False
    # Unsloth's Triton RMSNorm / RoPE / SwiGLU and, with lora_dropout 0, its LoRA autograd functions for q/k/v, o
    # and the MLP: fewer saved tensors per layer (triton_kernel_parts)
    triton_kernels: bool = False
    # the families whose step Unsloth's FastLanguageModel patches with those kernels; the others it loads through
    # FastModel, where transformers' own modules run under its compiler (triton_kernels_apply). Empty: every family
    kernel_families: tuple[str, ...] = ()
    # Unsloth's 4-bit load quantises an MoE's experts too (NF4, as the linears): transformers' bitsandbytes
    # integration packs nn.Linear only and leaves the fused 3-D experts 16-bit (quantized_expert_params)
    quantized_experts: bool = False
    # an image-text model's vision tower and projector packed with the rest by a 4-bit load (transformers'
    # quantizer skips neither); Unsloth's skips them (llm_int8_skip_modules: vision_tower, multi_modal_projector)
    quantized_vision: bool = True
    # LoRA on an MoE's experts added beside the base's grouped matmul, ((x A) B) per expert, instead of peft's
    # W + B A materialised for the layer (Unsloth's default: unsloth_zoo temporary_patches/moe_utils.py @ ce232d6c,
    # _should_use_separated_lora l. 1095-1097, forward_native_grouped_mm l. 1619-1680): no merged weight is kept
    # (merged_expert_bytes); the N k x r products it saves are not counted (read from the source, not traced)
    separated_expert_lora: bool = False


def triton_kernels_apply(spec: ModelSpec, runtime: Runtime) -> bool:
    """Unsloth's Triton kernels run only in the families FastLanguageModel patches (Runtime.kernel_families); an
    image-text model is its own model_type (mistral3, qwen2_5_vl), which it loads through FastModel."""
    if not runtime.kernel_families:
        return runtime.triton_kernels
    return runtime.triton_kernels and spec.vision is None and spec.architecture in runtime.kernel_families


def quantized_expert_params(spec: ModelSpec, settings: Settings, runtime: Runtime) -> int:
    """The MoE expert weights a 4-bit load packs beside the linears: none under transformers' integration, every
    layer's under Unsloth's (unsloth_zoo temporary_patches/moe_utils_bnb4bit.py @ ce232d6c: the fused 3-D experts
    made Params4bit, l. 197-255, 257-312; gpt-oss's -unsloth-bnb-4bit repo holds one bnb Linear4bit per expert,
    gpt_oss.py GptOssExpertsBnb4bit l. 812-836)."""
    if settings.quant == "none" or not runtime.quantized_experts:
        return 0
    return spec.expert_params * spec.num_hidden_layers


def packed_params(spec: ModelSpec, settings: Settings, runtime: Runtime) -> int:
    """The weights a 4-bit load packs: the decoder's linears (and the vision tower's, unless the load skips it,
    unsloth_zoo/peft_utils.py @ ce232d6c SKIP_QUANTIZATION_MODULES l. 35-52), and the experts where it packs them."""
    vision = 0 if runtime.quantized_vision or not spec.vision else spec.vision.linear_params(spec.hidden_size)
    return spec.quantized_linear_params - vision + quantized_expert_params(spec, settings, runtime)


def stack_runtime(settings: Settings, **overrides: Any) -> Runtime:
    """The Runtime of the trainer `settings.stack` names (lorafit.stacks, catalog/stacks.toml), with the facets
    the settings switch (autocast, kbit_prep, fp32_adapters, fused_optimizer, torch_compile, liger) and
    `overrides` (e.g. device) on top."""
    quantized = settings.quant != "none"
    fields = stacks.resolve(settings.stack).facts(quantized, liger=bool(settings.liger))
    if settings.autocast is not None:
        fields["autocast"] = settings.autocast
    if settings.fused_optimizer is not None:
        fields["fused_optimizer"] = settings.fused_optimizer
    if settings.fp32_adapters is not None:
        fields["lora_dtype"] = "fp32" if settings.fp32_adapters else "compute"
    if settings.torch_compile is not None:
        fields["compiled"] = settings.torch_compile
    if settings.kbit_prep is not None and quantized:
        # peft's preparation upcasts every non-quantised parameter, the norms' weights and the embeddings too, to
        # fp32: the norms' outputs and with them the residual stream are fp32 (Runtime.fp32_norms, fp32_stream)
        fields["kbit_upcast"] = fields["fp32_norms"] = fields["fp32_stream"] = settings.kbit_prep
    if settings.autocast is False and fields.get("kbit_upcast"):
        # a plain loop over peft's kbit preparation (the peft QLoRA scripts) calls enable_input_require_grads; the
        # Trainer's path calls it only with checkpointing, where the first layer's recompute counts it anyway
        fields["input_grads"] = True
    return Runtime(**(fields | overrides))


# --- weights ------------------------------------------------------------------------------------------------
def quantized_weight_bytes(n_params: int, settings: Settings) -> float:
    """Packed base weights plus quantisation state.

    NF4: 4 bits per weight, one absmax per 64 weights (fp32, or uint8 plus one fp32 per 256 absmax with double
    quantisation). int8 (LLM.int8): 1 byte per weight plus an fp32 scale per output row (~0.1%, folded in)."""
    if settings.quant == "nf4":
        absmax = 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NESTED_BLOCK) if settings.double_quant else 4 / NF4_BLOCK
        return n_params * (0.5 + absmax)
    if settings.quant == "int8":
        return n_params * 1.001
    raise ValueError(settings.quant)


def weights_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Base model weights: all in the compute dtype, or the decoder linears packed and the rest (embeddings,
    LM head, norms, biases) in the compute dtype - fp32 if peft's kbit preparation upcast them."""
    return _base_weights_bytes(spec, settings, runtime) - offloaded_embedding_bytes(spec, settings, runtime)


def _base_weights_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    c = DTYPE_BYTES[settings.precision]
    if settings.method == "full" and runtime.amp_master_fp32:
        c = 4
    head_copy = spec.embedding_params if runtime.untied_head and spec.tie_word_embeddings else 0
    if settings.quant == "none":
        return (spec.num_params + head_copy) * c
    linear = packed_params(spec, settings, runtime)
    rest = spec.num_params - linear
    if runtime.quantized_head:
        # the head quantised like the layers; the embeddings stay in the compute dtype
        head = spec.lm_head_params + head_copy
        return quantized_weight_bytes(linear + head, settings) + (rest - spec.lm_head_params) * c
    return quantized_weight_bytes(linear, settings) + (rest + head_copy) * (4 if runtime.kbit_upcast else c)


def embedding_offload_applies(spec: ModelSpec, settings: Settings) -> bool:
    """The input embedding can stay on the CPU only when it is frozen (not full fine-tuning) and not the LM
    head's weight too (tied embeddings: the head runs on the GPU)."""
    return settings.method != "full" and not spec.tie_word_embeddings


def offloaded_embedding_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """offload_embeddings: the frozen input embedding (V x h, in the dtype the rest of the base is in) stays in
    host memory; each micro-batch gathers its N rows there and copies them (N x h x c) to the GPU, which the
    embedding's output costs anyway."""
    if not settings.offload_embeddings or not embedding_offload_applies(spec, settings):
        return 0.0
    c = 4 if runtime.kbit_upcast and settings.quant != "none" else DTYPE_BYTES[settings.precision]
    return spec.embedding_params * c


def trainable_params(spec: ModelSpec, settings: Settings) -> int:
    if settings.method == "full":
        return spec.num_params
    return spec.lora_params(settings.lora_r, settings.lora_targets)


def trainable_dtype_bytes(settings: Settings, runtime: Runtime) -> float:
    """Adapters are fp32 (peft's autocast_adapter_dtype); full fine-tuning trains the weights' own dtype."""
    if settings.method == "full":
        return 4 if runtime.amp_master_fp32 else DTYPE_BYTES[settings.precision]
    return 4 if runtime.lora_dtype == "fp32" else DTYPE_BYTES[settings.precision]


def adapter_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    if settings.method == "full":
        return 0.0
    return trainable_params(spec, settings) * trainable_dtype_bytes(settings, runtime)


def gradient_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """One gradient per trainable parameter, in its dtype, all alive until the optimizer step."""
    return trainable_params(spec, settings) * trainable_dtype_bytes(settings, runtime)


def head_grad_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Gradients of the LM head and final norm, the first ones full fine-tuning produces."""
    if settings.method != "full":
        return 0.0
    return (spec.lm_head_params + spec.hidden_size) * trainable_dtype_bytes(settings, runtime)


def embedding_grad_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    if settings.method != "full":
        return 0.0
    return spec.embedding_params * trainable_dtype_bytes(settings, runtime)


def optimizer_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """AdamW keeps two moments per trainable parameter in the parameter's dtype (torch), fp32 (bitsandbytes'
    32-bit paged AdamW, whatever the parameter's dtype) or 8-bit blockwise (bitsandbytes, with 32-bit state for
    tensors under 4096 elements); SGD without momentum keeps none.
    DeepSpeed ZeRO (zero2, zero3) steps an fp32 master copy of its partition instead of the parameters, even
    where they are fp32 already (stage_1_and_2.py single_partition_of_fp32_groups, stage3.py
    fp32_partitioned_groups_flat): 4 more bytes a trainable parameter, and the moments are fp32 too."""
    n = trainable_params(spec, settings)
    zero = settings.shard in ("zero2", "zero3")
    master = 4 * n if zero else 0.0
    if settings.optimizer == "sgd":
        return master
    if settings.optimizer == "paged_adamw_32bit":  # bitsandbytes' 32-bit states are fp32 (get_state_buffer)
        return 2 * n * 4 + master
    if settings.optimizer == "adamw":
        return 2 * n * (4 if zero else trainable_dtype_bytes(settings, runtime)) + master
    small = _params_in_small_tensors(spec, settings)
    return 2 * (n - small) * (1 + 4 / BNB_8BIT_BLOCK) + 2 * small * 4 + master


def _params_in_small_tensors(spec: ModelSpec, settings: Settings) -> int:
    """Trainable parameters that bnb keeps in 32-bit state: tensors too small for 8-bit (norms, biases, tiny
    LoRA) and, in full fine-tuning, the input embedding, which transformers' Trainer (and train/build.py)
    registers for 32-bit state under every 8-bit bitsandbytes optimizer."""
    if settings.method == "full":
        per_layer = spec.layer_other_params if spec.hidden_size < BNB_8BIT_MIN_SIZE else 0
        small = spec.num_hidden_layers * per_layer + (spec.hidden_size if spec.hidden_size < BNB_8BIT_MIN_SIZE else 0)
        return small + spec.embedding_params
    r = settings.lora_r
    names = set(spec.lora_target_names(settings.lora_targets))
    small = 0
    for name, fan_in, fan_out, copies in spec.layer_linears():
        if name in names:
            small += sum(r * dim for dim in (fan_in, fan_out) if r * dim < BNB_8BIT_MIN_SIZE) * copies
    return small * spec.num_hidden_layers


def paged(settings: Settings) -> bool:
    """bnb paged optimizers keep their state in CUDA managed memory, which the torch allocator does not count."""
    return settings.optimizer.startswith("paged")


# --- activations --------------------------------------------------------------------------------------------
def lora_module_saved_bytes(
    fan_in: int, settings: Settings, runtime: Runtime, input_requires_grad: bool = True
) -> float:
    """Per token, what one LoRA-wrapped linear saves: peft casts the input to the adapter dtype, lora_A keeps
    dropout's output (in the compute dtype under autocast), dropout its mask (bool on CUDA's fused dropout, the
    input dtype in the CPU kernel; none when no gradient flows to the input), lora_B keeps lora_A's r outputs."""
    c = DTYPE_BYTES[settings.precision]
    a = 4 if runtime.lora_dtype == "fp32" else c  # the dtype the input is cast to, and dropout runs in
    saved = c if runtime.autocast else a  # under autocast lora_A casts its input to the compute dtype and saves that
    mask = (1 if runtime.device == "cuda" else a) if settings.lora_dropout > 0 and input_requires_grad else 0
    return fan_in * (saved + mask) + settings.lora_r * saved


def activation_parts_per_token(
    spec: ModelSpec, settings: Settings, runtime: Runtime, input_requires_grad: bool = True
) -> dict[str, float]:
    """Bytes one decoder layer saves for backward, per token, by sub-block (no checkpointing).

    RMSNorm (HF) upcasts to fp32 and saves that copy (4h) plus the rsqrt (4); with a trainable weight it also
    saves the bf16 normalised input (2h). Frozen linears save nothing; trainable ones save their input.
    sdpa/flash save q, k, v (k and v repeated to all heads when a mask is passed), the output and the fp32
    logsumexp; eager saves the score and probability matrices instead. SwiGLU saves gate, silu(gate) and up."""
    c = DTYPE_BYTES[settings.precision]
    h, q, kv, inter = spec.hidden_size, spec.q_size, spec.kv_size, spec.mlp_width
    heads = spec.num_attention_heads
    full = settings.method == "full"
    lora_names = set() if full else set(spec.lora_target_names(settings.lora_targets))

    def norm() -> float:
        if not input_requires_grad and not full:
            return 0.0
        return norm_saved_bytes(spec, settings, runtime)

    def linear_inputs(names: dict[str, tuple[int, int]], shared_input: bool) -> float:
        if full:
            fan_ins = {fan_in for fan_in, _ in names.values()} if shared_input else [i for i, _ in names.values()]
            return sum(c * fan_in for fan_in in fan_ins)
        return sum(
            lora_module_saved_bytes(fan_in, settings, runtime, input_requires_grad)
            for name, (fan_in, _) in names.items()
            if name in lora_names
        )

    def linear_inputs_grad(names: dict[str, tuple[int, int]], shared_input: bool) -> float:
        """Past the first LoRA output everything downstream requires grad."""
        if full:
            return linear_inputs(names, shared_input)
        return sum(
            lora_module_saved_bytes(fan_in, settings, runtime)
            for name, (fan_in, _) in names.items()
            if name in lora_names
        )

    attn_linears = spec.attention_linears()
    qkv = {name: dims for name, dims in attn_linears.items() if name != "o_proj"}
    out_proj = {"o_proj": attn_linears["o_proj"]}
    a = attention_dtype_bytes(settings, runtime)
    # eager (and litgpt always) repeats k/v to every head before the attention
    kv_saved = q if settings.attn == "eager" or runtime.fused_qkv else kv
    # litgpt without head groups: v is a view of the fused qkv output, which it keeps alive whole
    v_saved = c * (q + 2 * kv) if runtime.fused_qkv and heads == spec.num_key_value_heads else a * kv_saved
    if settings.attn == "eager":
        # q and k for QK^T, fp32 softmax output, its bf16 cast for the AV matmul, v for the AV matmul; Gemma-2's
        # soft-capping (tanh(scores / cap) x cap) also keeps the tanh output
        scores = (4 + c + (c if spec.logit_softcapping else 0)) * heads * settings.seq_len
        if spec.arch.attention_sinks:
            # gpt-oss appends its sink logit to each row and takes the softmax in the scores' own dtype: the
            # probabilities (seq + 1 columns) in bf16 and the row maxima's int64 indices
            scores = c * heads * (settings.seq_len + 1) + 8 * heads
        attention = a * (q + kv_saved) + scores + v_saved
    else:
        attention = a * (q + kv_saved) + v_saved + a * q + 4 * heads
    if spec.arch.fused_qkv and not runtime.fused_qkv:
        # a fused qkv_proj (Phi-3's): v is a view of that output, so the saved v keeps all q + 2 kv columns alive
        attention += c * (q + kv)
    mlp = {name: dims for name, dims in spec.mlp_linears().items() if name != "down_proj"}
    down = {"down_proj": spec.mlp_linears()["down_proj"]}
    experts = max(spec.num_experts_per_tok, 1) if spec.is_moe else 1
    # silu saves gate and the product silu(gate) and up; Liger's kernel saves gate and up, recomputing silu
    gated = (2 if runtime.liger_kernels else 3) * swiglu_dtype_bytes(settings, runtime) * inter
    if spec.arch.clamped_swiglu:
        # gpt-oss: both clamps keep the interleaved gate_up output (2 i) alive; the products save the clamped
        # gate, sigmoid(alpha gate), up + 1 and the gated product (GptOssExperts._apply_gate)
        gated = 6 * swiglu_dtype_bytes(settings, runtime) * inter
    parts = {
        "attn_norm": norm(),
        "qkv_inputs": fused_qkv_lora_bytes(qkv, lora_names, settings, runtime, input_requires_grad)
        if runtime.fused_qkv and not full
        else linear_inputs(qkv, shared_input=True),
        "attention": attention,
        # sdpa/flash return their output laid out as (batch, seq, heads, head_dim): the o_proj input is a view of
        # the output attention already saved, so a trainable o_proj saves nothing new
        "o_proj_input": 0.0 if full and settings.attn != "eager" else linear_inputs_grad(out_proj, False),
        "mlp_norm": norm_saved_bytes(spec, settings, runtime),  # the residual stream requires grad past attention
        "mlp_inputs": experts * linear_inputs_grad(mlp, shared_input=True),
        "gated_act": experts * gated,
        "down_input": experts * linear_inputs_grad(down, shared_input=False),
    }
    if spec.is_moe:
        # each routed expert's output is scaled by its routing weight, which requires grad (the router sees the
        # trainable residual stream), so the product keeps every expert output: k x hidden per token
        # (transformers 5.25 integrations/moe.py grouped_mm_experts_forward; checked against the trace in
        # tests/test_moe.py)
        parts["expert_outputs"] = experts * c * h
    if spec.norms_per_layer > 2:
        # Gemma-2 and Gemma 3 normalise the attention and MLP outputs too, before adding them to the residual stream
        parts["post_norms"] = (spec.norms_per_layer - 2) * norm_saved_bytes(spec, settings, runtime)
    if spec.arch.qk_norm_saved:
        # Gemma 3 RMS-normalises each query and key head before RoPE: like the layer norms, each saves its fp32
        # input and one rsqrt per head (and, in full fine-tuning, its normalised input for the weight's gradient)
        kv_heads = spec.num_key_value_heads
        width = c if runtime.liger_kernels else 4  # Liger's RMSNorm saves its input in its own dtype
        extra = c * (q + kv) if full and not runtime.liger_kernels else 0
        parts["qk_norms"] = width * (q + kv) + 4 * (heads + kv_heads) + extra
    if keeps_bnb_inputs(settings, runtime):
        parts["bnb_inputs"] = bnb_input_bytes_per_token(spec, settings, input_requires_grad)
    if triton_kernels_apply(spec, runtime) and not full:
        parts |= triton_kernel_parts(spec, settings, lora_names, input_requires_grad)
    return parts


def triton_kernel_parts(
    spec: ModelSpec, settings: Settings, lora_names: set[str], input_requires_grad: bool
) -> dict[str, float]:
    """What Unsloth's kernels save per token in place of the HF modules' tensors (unsloth/kernels @ 015bdef0):
    its RMSNorm its input in the compute dtype and one fp32 rsqrt (rms_layernorm.py, l. 205); RoPE nothing of q
    and k (rope_embedding.py); SwiGLU gate and up only. With lora_dropout 0 (patch_peft_model) LoRA_QKV saves
    the one input of q/k/v, LoRA_W o's input and LoRA_MLP the MLP's input with gate and up (fast_lora.py, l. 110,
    418, 612): no lora_A outputs, no silu(gate), no down_proj input. A projection group not fully adapted, or
    dropout above 0, keeps peft's modules."""
    c, h, q, inter = DTYPE_BYTES[settings.precision], spec.hidden_size, spec.q_size, spec.intermediate_size
    experts = max(spec.num_experts_per_tok, 1) if spec.is_moe else 1
    kernels = settings.lora_dropout == 0

    def adapted(names: tuple[str, ...]) -> bool:
        return kernels and all(name in lora_names for name in names)

    norm = c * h + 4
    out = {"attn_norm": norm if input_requires_grad else 0.0, "mlp_norm": norm, "gated_act": experts * 2 * c * inter}
    if adapted(("q_proj", "k_proj", "v_proj")):
        out["qkv_inputs"] = c * h if input_requires_grad else 0.0
    if adapted(("o_proj",)):
        # LoRA_W saves its input, the attention's output, which flash/sdpa saved already (a view); eager's is new
        out["o_proj_input"] = c * q if settings.attn == "eager" else 0.0
    if adapted(("gate_proj", "up_proj", "down_proj")):
        out |= {"mlp_inputs": experts * c * h, "down_input": 0.0}
    return out


def norm_saved_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Per token, what one RMSNorm over the residual stream saves. transformers' upcasts to fp32 and saves that
    copy (4h) and the rsqrt (4), and with a trainable weight the normalised input too (2h). Liger's
    (LigerRMSNormFunction @ v0.8.2) saves its input as it comes, in the stream's dtype, and the fp32 rsqrt; its
    weight's gradient is recomputed from them."""
    h = spec.hidden_size
    if runtime.liger_kernels:
        return stream_dtype_bytes(settings, runtime) * h + 4
    return 4 * h + 4 + (2 * h if settings.method == "full" else 0)


def fused_qkv_lora_bytes(
    qkv: dict[str, tuple[int, int]],
    lora_names: set[str],
    settings: Settings,
    runtime: Runtime,
    input_requires_grad: bool,
) -> float:
    """litgpt's LoRAQKVLinear: one dropout and one lora_A (r outputs per adapted projection) for all of q/k/v;
    when some of them are not adapted, zero_pad's index_copy_ keeps the adapted outputs (c per column)."""
    adapted = [name for name in qkv if name in lora_names]
    if not adapted:
        return 0.0
    fan_in = next(iter(qkv.values()))[0]
    ranked = settings.model_copy(update={"lora_r": settings.lora_r * len(adapted)})
    saved = lora_module_saved_bytes(fan_in, ranked, runtime, input_requires_grad)
    if len(adapted) < len(qkv):
        saved += DTYPE_BYTES[settings.precision] * sum(qkv[name][1] for name in adapted)
    return saved


def keeps_bnb_inputs(settings: Settings, runtime: Runtime) -> bool:
    """Old bitsandbytes keeps the inputs of the layers it quantised; nothing is quantised without --quant."""
    return runtime.bnb_saves_input and settings.quant != "none"


def bnb_input_bytes_per_token(spec: ModelSpec, settings: Settings, input_requires_grad: bool = True) -> float:
    """The inputs old bitsandbytes keeps per layer: q/k/v share one (kept only if it needs a gradient, which
    the first layer's does not under LoRA), gate/up another, o_proj and down_proj their own."""
    c = DTYPE_BYTES[settings.precision]
    h, q, inter = spec.hidden_size, spec.q_size, spec.mlp_width
    experts = max(spec.num_experts_per_tok, 1) if spec.is_moe else 1
    qkv_input = h if input_requires_grad or settings.method == "full" else 0
    return c * (qkv_input + q + h + experts * inter)


def bnb_held_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """What old bitsandbytes' ctx attributes hold for one micro-batch, all layers and the quantised head:
    alive until the graph is freed."""
    if not keeps_bnb_inputs(settings, runtime):
        return 0.0
    layers = spec.num_hidden_layers
    per_token = bnb_input_bytes_per_token(spec, settings, input_requires_grad=False) + (
        layers - 1
    ) * bnb_input_bytes_per_token(spec, settings)
    if runtime.quantized_head:
        per_token += DTYPE_BYTES[settings.precision] * spec.hidden_size
    return per_token * settings.tokens_per_micro_batch


@lru_cache(maxsize=4096)  # the planner asks for the same few thousand times a plan; all four are frozen values
def activation_bytes_per_layer(
    spec: ModelSpec, settings: Settings, runtime: Runtime, input_requires_grad: bool = True
) -> float:
    """Saved bytes of one decoder layer for one micro-batch, without checkpointing."""
    parts = activation_parts_per_token(spec, settings, runtime, input_requires_grad)
    merged = 0.0 if runtime.separated_expert_lora else merged_expert_bytes(spec, settings)
    return sum(parts.values()) * settings.tokens_per_micro_batch + merged


def merged_expert_bytes(spec: ModelSpec, settings: Settings) -> float:
    """LoRA on an MoE's fused experts (lora_targets experts): peft's ParamWrapper parametrises each expert
    parameter as W + B A, materialised in the compute dtype for the layer's forward, and the expert matmuls save
    it for backward: one layer's expert weights per layer that keeps its activations (checked against the trace
    of Qwen3-30B-A3B, gpt-oss-20b and Mixtral in tests/test_moe.py)."""
    if not spec.expert_target_names(settings.lora_targets) or settings.method == "full":
        return 0.0
    return spec.expert_params * DTYPE_BYTES[settings.precision]


def swiglu_dtype_bytes(settings: Settings, runtime: Runtime) -> float:
    """The dtype SwiGLU's saved gate, silu(gate) and up are in: the compute dtype, or fp32 after peft's kbit
    preparation, whose fp32 residual stream reaches gate_proj and up_proj, and bitsandbytes' Linear4bit hands
    its output back in its input's dtype (`Linear4bit.forward`: `matmul_4bit(...).to(inp_dtype)`, bitsandbytes
    0.50.2).
    Traced: `make bench-stacks` (peft-kbit QLoRA without checkpointing), 6 x I bytes per token and layer over
    the bf16 count on Llama-2-7B and Llama-3.1-8B."""
    if runtime.fp32_stream and settings.quant != "none":
        return 4
    return DTYPE_BYTES[settings.precision]


def attention_dtype_bytes(settings: Settings, runtime: Runtime) -> float:
    """The dtype the attention saves q, k, v and its output in: the compute dtype, or fp32 when peft's kbit
    preparation made the residual stream fp32 and no autocast casts the attention's inputs down - bitsandbytes
    hands q, k and v back in their fp32 input's dtype (`Linear4bit.forward`, 0.50.2) and SDPA runs in fp32.
    Traced: `make bench-stacks` (the peft-kbit plain-loop cases, no autocast): 2 x (2q + 2kv) bytes per token
    and layer over the bf16 count, 8h on Llama-2-7B and 5h on Llama-3.1-8B."""
    if runtime.fp32_stream and not runtime.autocast and settings.quant != "none":
        return 4
    return DTYPE_BYTES[settings.precision]


def first_layer_input_requires_grad(settings: Settings, runtime: Runtime) -> bool:
    """The first layer's input needs a gradient - and its input norm and adapters save what the other layers'
    do - in full fine-tuning (trainable embeddings) or after enable_input_require_grads (Runtime.input_grads)."""
    return settings.method == "full" or runtime.input_grads


def stream_dtype_bytes(settings: Settings, runtime: Runtime) -> float:
    """Bytes per element of the residual stream between the layers: fp32 when fp32 norm weights (or peft's
    fp32 embeddings) promote it, else the compute dtype."""
    return 4 if runtime.fp32_norms or runtime.fp32_stream else DTYPE_BYTES[settings.precision]


def checkpoint_bytes_per_layer(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Under checkpointing a layer keeps only its input hidden state (c x h per token, fp32 when fp32 norm
    weights promoted the residual stream) until backward."""
    return stream_dtype_bytes(settings, runtime) * spec.hidden_size * settings.tokens_per_micro_batch


def checkpointed_layers_on_gpu(spec: ModelSpec, settings: Settings, runtime: Runtime = Runtime()) -> int:
    """Layers whose checkpointed input is on the GPU at the end of the forward pass: all of them, or with
    offload_activations (save_on_cpu around the forward) the one or two in flight to or from host memory, or
    under Unsloth's checkpointing the last layer's input and its two reused copy buffers."""
    if runtime.offloaded_checkpoints and settings.grad_ckpt and unsloth_offloads(spec, settings):
        return min(spec.num_hidden_layers, UNSLOTH_LAYERS_ON_GPU)
    if settings.offload_activations and settings.grad_ckpt:
        return min(spec.num_hidden_layers, OFFLOAD_LAYERS_ON_GPU)
    return spec.num_hidden_layers


def unsloth_offloads(spec: ModelSpec, settings: Settings) -> bool:
    """Unsloth offloads a layer input only above 2 MiB (MINIMUM_SIZE, gradient_checkpointing.py l. 694): below
    that, as for micro-batches of a few hundred tokens, every checkpoint stays on the GPU."""
    return DTYPE_BYTES[settings.precision] * spec.hidden_size * settings.tokens_per_micro_batch > 2 * 2**20


def offloaded_activation_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime = Runtime()) -> float:
    """Pinned host memory offload_activations holds: every layer's checkpointed input (N x h x c each), copied
    out in forward and back in backward."""
    unsloth = runtime.offloaded_checkpoints and unsloth_offloads(spec, settings)
    if not ((settings.offload_activations or unsloth) and settings.grad_ckpt):
        return 0.0
    width = stream_dtype_bytes(settings, runtime)
    layers = spec.num_hidden_layers - (1 if unsloth else 0)  # Unsloth keeps the last
    return layers * width * spec.hidden_size * settings.tokens_per_micro_batch


# The share of the free host RAM the offloading savers may fill: the data loader, the tokenizer and pinned
# staging buffers need the rest.
HOST_RAM_SHARE = 0.8


def host_saver_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime | None = None) -> float:
    """Host memory the offloading savers hold during a step: the pinned activations and the embedding table."""
    runtime = runtime or stack_runtime(settings)
    return offloaded_activation_bytes(spec, settings, runtime) + offloaded_embedding_bytes(spec, settings, runtime)


def host_saver_problem(spec: ModelSpec, settings: Settings, free_gib: float | None) -> str | None:
    """Why the offloading savers in `settings` do not fit the host RAM that is free, or None."""
    needed = host_saver_bytes(spec, settings)
    if not needed or free_gib is None or needed <= HOST_RAM_SHARE * free_gib * GIB:
        return None
    on = [name for name in ("offload_activations", "offload_embeddings") if getattr(settings, name)]
    return (
        f"{' and '.join(on)} need {gib(needed):.1f} GiB of host RAM and {free_gib:.1f} GiB is free "
        f"({HOST_RAM_SHARE:.0%} of it may be used); turn {' and '.join(on)} off or free some RAM"
    )


def activation_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """All layers' saved tensors at the end of the forward pass. With frozen embeddings (LoRA) the first
    layer's input norm needs no grad, so it saves nothing."""
    layers = spec.num_hidden_layers
    if settings.grad_ckpt:
        return checkpointed_layers_on_gpu(spec, settings, runtime) * checkpoint_bytes_per_layer(spec, settings, runtime)
    first = activation_bytes_per_layer(
        spec, settings, runtime, input_requires_grad=first_layer_input_requires_grad(settings, runtime)
    )
    rest = activation_bytes_per_layer(spec, settings, runtime)
    return first + (layers - 1) * rest


def head_saved_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """The final RMSNorm saves its fp32 input (and, training the head, the normalised bf16 input, which the head
    saves too); Liger's saves its input as it comes (norm_saved_bytes). A quantised head under old bitsandbytes
    keeps that normalised input too."""
    c, h = DTYPE_BYTES[settings.precision], spec.hidden_size
    liger = runtime.liger_kernels
    per_token: float = norm_saved_bytes(spec, settings, runtime) if liger else 4 * h + 4
    if settings.method == "full":
        per_token += (1 if liger else 2) * c * h
    elif runtime.quantized_head and keeps_bnb_inputs(settings, runtime):
        per_token += c * spec.hidden_size
    return per_token * settings.tokens_per_micro_batch


def head_chunk_tokens(settings: Settings) -> int:
    return settings.micro_batch * min(settings.seq_len, HEAD_CHUNK)


def head_dequant_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """A quantised head dequantises its whole (V x h) weight for every chunk, forward and backward."""
    if not runtime.quantized_head or settings.quant == "none":
        return 0.0
    return runtime.dequant_copies * DTYPE_BYTES[settings.precision] * spec.vocab_size * spec.hidden_size


def head_forward_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """The end of a chunked head's forward: the logits of the other chunks (compute dtype) and, for the last
    chunk, its dequantised weight copies or the weight and the chunk's output."""
    c, vocab = DTYPE_BYTES[settings.precision], spec.vocab_size
    n, chunk = settings.tokens_per_micro_batch, head_chunk_tokens(settings)
    dequant = head_dequant_bytes(spec, settings, runtime)
    if not dequant:
        return c * vocab * n
    single = dequant / runtime.dequant_copies
    return c * vocab * (n - chunk) + max(dequant, single + c * vocab * chunk)


def previous_step_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """What a loop that keeps the last micro-batch's logits and loss holds through the next forward: those
    logits (compute dtype, chunked) and what old bitsandbytes keeps in the graph the loss still references."""
    if not runtime.keeps_previous_step:
        return 0.0
    logits = DTYPE_BYTES[settings.precision] * spec.vocab_size * settings.tokens_per_micro_batch
    return logits + bnb_held_bytes(spec, settings, runtime)


def logits_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime, gpu_bytes: float | None = None) -> float:
    """Peak of the LM head and loss. transformers upcasts all logits to fp32 for the loss: in backward the
    saved log-softmax (4V), the gradient from nll_loss (4V) and the gradient it produces (4V) are alive
    together - 12 bytes x V per token, more than the whole model's activations for a 128k vocabulary.
    litgpt's chunked loss and TRL's fused head never upcast all logits; lorafit's chunked loss upcasts one chunk
    at a time (chunked_loss_bytes)."""
    n, vocab = settings.tokens_per_micro_batch, spec.vocab_size
    if settings.loss == "chunked" and runtime.loss == "hf":
        return chunked_loss_bytes(spec, settings)
    if runtime.loss == "chunked_compute":
        # litgpt: the logits list and every chunk's log-softmax (compute dtype, no upcast); in backward one
        # chunk's gradient, then the gradient of its log-softmax or the head's dequantised weight
        c, chunk = DTYPE_BYTES[settings.precision], head_chunk_tokens(settings)
        backward_chunk = max(c * vocab * chunk, head_dequant_bytes(spec, settings, runtime))
        return 2 * c * vocab * n + c * vocab * chunk + backward_chunk
    if runtime.loss == "fused_logprob":
        return fused_head_bytes(spec, settings, runtime)
    if runtime.loss == "fused_chunked":
        return fused_chunked_loss_bytes(spec, settings, unsloth_chunk_target(spec, settings, runtime, gpu_bytes))
    if runtime.loss == "liger_fused":
        return liger_loss_bytes(spec, settings, runtime)
    # Gemma-2 soft-caps the logits (tanh(logits / 30) x 30) in the compute dtype: tanh keeps its output
    softcap = DTYPE_BYTES[settings.precision] * vocab * n if spec.logit_softcapping else 0
    return 12 * vocab * n + softcap + head_weight_cast_bytes(spec, settings, runtime)


def head_weight_cast_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """peft's kbit preparation leaves the LM head's weight in fp32; under autocast the head's matmul runs on a
    compute-dtype copy of it (V x h x c) and saves that copy for the backward to its input, so it lives from the
    head's forward through the loss (`make bench-stacks`, peft-kbit QLoRA: c x V x h over the logits on
    Llama-2-7B and Llama-3.1-8B)."""
    if not (runtime.kbit_upcast and runtime.autocast) or settings.quant == "none" or settings.precision == "fp32":
        return 0.0
    return DTYPE_BYTES[settings.precision] * spec.vocab_size * spec.hidden_size


# TRL's fused LM head (trl/kernels/chunked_logprob.py @ v1.16.0, ChunkedLogProbFunction): the logits are made
# one tile of at most FUSED_TILE_TOKENS scored tokens x FUSED_VOCAB_CHUNK vocabulary entries at a time, in one
# buffer allocated at that full size whatever the vocabulary
FUSED_TILE_TOKENS = 4096  # TOKEN_CHUNK_SIZE
FUSED_VOCAB_CHUNK = 32768  # _CHUNKED_LOGPROB_CHUNK_SIZE in trl/trainer/utils.py
# the CPU's torch fall-back for the Triton kernels (_backward_tile) holds this many fp32-sized tiles at once:
# y, z, log_p, p and grad, the is_target mask (a byte), `is_target.float() - p` and its product with the
# log-probabilities' gradient (29 bytes per tile element in the CPU steps of `make bench-stacks`)
FUSED_CPU_BACKWARD_TILES = 7.25


def fused_head_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """TRL's fused LM head at its backward, the peak of the loss (`add_fused_lm_head`, trl/trainer/utils.py @
    v1.16.0, and ChunkedLogProbFunction.backward). With n = micro_batch x (seq_len - 1) scored tokens and
    k = min(n, 4096) tokens per tile:

    - the hidden states it saved for backward: on CUDA `hidden_states[mask]` gathers the scored positions into a
      new c x h x n tensor; the CPU path takes `reshape(-1, h)` of `last_hidden_state[:, :-1]`, a copy only when
      the micro-batch has several rows;
    - the tile buffer, k x 32768 x c, and the fp32 gradient of the hidden states it accumulates, 4 x h x n;
    - on CUDA the Triton kernels turn each tile into its gradient in place and the gradient GEMMs accumulate in
      fp32 without copies, so the last moment is the cast of that gradient to the hidden states' dtype
      (c x h x n) before the buffer is freed; the CPU's torch fall-back holds 7.25 fp32 tiles of
      k x min(V, 32768) at once instead (FUSED_CPU_BACKWARD_TILES).

    The full logits never exist: for Llama-3.1-8B at 2048 tokens 0.17 GiB in place of 2.9 GiB of fp32 logits
    (`make bench-stacks` traces TRL's SFTTrainer step)."""
    c, h = DTYPE_BYTES[settings.precision], spec.hidden_size
    scored = settings.micro_batch * (settings.seq_len - 1)
    tile = min(scored, FUSED_TILE_TOKENS)
    buffers = tile * FUSED_VOCAB_CHUNK * c + 4 * h * scored
    if runtime.device == "cpu":
        gathered = c * h * scored if settings.micro_batch > 1 else 0
        fold = FUSED_CPU_BACKWARD_TILES * 4 * tile * min(spec.vocab_size, FUSED_VOCAB_CHUNK)
        return gathered + buffers + max(fold, c * h * scored)
    return c * h * scored + buffers + c * h * scored


def unsloth_chunk_target(
    spec: ModelSpec, settings: Settings, runtime: Runtime, gpu_bytes: float | None = None
) -> float:
    """The most fp32 logits one chunk of Unsloth's fused cross-entropy may hold: half the memory free when the
    loss starts, at most 4 GiB (_get_chunk_multiplier). Free: the GPU's memory less the CUDA context, the weights,
    adapters, optimizer states, gradients (accumulating), the saved activations and the gradient of the hidden
    states the loss allocates; without a GPU, the 4 GiB cap."""
    if gpu_bytes is None:
        return UNSLOTH_CHUNK_TARGET_BYTES
    used = (
        runtime.cuda_context_gib * GIB
        + weights_bytes(spec, settings, runtime)
        + adapter_bytes(spec, settings, runtime)
        + (0.0 if paged(settings) else optimizer_bytes(spec, settings, runtime))
        + (gradient_bytes(spec, settings, runtime) if settings.grad_accum > 1 else 0.0)
        + activation_bytes(spec, settings, runtime)
        + head_saved_bytes(spec, settings, runtime)
        + DTYPE_BYTES[settings.precision] * spec.hidden_size * settings.tokens_per_micro_batch
    )
    return min(max(gpu_bytes - used, 0.0) / 2, UNSLOTH_CHUNK_TARGET_BYTES)


def unsloth_chunk_tokens(spec: ModelSpec, settings: Settings, target_bytes: float = UNSLOTH_CHUNK_TARGET_BYTES) -> int:
    """Tokens in one chunk of Unsloth's fused cross-entropy: the micro-batch cut into as many chunks as keep each
    chunk's fp32 logits under `target_bytes` (unsloth_chunk_target), rounded up to a multiple of 4
    (get_chunk_size). Where nothing is free, one token a chunk: Unsloth itself stops there."""
    n = settings.tokens_per_micro_batch
    if target_bytes <= 0:
        return 1
    exact = 4 * spec.vocab_size * n / target_bytes
    chunks = 1 if exact <= 1 else 4 * math.ceil(exact / 4)
    return math.ceil(n / chunks)


def fused_chunked_loss_bytes(
    spec: ModelSpec, settings: Settings, target_bytes: float = UNSLOTH_CHUNK_TARGET_BYTES
) -> float:
    """Unsloth's fused cross-entropy (UnslothFusedLoss.forward): the gradient of the hidden states it fills in
    forward (N x h x c, saved for backward) and one chunk at its peak, twice its fp32 logits (8 x V per token):
    compute_fused_ce_loss upcasts the logits to fp32 and torch.func.grad_and_value, compiled, turns them into
    their gradient, and Unsloth sizes a chunk's fp32 logits to half the free memory, so that the two fit.
    Gemma-2's soft-capping keeps its tanh output too (c x V). Read from the source, not traced: Unsloth needs a
    GPU; checked by the USC-* rows of `make bench-memory`."""
    c, chunk = DTYPE_BYTES[settings.precision], unsloth_chunk_tokens(spec, settings, target_bytes)
    per_token = (8 + (c if spec.logit_softcapping else 0)) * spec.vocab_size
    return c * spec.hidden_size * settings.tokens_per_micro_batch + per_token * chunk


def liger_chunk_tokens(spec: ModelSpec, settings: Settings) -> int:
    """Tokens Liger's fused linear cross-entropy scores at once (fused_linear_cross_entropy_forward @ v0.8.2):
    the next power of two of tokens / ceil(V / h), so that a chunk's logits are about the hidden states' size."""
    tokens = settings.tokens_per_micro_batch
    per_chunk = math.ceil(tokens / math.ceil(spec.vocab_size / spec.hidden_size))
    return min(tokens, 1 << (per_chunk - 1).bit_length())


def liger_loss_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Liger's fused linear cross-entropy (LigerFusedLinearCrossEntropyFunction @ v0.8.2), the peak of the loss,
    which is in its forward: it computes the hidden states' gradient there, one chunk of k tokens
    (liger_chunk_tokens) at a time, and keeps it for a backward that only scales it. Alive together: the final
    hidden states it reads and that gradient (zeros_like them: N x h in the stream's dtype each), one chunk's
    logits (k x V, the matmul's dtype), turned into their gradient in place, and that chunk's input gradient
    (k x h) before it is copied in; the fp32 per-token losses (4 N). No logits of all tokens, no fp32 upcast:
    for Llama-3.1-8B at 2048 tokens 0.05 GiB in place of 2.9 GiB. Over peft's fp32 LM head the autocast matmul
    casts the head's weight for every chunk (head_weight_cast_bytes)."""
    c, s = DTYPE_BYTES[settings.precision], stream_dtype_bytes(settings, runtime)
    n, h, chunk = settings.tokens_per_micro_batch, spec.hidden_size, liger_chunk_tokens(spec, settings)
    return 2 * s * h * n + c * (spec.vocab_size + h) * chunk + 4 * n + head_weight_cast_bytes(spec, settings, runtime)


def loss_chunk_tokens(settings: Settings) -> int:
    return min(settings.tokens_per_micro_batch, LOSS_CHUNK_TOKENS)


def chunked_loss_bytes(spec: ModelSpec, settings: Settings) -> float:
    """lorafit's chunked loss (settings.loss "chunked"): the head and the fp32 cross-entropy run one chunk of
    LOSS_CHUNK_TOKENS tokens at a time and again in backward, so unlike torchtune's (bench/torchtune_step.py) no
    chunk's log-softmax is kept. In a chunk's backward its fp32 logits, the gradient from the loss and the
    gradient it produces are alive together (12 x V per token, as in the full loss but for one chunk), next to
    the gradient of the final hidden states that the chunks fill (N x h x c). Gemma-2's soft-capping keeps
    one chunk's tanh output as well."""
    c, chunk = DTYPE_BYTES[settings.precision], loss_chunk_tokens(settings)
    softcap = c * spec.vocab_size * chunk if spec.logit_softcapping else 0
    return 12 * spec.vocab_size * chunk + softcap + c * spec.hidden_size * settings.tokens_per_micro_batch


def grad_buffer_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime = Runtime()) -> float:
    """What backward through one layer holds besides its saved tensors: the gradients in flight (hidden-sized
    in the compute dtype; at the MLP the intermediate-sized gradient of down_proj's input, for LoRA also in the
    adapter's fp32). The coefficients are those of the traced backward of the real step
    (`python -m lorafit.trace.terms llama-2-7b --compare` and `qwen2.5-1.5b`, two shapes that separate the h
    and I terms): LoRA (4 + c) x I, full fine-tuning 2c x I + 8c x h, per token. With the adapters in the
    compute dtype under autocast (TRL's QLoRA) no fp32 gradient is made: I + c x h in TRL's traced step
    (`make bench-stacks`, Llama-2-7B and Llama-3.1-8B)."""
    c = DTYPE_BYTES[settings.precision]
    h, inter = spec.hidden_size, spec.mlp_width
    if settings.method == "full":
        per_token = 2 * c * inter + 8 * c * h
    elif compute_dtype_adapters_under_autocast(settings, runtime):
        per_token = inter + c * h
    else:
        per_token = (4 + c) * inter
    return per_token * settings.tokens_per_micro_batch


def compute_dtype_adapters_under_autocast(settings: Settings, runtime: Runtime) -> bool:
    """Adapters in the compute dtype inside an autocast forward: nothing in the LoRA path is cast to fp32."""
    return runtime.lora_dtype == "compute" and runtime.autocast and settings.precision != "fp32"


def recompute_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Backward of a checkpointed layer: its saved tensors, recomputed, plus what the recomputation and the
    backward hold in flight. For LoRA that is more than without checkpointing (the recomputed forward's own
    temporaries overlap the first gradients): 5c x I + 4c x h per token in the same traces. With the adapters
    in the compute dtype under autocast the intermediate-sized fp32 casts are gone: 4c x h (TRL's QLoRA step,
    `make bench-stacks`, within 2.5 kB per token on Llama-2-7B and Llama-3.1-8B)."""
    c = DTYPE_BYTES[settings.precision]
    if settings.method == "full":
        in_flight = grad_buffer_bytes(spec, settings)
    elif compute_dtype_adapters_under_autocast(settings, runtime):
        in_flight = 4 * c * spec.hidden_size * settings.tokens_per_micro_batch
    elif triton_kernels_apply(spec, runtime):
        # Unsloth's LoRA_MLP.backward (fast_lora.py @ 015bdef0, l. 116-200): down_proj's input gradient DW
        # (c x I; matmul_lora adds the LoRA product in place), the SwiGLU backward in place into DW, e and g, and
        # the hidden-sized gradients (4c x h); read from the source, not traced
        in_flight = (c * spec.intermediate_size + 4 * c * spec.hidden_size) * settings.tokens_per_micro_batch
    else:
        in_flight = (5 * c * spec.mlp_width + 4 * c * spec.hidden_size) * settings.tokens_per_micro_batch
    return activation_bytes_per_layer(spec, settings, runtime) + in_flight


def dequant_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime = Runtime()) -> float:
    """bitsandbytes dequantises each 4/8-bit weight to the compute dtype for its matmul, one at a time."""
    if settings.quant == "none":
        return 0.0
    largest = max(fan_in * fan_out for _, fan_in, fan_out, _ in spec.layer_linears())
    return (
        max(largest * runtime.dequant_copies, expert_stack_params(spec, settings, runtime))
        * DTYPE_BYTES[settings.precision]
    )


def expert_stack_params(spec: ModelSpec, settings: Settings, runtime: Runtime) -> int:
    """4-bit experts (quantized_expert_params) run as grouped matmuls over one dequantised stack of every expert of
    the layer: gpt-oss pins its gate_up and down stacks through a checkpointed layer's backward (gpt_oss.py
    _forward_grouped_bnb4bit, l. 920-1000; moe_utils.py _moe_recompute_default, l. 412-447), Qwen3-MoE rebuilds
    them one at a time (moe_utils_bnb4bit.py forward_moe_backend_bnb4bit, l. 128-195). Counted as one layer's
    experts, both stacks: exact for gpt-oss, a third over for Qwen3-MoE, and over for gpt-oss where it loops over
    its experts instead: with LoRA on them, or without torch._grouped_mm (T4; torch 2.8 below Hopper) (l. 1018-1023;
    read from the source, not traced)."""
    if not quantized_expert_params(spec, settings, runtime):
        return 0
    return spec.expert_params


def optimizer_step_temp_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Unfused (foreach) AdamW materialises sqrt(v) for every parameter it steps at once: the GPU's shard of
    them under ZeRO/FSDP."""
    if runtime.fused_optimizer or settings.optimizer != "adamw":
        return 0.0
    if on_host(settings)[2]:
        return 0.0  # the step runs on the CPU
    return trainable_params(spec, settings) * trainable_dtype_bytes(settings, runtime) * shard_factors(settings)[2]


# --- several GPUs -------------------------------------------------------------------------------------------
def world_size(settings: Settings) -> int:
    """Every GPU of the run: n_gpus on each of the nodes."""
    return settings.n_gpus * settings.nodes


def shard_factors(settings: Settings) -> tuple[float, float, float]:
    """Fraction of (weights, gradients, optimizer states) each GPU holds, over all n_gpus x nodes GPUs.

    ZeRO (Rajbhandari et al. 2020, section 5): stage 2 partitions gradients and optimizer states, stage 3 the
    parameters too; FSDP's full shard is stage 3. DDP keeps everything on every GPU."""
    n = world_size(settings)
    if settings.shard in ("zero3", "fsdp"):
        return 1 / n, 1 / n, 1 / n
    if settings.shard == "zero2":
        return 1.0, 1 / n, 1 / n
    return 1.0, 1.0, 1.0


def offload_of(settings: Settings) -> str:
    """What the engine keeps in host memory. DeepSpeed has both offloads (offload_optimizer: gradients,
    optimizer states and the optimizer step, ZeRO-Offload; offload_param: the parameter partitions too). FSDP
    has only CPUOffload(offload_params=True), which moves parameters, gradients and the step: what `lorafit
    train` writes for either setting (train/distributed.py), so it is estimated as `params`."""
    if settings.offload != "none" and settings.shard == "fsdp":
        return "params"
    return settings.offload


def on_host(settings: Settings) -> tuple[bool, bool, bool]:
    """Whether (weights, gradients, optimizer states) live in host memory instead of on the GPU."""
    offload = offload_of(settings)
    return offload == "params", offload != "none", offload != "none"


def quant_state_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """The 4-bit weights' quantisation state (absmax, nested absmax): an attribute of bitsandbytes' Params4bit,
    not a parameter, so ZeRO-3 and FSDP neither shard it nor offload it; every GPU keeps all of it."""
    if settings.quant != "nf4":
        return 0.0
    linear = packed_params(spec, settings, runtime)
    if runtime.quantized_head:
        linear += spec.lm_head_params
    return quantized_weight_bytes(linear, settings) - 0.5 * linear


def sharded_weight_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """The base weights one GPU holds: its shard of the parameters (none when they are offloaded) and, for a
    4-bit base under ZeRO-3/FSDP, the whole quantisation state (quant_state_bytes)."""
    total = weights_bytes(spec, settings, runtime)
    w_share = shard_factors(settings)[0]
    if w_share == 1.0 and not on_host(settings)[0]:
        return total
    state = quant_state_bytes(spec, settings, runtime)
    return (0.0 if on_host(settings)[0] else (total - state) * w_share) + state


def gathered_param_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Bytes of every parameter as ZeRO-3/FSDP all-gather them: the packed 4-bit weights (0.5 byte a weight,
    stored as the compute dtype), the rest in its dtype, the adapters in theirs. The volume `Psi` of the
    communication model."""
    base = weights_bytes(spec, settings, runtime) - quant_state_bytes(spec, settings, runtime)
    return base + adapter_bytes(spec, settings, runtime)


def gathered_layer_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """ZeRO-3/FSDP gather a full layer (and prefetch the next) before using it: two layers in flight, in the
    dtype they are stored in (packed 4-bit linears: 0.5 byte a weight; the quantisation state is on every GPU
    already)."""
    if settings.shard not in ("zero3", "fsdp"):
        return 0.0
    c = DTYPE_BYTES[settings.precision]
    linear_bytes = 0.5 if settings.quant == "nf4" else c
    return 2 * (spec.layer_linear_params * linear_bytes + spec.layer_other_params * c)


# The reduce bucket lorafit's deepspeed.json sets (zero_optimization.reduce_bucket_size, in elements): a tenth of
# DeepSpeed's default 5e8, whose buffers alone would take 4 GB of a GPU for fp32 adapters under ZeRO-2. torch DDP
# copies the gradients into its buckets (gradient_as_bucket_view is False under the HF Trainer).
DEEPSPEED_BUCKET_ELEMENTS = 50_000_000


def communication_buffer_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Gradient buffers of the collective itself, per GPU, beside NCCL's own (Runtime.nccl_gib): DDP's buckets
    hold a second copy of every gradient; DeepSpeed allocates its reduce buckets whole, whatever the model's
    size: ZeRO-2 two of them with overlap_comm (stage_1_and_2.py, the double buffer of each ipg bucket), ZeRO-3
    one (stage3.py, the ipg bucket's buffer); FSDP reduce-scatters each layer's gradients as they come (in
    gathered_layer_bytes)."""
    if world_size(settings) == 1 and settings.offload == "none":
        return 0.0
    grad = trainable_dtype_bytes(settings, runtime)
    n = trainable_params(spec, settings)
    if settings.shard in ("none", "ddp"):
        return n * grad
    if settings.shard in ("zero2", "zero3"):
        return (2 if settings.shard == "zero2" else 1) * DEEPSPEED_BUCKET_ELEMENTS * grad
    return 0.0


# --- host memory --------------------------------------------------------------------------------------------
# DeepSpeed's CPU Adam (and torch's AdamW on FSDP's host shards) keeps, per trainable parameter it steps: an fp32
# master copy, the fp32 gradient and two fp32 moments (ZeRO-Offload, Ren et al. 2021, section 4.1: 16 bytes).
HOST_OPTIMIZER_BYTES_PER_PARAM = 16
# What one training process holds in host memory before any weight: the CUDA runtime and kernel images mapped
# in, torch, transformers, peft, the tokenizer and the data loader. A chosen round figure, not measured by this
# project on CUDA (a CPU process importing the same libraries holds about 1 GiB; the CUDA libraries add more).
PROCESS_HOST_BYTES = 3 * GIB
# transformers' save_pretrained writes checkpoints in files of at most 5 GB (max_shard_size); a quantised load
# reads one file at a time into host memory and quantises it on the GPU.
CHECKPOINT_FILE_BYTES = 5e9


def processes_per_node(settings: Settings) -> int:
    return settings.n_gpus


def loading_bytes_per_process(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Host memory a process needs to load the model, as `lorafit train` loads it (train/recipe.py): a 4/8-bit
    base goes straight to the process's GPU, one checkpoint file at a time, unless it is loaded in host memory
    for the shard (host_loads_the_base: then the whole packed base and the file being quantised); a 16-bit one
    is built in host memory first, whole, in the compute dtype, and only then moved to the GPU or sharded.
    Every process of a node loads its own copy: the loading peak that stops many multi-GPU runs before their
    first step."""
    if settings.quant == "none":
        return spec.num_params * DTYPE_BYTES[settings.precision]
    one_file = min(CHECKPOINT_FILE_BYTES, spec.num_params * DTYPE_BYTES[settings.precision])
    if host_loads_the_base(settings, runtime):
        return weights_bytes(spec, settings, runtime) + one_file
    return one_file


def offloaded_state_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> dict[str, float]:
    """Per process, what the offload keeps in host memory: its shard of the parameters (offload params) and,
    for either offload, its shard of the optimizer's fp32 state (HOST_OPTIMIZER_BYTES_PER_PARAM)."""
    weights_host, _, optimizer_host = on_host(settings)
    w_share, _, o_share = shard_factors(settings)
    parts = {}
    if weights_host:
        parts["offloaded_weights"] = gathered_param_bytes(spec, settings, runtime) * w_share
    if optimizer_host:
        states = 0 if settings.optimizer == "sgd" else HOST_OPTIMIZER_BYTES_PER_PARAM
        parts["offloaded_optimizer"] = trainable_params(spec, settings) * states * o_share
    return parts


def shards_a_quantized_base(settings: Settings) -> bool:
    """A 4/8-bit base that ZeRO-3/FSDP shard over several GPUs: where how it is loaded matters."""
    return settings.quant != "none" and settings.shard in ("zero3", "fsdp") and world_size(settings) > 1


def host_loads_the_base(settings: Settings, runtime: Runtime) -> bool:
    """A sharded quantised base loaded in host memory by every process, and moved to its GPU one sharded layer
    at a time by the engine (FSDP2's fully_shard), rather than whole onto every GPU first. `lorafit train`
    loads it so where the plan says so (train/recipe.py `_load_model`)."""
    return shards_a_quantized_base(settings) and settings.shard not in runtime.quantized_whole_on_gpu


def gpu_loading_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """A 4/8-bit base that ZeRO-3/FSDP shard and that is loaded whole onto every process's GPU first
    (Runtime.quantized_whole_on_gpu) is only sharded after that: for a moment each GPU holds all of it. 0 where
    it is loaded in host memory (one layer at a time reaches the GPU) or the step keeps the whole base anyway."""
    on_gpu = shards_a_quantized_base(settings) and not host_loads_the_base(settings, runtime)
    return weights_bytes(spec, settings, runtime) if on_gpu else 0.0


def host_ram_parts(spec: ModelSpec, settings: Settings, runtime: Runtime) -> dict[str, float]:
    """Host RAM one machine needs, in bytes, as the larger of its two peaks: loading (every process its copy,
    loading_bytes_per_process) and training (every process's runtime, its offloaded states, and the pinned
    activations and embeddings of the savers)."""
    processes = processes_per_node(settings)
    offloaded = offloaded_state_bytes(spec, settings, runtime)
    savers = host_saver_bytes(spec, settings, runtime)
    training: dict[str, float] = {"processes": processes * PROCESS_HOST_BYTES}
    training |= {name: processes * value for name, value in offloaded.items()}
    if savers:
        training["offloaded_savers"] = processes * savers
    loading: dict[str, float] = {
        "processes": processes * PROCESS_HOST_BYTES,
        "model_loading": processes * loading_bytes_per_process(spec, settings, runtime),
    }
    return training if sum(training.values()) >= sum(loading.values()) else loading


# --- device side --------------------------------------------------------------------------------------------
class ReserveFit(NamedTuple):
    """reserved - allocated = transient_share x transient + allocated_share x allocated + fixed_bytes."""

    transient_share: float
    allocated_share: float
    fixed_bytes: float


# Fitted by `make bench-allocator` (bench/allocator_fit.py --quick, bench/results/allocator-fit.json) to the
# simulated caching allocator (trace.allocator) over full-depth traces of 72 steps: Llama-2-7B, Llama-3.1-8B,
# Mistral-7B, Qwen2.5-7B x QLoRA/LoRA/full x 1x512, 2x2048, 4x4096 tokens x checkpointing on/off. No measured
# row was used. Error against the simulated reserved: plain mean 3.0 %, worst 11.0 %; expandable mean 1.3 %,
# worst 9.6 % (the worst are checkpointed steps with a small allocated peak and large logits: how much of the
# loss's blocks the recomputed layers reuse depends on their exact sizes, which no closed form in these terms
# follows). `--exact` uses the simulation itself, not this fit.
RESERVE_FIT = ReserveFit(transient_share=0.28, allocated_share=0.0175, fixed_bytes=0.52 * GIB)
# expandable_segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): one growing segment per pool mapped in
# 2 MiB / 20 MiB pages, so a free tail serves any size; the holes inside it remain. Fitted without a fixed term
# (with one it comes out at -0.12 GiB and fits no better).
EXPANDABLE_RESERVE_FIT = ReserveFit(transient_share=0.21, allocated_share=0.015, fixed_bytes=0.0)
# The growth of the reserve with the allocated peak, which `--exact` adds to its depth-3 simulation
# (trace.api.trace_depth)
RESERVED_ALLOCATED_SHARE = RESERVE_FIT.allocated_share
# What a real run strands that the simulation of two same-shaped steps cannot: blocks cut for the shapes of
# other steps (dynamic padding changes the sequence length every step) and what loading the model leaves
# cached. The one constant of the reserve set from measurements: the median residual of the reserved fit rows
# TTD-01..04 of bench/calibration (Llama-2-7B LoRA under torchtune, dynamic padding, max_memory_reserved) over
# allocated + the simulated reserve, 0.46-0.67 GB. None with expandable segments: a freed range there serves a
# request of any shape, so other steps' shapes strand nothing; the one published comparison, torchtune issue
# #1185 (Llama-3-8B QLoRA, dynamic padding, A100: max_memory_reserved 16.39 GiB without, 10.83 GiB with), shows
# the run-level reserve gone and more; not measured by this project.
UNSIMULATED_RESERVE_BYTES = 0.54 * GIB


def unsimulated_reserve_bytes(settings: Settings | None) -> float:
    """UNSIMULATED_RESERVE_BYTES, none with expandable segments."""
    return 0.0 if settings is not None and settings.expandable_segments else UNSIMULATED_RESERVE_BYTES


def transient_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime, gpu_bytes: float | None = None) -> float:
    """The step's largest short-lived excursion, what `reserved_bytes` is fed: the fp32 logits and their
    gradients, the recomputed layer or the unfused optimizer step's temporaries, whichever is largest, plus the
    dequantised weight."""
    return max(
        logits_bytes(spec, settings, runtime, gpu_bytes),
        recompute_bytes(spec, settings, runtime) if settings.grad_ckpt else 0.0,
        optimizer_step_temp_bytes(spec, settings, runtime),
    ) + dequant_bytes(spec, settings, runtime)


def reserved_bytes(allocated: float, transient: float, settings: Settings | None = None) -> float:
    """memory_reserved() at the peak: the allocated peak plus what the caching allocator holds cached on top.

    PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp; simulated block by block in
    trace.allocator) rounds requests to 512 B, packs requests of up to 1 MiB into 2 MiB segments and 1-10 MiB
    ones into 20 MiB segments, gives larger ones a segment of their own rounded to 2 MiB, serves a request from
    the smallest cached block that fits, and never gives a segment back during training. So the blocks of the
    large transients (the fp32 logits and their gradients, the recomputed layer, the dequantised weight) stay
    cached after their phase and serve the other phases' sizes only in part, and every layer's saved tensors
    leave slivers where they did not fill a freed block exactly. The reserve on top of the allocated peak is
    `transient_share x transient + allocated_share x allocated + fixed` (RESERVE_FIT, EXPANDABLE_RESERVE_FIT
    with expandable_segments), fitted to the simulation of full-depth traces, not to measured rows.

    What the simulation does not see, shapes that change from step to step (dynamic padding) and the blocks
    loading the model leaves cached, is one measured constant on top (UNSIMULATED_RESERVE_BYTES). `make
    bench-memory` states the reserved and nvidia-smi errors against measured rows apart from the allocated ones.
    """
    expandable = settings is not None and settings.expandable_segments
    fit = EXPANDABLE_RESERVE_FIT if expandable else RESERVE_FIT
    reserve = fit.transient_share * transient + fit.allocated_share * allocated + fit.fixed_bytes
    return allocated + max(reserve, 0.0) + unsimulated_reserve_bytes(settings)


def device_bytes(reserved: float, settings: Settings, runtime: Runtime, paged_state: float) -> float:
    """nvidia-smi: reserved memory + CUDA context (+ NCCL) + managed memory of paged optimizers when resident.

    The context is what a process holds outside the allocator: the CUDA context itself and the kernel images
    loaded on first use (cuBLAS's workspaces, 8 MiB per handle and stream, come from the caching allocator:
    torch's getNewWorkspace, so they are inside reserved). 0.9 GiB: the FMS fit rows of bench/calibration (A100
    80GB, torch 2.4, HF Trainer, flash-attn; nvidia-smi and max_memory_allocated of the same run) leave 1.88 GiB
    of nvidia-smi above allocated + 0.36 x transient, of which ~0.9 GiB was taken for a fixed stranded reserve
    (the reserve model before reserved_bytes was fitted to the allocator simulation; the context was kept).
    Training on several GPUs adds NCCL's buffers and the pools the collective streams keep: 1.2 GiB per GPU on
    FMS-05 (LoRA, FSDP over 2 A100s); runs sharding larger layers leave more (FMS-09 4.2 GiB, FMS-02 6.7 GiB:
    gathered layers and unsharded gradients cached in those streams' pools, which this figure does not scale
    with)."""
    extra = runtime.cuda_context_gib * GIB + (runtime.nccl_gib * GIB if world_size(settings) > 1 else 0)
    return reserved + extra + paged_state


# --- the sum ------------------------------------------------------------------------------------------------
def breakdown(
    spec: ModelSpec, settings: Settings, runtime: Runtime = Runtime(), gpu_bytes: float | None = None
) -> tuple[dict[str, float], str]:
    """Bytes per GPU of each part alive at the peak, and which phase the peak is in; `gpu_bytes`, the GPU's
    memory, where a loss sizes its chunks by what is free (Unsloth's)."""
    w_share, g_share, o_share = shard_factors(settings)
    weights_host, grads_host, optimizer_host = on_host(settings)  # offloaded: in host RAM, not on the GPU
    g_share, o_share = (0.0 if grads_host else g_share), (0.0 if optimizer_host else o_share)
    weights = sharded_weight_bytes(spec, settings, runtime)
    adapters = 0.0 if weights_host else adapter_bytes(spec, settings, runtime) * w_share
    gradients = gradient_bytes(spec, settings, runtime) * g_share
    optimizer = optimizer_bytes(spec, settings, runtime) * o_share
    # Paged state lives in managed memory: not in torch's allocated/reserved figures.
    optimizer_counted = 0.0 if paged(settings) else optimizer
    layer_activations = activation_bytes(spec, settings, runtime)
    activations = layer_activations + head_saved_bytes(spec, settings, runtime)
    gathered = gathered_layer_bytes(spec, settings, runtime)
    buffers = communication_buffer_bytes(spec, settings, runtime)
    static = weights + adapters + optimizer_counted + gathered + buffers

    # Gradients exist during the forward pass only from the second micro-batch of an accumulation on.
    grads_in_forward = gradients if settings.grad_accum > 1 else 0.0
    loss = logits_bytes(spec, settings, runtime, gpu_bytes)
    layer_backward = (
        recompute_bytes(spec, settings, runtime) if settings.grad_ckpt else grad_buffer_bytes(spec, settings, runtime)
    )
    dequant = dequant_bytes(spec, settings, runtime)
    # Backward frees each layer's saved tensors as it produces that layer's gradients, so its peak is at one of
    # the two ends: the last layer (every activation alive, only the head's gradients new) or the first layer
    # (every layer's gradient alive, one layer's activations left). Embedding gradients come after that.
    grads_in_layers = gradients - (embedding_grad_bytes(spec, settings, runtime) * g_share)
    grads_at_top = gradients if settings.grad_accum > 1 else head_grad_bytes(spec, settings, runtime) * g_share
    # (checkpointed: the first layer's recomputed tensors are in layer_backward already)
    first_layer = (
        0.0
        if settings.grad_ckpt
        else activation_bytes_per_layer(
            spec, settings, runtime, input_requires_grad=first_layer_input_requires_grad(settings, runtime)
        )
    )
    if not settings.grad_ckpt and keeps_bnb_inputs(settings, runtime):
        # old bitsandbytes' ctx attributes outlive each layer's backward: the other layers' inputs are still held
        own = bnb_input_bytes_per_token(spec, settings, input_requires_grad=False) * settings.tokens_per_micro_batch
        first_layer += bnb_held_bytes(spec, settings, runtime) - own
    phases = {
        "loss (LM head backward)": (static + grads_in_forward + activations + loss, grads_in_forward, activations),
        # by the last layer's backward the final norm has freed what it saved
        "backward through the last layers": (
            static + grads_at_top + layer_activations + layer_backward + dequant,
            grads_at_top,
            layer_activations,
        ),
        "backward through the first layer": (
            static + grads_in_layers + first_layer + layer_backward + dequant,
            grads_in_layers,
            first_layer,
        ),
        "optimizer step": (static + gradients + optimizer_step_temp_bytes(spec, settings, runtime), gradients, 0.0),
    }
    previous = previous_step_bytes(spec, settings, runtime)
    head_forward = head_forward_bytes(spec, settings, runtime)
    if runtime.loss == "chunked_compute":
        # the chunked head's forward, with the last micro-batch's logits (and graph) still held by the loop
        phases["forward through the LM head"] = (
            static + grads_in_forward + activations + previous + head_forward,
            grads_in_forward,
            activations,
        )
    phase = max(phases, key=lambda name: phases[name][0])
    _, grads_now, activations_now = phases[phase]
    backward_now = layer_backward if phase.startswith("backward") else 0.0
    transient = optimizer_step_temp_bytes(spec, settings, runtime)
    parts = {
        "weights": weights,
        "lora_adapters": adapters,
        "gradients": grads_now,
        "optimizer_states": optimizer_counted,
        "activations": activations_now,
        "logits_and_loss": loss if phase.startswith("loss") else head_forward if phase.startswith("forward") else 0.0,
        "previous_micro_batch": previous if phase.startswith("forward") else 0.0,
        "layer_backward": backward_now,
        "dequant_buffer": dequant if phase.startswith("backward") else 0.0,
        "optimizer_step_temp": transient if phase.startswith("optimizer") else 0.0,
        "sharded_gather": gathered,
        "communication_buffers": buffers,
    }
    return parts, phase


def estimate(
    spec: ModelSpec,
    settings: Settings,
    gpu: GpuSpec | None = None,
    headroom: float = DEFAULT_HEADROOM,
    runtime: Runtime | None = None,
) -> Estimate:
    """Peak allocated, reserved and device memory of one training step, per GPU, under the settings' stack
    (or `runtime`, where a caller describes a step itself)."""
    runtime = runtime or stack_runtime(settings)
    gpu_bytes = gpu.memory_gib * GIB if gpu else None
    parts, phase = breakdown(spec, settings, runtime, gpu_bytes)
    transient = transient_bytes(spec, settings, runtime, gpu_bytes)
    paged_state = optimizer_bytes(spec, settings, runtime) * shard_factors(settings)[2] if paged(settings) else 0.0
    return assemble(
        parts,
        phase,
        transient,
        paged_state,
        settings,
        runtime,
        gpu,
        headroom,
        trainable=trainable_params(spec, settings),
        total=spec.num_params,
        host_ram=host_ram_parts(spec, settings, runtime),
        loading_bytes=gpu_loading_bytes(spec, settings, runtime),
    )


# The per-GPU view of a multi-GPU step (Estimate.per_gpu_gib): which breakdown parts make up each figure.
PER_GPU_PARTS = {
    "sharded_weights": ("weights", "lora_adapters"),
    "gradients": ("gradients",),
    "optimizer_states": ("optimizer_states", "optimizer_step_temp"),
    "gathered_layers": ("sharded_gather",),
    "activations": (
        "activations",
        "logits_and_loss",
        "previous_micro_batch",
        "layer_backward",
        "dequant_buffer",
    ),
    "communication_buffers": ("communication_buffers",),
}


def per_gpu_figures(parts: dict[str, float], settings: Settings, runtime: Runtime, paged_state: float) -> dict:
    """The breakdown regrouped as the multi-GPU question asks it, in bytes: the GPU's shard of the weights, its
    gradients and optimizer states, the layers gathered in flight, the activations, the communication buffers
    (lorafit's and NCCL's, Runtime.nccl_gib)."""
    figures = {name: sum(parts.get(part, 0.0) for part in names) for name, names in PER_GPU_PARTS.items()}
    figures["optimizer_states"] += paged_state
    if world_size(settings) > 1:
        figures["communication_buffers"] += runtime.nccl_gib * GIB
    return figures


def assemble(
    parts: dict[str, float],
    phase: str,
    transient_bytes: float,
    paged_state_bytes: float,
    settings: Settings,
    runtime: Runtime,
    gpu: GpuSpec | None,
    headroom: float,
    *,
    trainable: int,
    total: int,
    host_ram: dict[str, float] | None = None,
    simulated_reserved: float | None = None,
    loading_bytes: float = 0.0,
) -> Estimate:
    """An Estimate from the allocated peak's parts (bytes): the device side and the verdict added the same way
    for the analytic estimate and the `--exact` trace; `host_ram`: the host RAM parts one machine needs;
    `simulated_reserved`: the `--exact` trace's caching allocator simulation, in place of `reserved_bytes`."""
    allocated = sum(parts.values())
    reserved, device = device_side(
        allocated, transient_bytes, settings, runtime, paged_state_bytes, reserved=simulated_reserved
    )
    breakdown_gib = {name: round(gib(value), 4) for name, value in parts.items() if value > 0}
    breakdown_gib["allocator_reserve"] = round(gib(reserved - allocated), 4)
    breakdown_gib["cuda_context"] = round(gib(device - reserved - paged_state_bytes), 4)
    if paged_state_bytes:
        breakdown_gib["paged_optimizer_states"] = round(gib(paged_state_bytes), 4)
    # loading: the whole base on the GPU before it is sharded, with the CUDA context (gpu_loading_bytes)
    loading = loading_bytes + runtime.cuda_context_gib * GIB if loading_bytes else None
    usable = gpu.usable_gib(headroom) if gpu else None
    return Estimate(
        peak_allocated_gib=round(gib(allocated), 4),
        peak_reserved_gib=round(gib(reserved), 4),
        peak_device_gib=round(gib(device), 4),
        breakdown_gib=breakdown_gib,
        peak_phase=phase,
        gpu_memory_gib=gpu.memory_gib * gpu.usable_fraction if gpu else None,
        headroom=headroom,
        fits=None if usable is None else gib(max(device, loading or 0.0)) <= usable,
        trainable_params=trainable,
        total_params=total,
        world_size=world_size(settings),
        per_gpu_gib={
            name: round(gib(value), 4)
            for name, value in per_gpu_figures(parts, settings, runtime, paged_state_bytes).items()
        },
        host_ram_gib=None if host_ram is None else round(gib(sum(host_ram.values())), 4),
        host_ram_breakdown_gib={name: round(gib(value), 4) for name, value in (host_ram or {}).items()},
        loading_peak_gib=None if loading is None else round(gib(loading), 4),
    )


def device_side(
    allocated_bytes: float,
    transient_bytes: float,
    settings: Settings,
    runtime: Runtime = Runtime(),
    paged_state_bytes: float = 0.0,
    reserved: float | None = None,
) -> tuple[float, float]:
    """(reserved, device) bytes for an allocated peak: the same device-side model for the analytic estimate
    and the `--exact` trace (whose `reserved` comes from its allocator simulation; never below allocated)."""
    if reserved is None:
        reserved = reserved_bytes(allocated_bytes, transient_bytes, settings)
    else:  # the simulation's two same-shaped steps, plus what a run strands beyond them
        reserved = max(reserved, allocated_bytes) + unsimulated_reserve_bytes(settings)
    reserved = max(reserved, allocated_bytes)
    return reserved, device_bytes(reserved, settings, runtime, paged_state_bytes)
