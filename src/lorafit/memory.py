"""Analytic peak memory of one training step: one function per term, summed in `estimate()`.

Every term counts the tensors that the real code path (transformers + peft + bitsandbytes, as `train/build.py`
sets it up) keeps alive, derived op by op in docs/memory-model.md and checked against the live-tensor trace of
real steps (`lorafit estimate --exact`, tests/test_trace.py). Pure Python: no torch import, so planning is instant.

Notation (per micro-batch): N tokens (micro_batch x seq_len), L layers, h hidden, q = heads x head_dim,
kv = kv_heads x head_dim, I intermediate, V vocabulary, r LoRA rank, c bytes of the compute dtype.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

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


class Runtime(BaseModel):
    """How the framework runs the step. The defaults are lorafit's own trainer; the benchmark sets them to
    describe other stacks (torchtune's chunked loss, peft's fp32 upcast, ...)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # hf: fp32 copy of all logits; chunked: per-chunk fp32 upcast (torchtune); chunked_compute: the head runs in
    # chunks whose logits stay in the compute dtype through the loss (litgpt)
    loss: Literal["hf", "chunked", "chunked_compute"] = "hf"
    kbit_upcast: bool = False  # peft prepare_model_for_kbit_training: non-quantised params to fp32
    lora_dtype: Literal["fp32", "compute"] = "fp32"  # peft autocasts adapters to fp32 by default
    fused_optimizer: bool = True  # adamw_torch_fused: no param-sized temporaries in the step
    optimizer_in_backward: bool = False  # torchtune: step each param in backward, gradients never pile up
    activation_offload: bool = False  # checkpointed layer inputs live in host memory
    amp_master_fp32: bool = False  # fp32 master weights with a bf16/fp16 autocast copy
    device: Literal["cuda", "cpu"] = "cuda"  # CPU dropout keeps a float mask where CUDA keeps a bool one
    # the HF Trainer with bf16/fp16 runs the forward under torch.autocast: peft's fp32 adapter matmuls then
    # save their inputs in the compute dtype
    autocast: bool = True
    # peft's kbit preparation followed by TRL's peft_module_casting_to_bf16 leaves the RMSNorm weights in fp32:
    # `weight * x.to(bf16)` then promotes every norm output, and with it the residual stream, to fp32
    fp32_norms: bool = False
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
    linear = spec.num_hidden_layers * spec.layer_linear_params
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


def trainable_dtype_bytes(settings: Settings, runtime: Runtime) -> int:
    """Adapters are fp32 (peft's autocast_adapter_dtype); full fine-tuning trains the weights' own dtype."""
    if settings.method == "full":
        return 4 if runtime.amp_master_fp32 else DTYPE_BYTES[settings.precision]
    return 4 if runtime.lora_dtype == "fp32" else DTYPE_BYTES[settings.precision]


def adapter_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    if settings.method == "full":
        return 0.0
    return trainable_params(spec, settings) * trainable_dtype_bytes(settings, runtime)


def gradient_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """One gradient per trainable parameter, in its dtype. Fusing the step into backward keeps only about one
    layer's gradients alive at a time."""
    grads = trainable_params(spec, settings) * trainable_dtype_bytes(settings, runtime)
    if runtime.optimizer_in_backward:
        return grads / spec.num_hidden_layers
    return grads


def head_grad_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Gradients of the LM head and final norm, the first ones full fine-tuning produces."""
    if settings.method != "full" or runtime.optimizer_in_backward:
        return 0.0
    return (spec.lm_head_params + spec.hidden_size) * trainable_dtype_bytes(settings, runtime)


def embedding_grad_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    if settings.method != "full" or runtime.optimizer_in_backward:
        return 0.0
    return spec.embedding_params * trainable_dtype_bytes(settings, runtime)


def optimizer_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """AdamW keeps two moments per trainable parameter in the parameter's dtype (torch) or 8-bit blockwise
    (bitsandbytes, with 32-bit state for tensors under 4096 elements); SGD without momentum keeps none."""
    n = trainable_params(spec, settings)
    if settings.optimizer == "sgd":
        return 0.0
    if settings.optimizer in ("adamw", "paged_adamw_32bit"):
        return 2 * n * trainable_dtype_bytes(settings, runtime)
    small = _params_in_small_tensors(spec, settings)
    return 2 * (n - small) * (1 + 4 / BNB_8BIT_BLOCK) + 2 * small * 4


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
    h, q, kv, inter = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    heads = spec.num_attention_heads
    full = settings.method == "full"
    lora_names = set() if full else set(spec.lora_target_names(settings.lora_targets))

    def norm() -> float:
        if not input_requires_grad and not full:
            return 0.0
        return 4 * h + 4 + (2 * h if full else 0)

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
    # eager (and litgpt always) repeats k/v to every head before the attention
    kv_saved = q if settings.attn == "eager" or runtime.fused_qkv else kv
    # litgpt without head groups: v is a view of the fused qkv output, which it keeps alive whole
    v_saved = c * (q + 2 * kv) if runtime.fused_qkv and heads == spec.num_key_value_heads else c * kv_saved
    if settings.attn == "eager":
        # q and k for QK^T, fp32 softmax output, its bf16 cast for the AV matmul, v for the AV matmul; Gemma-2's
        # soft-capping (tanh(scores / cap) x cap) also keeps the tanh output
        scores = (4 + c + (c if spec.logit_softcapping else 0)) * heads * settings.seq_len
        attention = c * (q + kv_saved) + scores + v_saved
    else:
        attention = c * (q + kv_saved) + v_saved + c * q + 4 * heads
    if spec.architecture == "phi3" and not runtime.fused_qkv:
        # Phi-3's fused qkv_proj: v is a view of that output, so the saved v keeps all q + 2 kv columns alive
        attention += c * (q + kv)
    mlp = {name: dims for name, dims in spec.mlp_linears().items() if name != "down_proj"}
    down = {"down_proj": spec.mlp_linears()["down_proj"]}
    experts = max(spec.num_experts_per_tok, 1) if spec.is_moe else 1
    gated = 3 * c * inter  # silu saves gate; the product saves silu(gate) and up
    parts = {
        "attn_norm": norm(),
        "qkv_inputs": fused_qkv_lora_bytes(qkv, lora_names, settings, runtime, input_requires_grad)
        if runtime.fused_qkv and not full
        else linear_inputs(qkv, shared_input=True),
        "attention": attention,
        # sdpa/flash return their output laid out as (batch, seq, heads, head_dim): the o_proj input is a view of
        # the output attention already saved, so a trainable o_proj saves nothing new
        "o_proj_input": 0.0 if full and settings.attn != "eager" else linear_inputs_grad(out_proj, False),
        "mlp_norm": 4 * h + 4 + (2 * h if full else 0),  # the residual stream requires grad past attention
        "mlp_inputs": experts * linear_inputs_grad(mlp, shared_input=True),
        "gated_act": experts * gated,
        "down_input": experts * linear_inputs_grad(down, shared_input=False),
    }
    if spec.architecture in ("gemma2", "gemma3"):
        # Gemma-2 and Gemma 3 normalise the attention and MLP outputs too, before adding them to the residual stream
        parts["post_norms"] = 2 * (4 * h + 4 + (2 * h if full else 0))
    if spec.architecture == "gemma3":
        # Gemma 3 RMS-normalises each query and key head before RoPE: like the layer norms, each saves its fp32
        # input and one rsqrt per head (and, in full fine-tuning, its normalised input for the weight's gradient)
        kv_heads = spec.num_key_value_heads
        parts["qk_norms"] = 4 * (q + kv) + 4 * (heads + kv_heads) + (c * (q + kv) if full else 0)
    if keeps_bnb_inputs(settings, runtime):
        parts["bnb_inputs"] = bnb_input_bytes_per_token(spec, settings, input_requires_grad)
    return parts


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
    h, q, inter = spec.hidden_size, spec.q_size, spec.intermediate_size
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
    return sum(parts.values()) * settings.tokens_per_micro_batch


def checkpoint_bytes_per_layer(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Under checkpointing a layer keeps only its input hidden state (c x h per token, fp32 when fp32 norm
    weights promoted the residual stream) until backward."""
    if runtime.activation_offload:
        return 0.0
    width = 4 if runtime.fp32_norms else DTYPE_BYTES[settings.precision]
    return width * spec.hidden_size * settings.tokens_per_micro_batch


def checkpointed_layers_on_gpu(spec: ModelSpec, settings: Settings) -> int:
    """Layers whose checkpointed input is on the GPU at the end of the forward pass: all of them, or with
    offload_activations (save_on_cpu around the forward) the one or two in flight to or from host memory."""
    if settings.offload_activations and settings.grad_ckpt:
        return min(spec.num_hidden_layers, OFFLOAD_LAYERS_ON_GPU)
    return spec.num_hidden_layers


def offloaded_activation_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime = Runtime()) -> float:
    """Pinned host memory offload_activations holds: every layer's checkpointed input (N x h x c each), copied
    out in forward and back in backward."""
    if not (settings.offload_activations and settings.grad_ckpt):
        return 0.0
    width = 4 if runtime.fp32_norms else DTYPE_BYTES[settings.precision]
    return spec.num_hidden_layers * width * spec.hidden_size * settings.tokens_per_micro_batch


# The share of the free host RAM the offloading savers may fill: the data loader, the tokenizer and pinned
# staging buffers need the rest.
HOST_RAM_SHARE = 0.8


def host_saver_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime = Runtime()) -> float:
    """Host memory the offloading savers hold during a step: the pinned activations and the embedding table."""
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
        return checkpointed_layers_on_gpu(spec, settings) * checkpoint_bytes_per_layer(spec, settings, runtime)
    first = activation_bytes_per_layer(spec, settings, runtime, input_requires_grad=settings.method == "full")
    rest = activation_bytes_per_layer(spec, settings, runtime)
    return first + (layers - 1) * rest


def head_saved_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """The final RMSNorm saves its fp32 input (and, training the head, the normalised bf16 input); a quantised
    head under old bitsandbytes keeps that normalised input too."""
    c = DTYPE_BYTES[settings.precision]
    per_token = 4 * spec.hidden_size + 4
    if settings.method == "full":
        per_token += 2 * c * spec.hidden_size
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


def logits_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Peak of the LM head and loss. transformers upcasts all logits to fp32 for the loss: in backward the
    saved log-softmax (4V), the gradient from nll_loss (4V) and the gradient it produces (4V) are alive
    together - 12 bytes x V per token, more than the whole model's activations for a 128k vocabulary.
    A chunked loss (torchtune, litgpt) keeps only the fp32 log-softmax of every chunk (4V) and one chunk's
    temporaries."""
    n, vocab = settings.tokens_per_micro_batch, spec.vocab_size
    if settings.loss == "chunked" and runtime.loss == "hf":
        return chunked_loss_bytes(spec, settings)
    if runtime.loss == "chunked":
        return 4 * vocab * n + 3 * 4 * vocab * min(n, 1024)
    if runtime.loss == "chunked_compute":
        # litgpt: the logits list and every chunk's log-softmax (compute dtype, no upcast); in backward one
        # chunk's gradient, then the gradient of its log-softmax or the head's dequantised weight
        c, chunk = DTYPE_BYTES[settings.precision], head_chunk_tokens(settings)
        backward_chunk = max(c * vocab * chunk, head_dequant_bytes(spec, settings, runtime))
        return 2 * c * vocab * n + c * vocab * chunk + backward_chunk
    # Gemma-2 soft-caps the logits (tanh(logits / 30) x 30) in the compute dtype: tanh keeps its output
    softcap = DTYPE_BYTES[settings.precision] * vocab * n if spec.logit_softcapping else 0
    return 12 * vocab * n + softcap


def loss_chunk_tokens(settings: Settings) -> int:
    return min(settings.tokens_per_micro_batch, LOSS_CHUNK_TOKENS)


def chunked_loss_bytes(spec: ModelSpec, settings: Settings) -> float:
    """lorafit's chunked loss (settings.loss "chunked"): the head and the fp32 cross-entropy run one chunk of
    LOSS_CHUNK_TOKENS tokens at a time and again in backward, so unlike torchtune's (Runtime.loss "chunked") no
    chunk's log-softmax is kept. In a chunk's backward its fp32 logits, the gradient from the loss and the
    gradient it produces are alive together (12 x V per token, as in the full loss but for one chunk), next to
    the gradient of the final hidden states that the chunks fill (N x h x c). Gemma-2's soft-capping keeps
    one chunk's tanh output as well."""
    c, chunk = DTYPE_BYTES[settings.precision], loss_chunk_tokens(settings)
    softcap = c * spec.vocab_size * chunk if spec.logit_softcapping else 0
    return 12 * spec.vocab_size * chunk + softcap + c * spec.hidden_size * settings.tokens_per_micro_batch


def grad_buffer_bytes(spec: ModelSpec, settings: Settings) -> float:
    """What backward through one layer holds besides its saved tensors: the gradients in flight (hidden-sized
    in the compute dtype; at the MLP the intermediate-sized gradient of down_proj's input, for LoRA also in the
    adapter's fp32). The coefficients are those of the traced backward of the real step
    (`python -m lorafit.trace.terms llama-2-7b --compare` and `qwen2.5-1.5b`, two shapes that separate the h
    and I terms): LoRA (4 + c) x I, full fine-tuning 2c x I + 8c x h, per token."""
    c = DTYPE_BYTES[settings.precision]
    h, inter = spec.hidden_size, spec.intermediate_size
    per_token = (4 + c) * inter if settings.method != "full" else 2 * c * inter + 8 * c * h
    return per_token * settings.tokens_per_micro_batch


def recompute_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Backward of a checkpointed layer: its saved tensors, recomputed, plus what the recomputation and the
    backward hold in flight. For LoRA that is more than without checkpointing (the recomputed forward's own
    temporaries overlap the first gradients): 5c x I + 4c x h per token in the same traces."""
    c = DTYPE_BYTES[settings.precision]
    if settings.method == "full":
        in_flight = grad_buffer_bytes(spec, settings)
    else:
        in_flight = (5 * c * spec.intermediate_size + 4 * c * spec.hidden_size) * settings.tokens_per_micro_batch
    return activation_bytes_per_layer(spec, settings, runtime) + in_flight


def dequant_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime = Runtime()) -> float:
    """bitsandbytes dequantises each 4/8-bit weight to the compute dtype for its matmul, one at a time."""
    if settings.quant == "none":
        return 0.0
    largest = max(fan_in * fan_out for _, fan_in, fan_out, _ in spec.layer_linears())
    return largest * DTYPE_BYTES[settings.precision] * runtime.dequant_copies


def optimizer_step_temp_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Unfused (foreach) AdamW materialises sqrt(v) for every parameter it steps at once: the GPU's shard of
    them under ZeRO/FSDP, one parameter at a time when the step runs inside backward."""
    if runtime.fused_optimizer or runtime.optimizer_in_backward or settings.optimizer != "adamw":
        return 0.0
    return trainable_params(spec, settings) * trainable_dtype_bytes(settings, runtime) * shard_factors(settings)[2]


# --- several GPUs -------------------------------------------------------------------------------------------
def shard_factors(settings: Settings) -> tuple[float, float, float]:
    """Fraction of (weights, gradients, optimizer states) each GPU holds."""
    n = settings.n_gpus
    if settings.shard in ("zero3", "fsdp"):
        return 1 / n, 1 / n, 1 / n
    if settings.shard == "zero2":
        return 1.0, 1 / n, 1 / n
    return 1.0, 1.0, 1.0


def gathered_layer_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """ZeRO-3/FSDP gathers a full layer (and prefetches the next) before using it."""
    if settings.shard not in ("zero3", "fsdp"):
        return 0.0
    layer = spec.layer_linear_params + spec.layer_other_params
    per_param = DTYPE_BYTES[settings.precision] if settings.quant == "none" else 0.5 + 1 / NF4_BLOCK
    return 2 * layer * per_param


# --- device side --------------------------------------------------------------------------------------------
RESERVED_TRANSIENT_SHARE = 0.36
STRANDED_BYTES = 0.9 * GIB
# expandable_segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): the allocator maps 2 MiB pages into one
# growing segment per stream instead of cutting separate segments, so a freed range can serve a request of any
# shape and the blocks stranded by one step's sizes mostly vanish. No run in shared/calibration used it, and we
# have no measurement of our own: the one published figure for a comparable step, torchtune issue #1185
# (Llama-3-8B QLoRA, torchtune's single-device recipe, A100 80GB, dynamic padding; 16.39 GiB peak without,
# 10.83 GiB with, at the same speed), cannot be split between the two parts of the reserve. The model is
# therefore conservative and unmeasured: the transient share stays at 0.36 and the stranded reserve falls from
# 0.9 GiB to 0.2 GiB, a margin for partly used pages that is chosen, not measured.
EXPANDABLE_STRANDED_BYTES = 0.2 * GIB


def reserved_bytes(allocated: float, transient: float, settings: Settings | None = None) -> float:
    """The caching allocator never gives memory back: it keeps every segment it has cut, and reuses a freed block
    only for a request that fits in it. Two parts of the step's reserve stay on top of the allocated peak:

    - a share of the big transients (fp32 logits and their gradients, the recomputed layer, dequantised weights):
      their blocks are freed between phases and split only partly for the other phase's sizes. The share is the
      slope of (nvidia-smi - allocated) against the transient between two runs that differ only in micro batch
      (FMS-03 and FMS-04 of shared/calibration: Mistral-7B LoRA, 4 vs 8 x 4096 tokens, +2.13 GiB for +5.86 GiB
      of logits): 0.36, an intercept-free measurement.
    - blocks stranded over a run: segments cut for one step's shapes that later requests cannot reuse (sequence
      lengths that vary with dynamic padding, dequantised weights interleaved with activations). About 0.9 GiB:
      the torchtune LoRA runs TTD-01..04 (Llama-2-7B, max_memory_reserved) sit 1.1-1.3 GiB above lorafit's
      allocated peak plus the transient share, ~0.3 GiB of which is torchtune's heavier loss path. The FMS runs
      fix the sum of this part and the CUDA context (device_bytes) at 1.88 GiB.
    `make bench-memory` prints each of those rows' error.

    With expandable_segments the stranded part is mostly gone (see EXPANDABLE_STRANDED_BYTES).
    """
    expandable = settings is not None and settings.expandable_segments
    stranded = EXPANDABLE_STRANDED_BYTES if expandable else STRANDED_BYTES
    return allocated + RESERVED_TRANSIENT_SHARE * transient + stranded


def device_bytes(reserved: float, settings: Settings, runtime: Runtime, paged_state: float) -> float:
    """nvidia-smi: reserved memory + CUDA context (+ NCCL) + managed memory of paged optimizers when resident.

    The context is what a process holds outside the allocator: the CUDA context itself, cuBLAS/cuDNN workspaces
    and the kernel images loaded on first use. 0.9 GiB: the FMS runs of shared/calibration (A100 80GB, torch 2.4,
    HF Trainer, flash-attn; nvidia-smi and max_memory_allocated of the same run) leave 1.88 GiB of nvidia-smi
    above allocated + 0.36 x transient, of which ~0.9 GiB is the stranded reserve (reserved_bytes). Training on
    several GPUs adds NCCL's buffers and the pools the collective streams keep: 1.2 GiB per GPU on FMS-05 (LoRA,
    FSDP over 2 A100s); runs sharding larger layers leave more (FMS-09 4.2 GiB, FMS-02 6.7 GiB: gathered layers
    and unsharded gradients cached in those streams' pools, which this figure does not scale with)."""
    extra = runtime.cuda_context_gib * GIB + (runtime.nccl_gib * GIB if settings.n_gpus > 1 else 0)
    return reserved + extra + paged_state


# --- the sum ------------------------------------------------------------------------------------------------
def breakdown(spec: ModelSpec, settings: Settings, runtime: Runtime = Runtime()) -> tuple[dict[str, float], str]:
    """Bytes per GPU of each part alive at the peak, and which phase the peak is in."""
    w_share, g_share, o_share = shard_factors(settings)
    weights = weights_bytes(spec, settings, runtime) * w_share
    adapters = adapter_bytes(spec, settings, runtime) * w_share
    gradients = gradient_bytes(spec, settings, runtime) * g_share
    optimizer = optimizer_bytes(spec, settings, runtime) * o_share
    # Paged state lives in managed memory: not in torch's allocated/reserved figures.
    optimizer_counted = 0.0 if paged(settings) else optimizer
    layer_activations = activation_bytes(spec, settings, runtime)
    activations = layer_activations + head_saved_bytes(spec, settings, runtime)
    gathered = gathered_layer_bytes(spec, settings, runtime)
    static = weights + adapters + optimizer_counted + gathered

    # Gradients exist during the forward pass only from the second micro-batch of an accumulation on.
    grads_in_forward = gradients if settings.grad_accum > 1 else 0.0
    loss = logits_bytes(spec, settings, runtime)
    layer_backward = (
        recompute_bytes(spec, settings, runtime) if settings.grad_ckpt else grad_buffer_bytes(spec, settings)
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
        else activation_bytes_per_layer(spec, settings, runtime, input_requires_grad=settings.method == "full")
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
    }
    return parts, phase


def estimate(
    spec: ModelSpec,
    settings: Settings,
    gpu: GpuSpec | None = None,
    headroom: float = DEFAULT_HEADROOM,
    runtime: Runtime = Runtime(),
) -> Estimate:
    """Peak allocated, reserved and device memory of one training step, per GPU."""
    parts, phase = breakdown(spec, settings, runtime)
    transient = max(
        logits_bytes(spec, settings, runtime),
        recompute_bytes(spec, settings, runtime) if settings.grad_ckpt else 0.0,
        optimizer_step_temp_bytes(spec, settings, runtime),
    ) + dequant_bytes(spec, settings, runtime)
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
    )


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
) -> Estimate:
    """An Estimate from the allocated peak's parts (bytes): the device side and the verdict added the same way
    for the analytic estimate and the `--exact` trace."""
    allocated = sum(parts.values())
    reserved, device = device_side(allocated, transient_bytes, settings, runtime, paged_state_bytes)
    breakdown_gib = {name: round(gib(value), 4) for name, value in parts.items() if value > 0}
    breakdown_gib["allocator_reserve"] = round(gib(reserved - allocated), 4)
    breakdown_gib["cuda_context"] = round(gib(device - reserved - paged_state_bytes), 4)
    if paged_state_bytes:
        breakdown_gib["paged_optimizer_states"] = round(gib(paged_state_bytes), 4)
    return Estimate(
        peak_allocated_gib=round(gib(allocated), 4),
        peak_reserved_gib=round(gib(reserved), 4),
        peak_device_gib=round(gib(device), 4),
        breakdown_gib=breakdown_gib,
        peak_phase=phase,
        gpu_memory_gib=gpu.memory_gib * gpu.usable_fraction if gpu else None,
        headroom=headroom,
        fits=None if gpu is None else gib(device) <= gpu.usable_gib(headroom),
        trainable_params=trainable,
        total_params=total,
    )


def device_side(
    allocated_bytes: float,
    transient_bytes: float,
    settings: Settings,
    runtime: Runtime = Runtime(),
    paged_state_bytes: float = 0.0,
) -> tuple[float, float]:
    """(reserved, device) bytes for an allocated peak: the same device-side model for the analytic estimate
    and the `--exact` trace."""
    reserved = reserved_bytes(allocated_bytes, transient_bytes, settings)
    return reserved, device_bytes(reserved, settings, runtime, paged_state_bytes)
