"""The time model: how long one optimizer step takes on a GPU, hence the run's throughput (its hours and cost:
lorafit.costs).

A micro-batch is the sum of its ops (micro_batch_time), each the slower of its FLOPs at the card's measured
matmul rate and its bytes at the card's memory bandwidth, plus a cost per kernel: the base matmuls, attention by
kernel, dequantising a 4/8-bit base, the LoRA paths, the bandwidth-bound norms, activations, rotary and
residuals, the loss, and the savers' host copies. A step is its micro-batches, what the engine cannot hide of its
collectives and offload copies, and the optimizer step. The planner (lorafit.plan) compares candidates by
`tokens_per_second`; `make bench-throughput` prints its predictions beside published runs. Pure Python, like the
memory model it sits beside.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lorafit import gemma4, memory
from lorafit.hardware import GpuSpec
from lorafit.linear_attention import chunk_flops_per_token, shared_expert_width_share
from lorafit.models import ModelSpec
from lorafit.schema import Settings
from lorafit.transfers import (
    COMM_OVERLAP,
    collective_bytes_per_second,
    communication_bytes,
    host_copy_seconds,
    offload_seconds,
    optimizer_traffic_bytes,
    paging_seconds,
)
from lorafit.units import DTYPE_BYTES

# --- what one GPU sustains ----------------------------------------------------------------------------------
# A card's matmul rate is its catalog `matmul_tflops` (a published PyTorch bf16 matmul measurement, source beside
# each figure in catalog/gpus.toml) as a share of its dense peak; a card without one reaches DEFAULT_MATMUL_SHARE
# of its peak. GeForce cards run above their spec's boost clock and measure 97-107 % of the catalog's fp32-
# accumulate figure (RTX 3090, 4060, 4060 Ti, 4070 Super, 4090 in gpus.toml); datacenter and workstation parts sit
# at 66-87 % (stas00/ml-engineering's MAMF table: A100 SXM 86.9 %, H100 SXM 80.3 %, B200 77.6 %), power-capped
# ones lower (L4 47 %, T4 37 %).
DEFAULT_MATMUL_SHARE = {"consumer": 1.0, "other": 0.8}
# Streaming kernels (copies, elementwise ops) reach about 85 % of the memory's spec rate: an L40S validation
# guide sets 83 % as its bar for a 40 GB copy (ai-hpc.github.io, "Benchmarks for L40S x12"), HBM parts reach
# ~90 % in copy benchmarks. A typical figure, not measured by this project.
BANDWIDTH_SHARE = 0.85
# FlashAttention-2 reaches 50-73 % of an A100's peak in its forward and less in backward (Dao 2023, "Flash-
# Attention-2", section 4.1); sdpa runs the same kernels on these GPUs. The share of the card's matmul rate the
# attention kernels run at, from the paper, not fitted.
ATTENTION_SHARE = 0.6
# Each kernel costs a few microseconds beyond its work (launch latency, the tail of a wave, the queue refilling):
# about 4 us a kernel, the order of the CUDA launch latency. A typical figure, not fitted; it matters only for
# micro-batches of a few hundred tokens.
KERNEL_SECONDS = 4e-6
# The share of the best-shape rate (matmul_tflops) a training step's matmuls reach: their shapes are not the
# best one, and a step's matmuls include the narrow ones (k and v projections under grouped-query attention).
# Fitted: the fit rows FMS-01/03/04 (Mistral-7B on an A100, full and LoRA in pure bf16 without autocast, 16-32k
# tokens a micro-batch) ask for 0.857, 0.897 and 0.905 once every other op of the step is counted; their median
# (`make bench-throughput` prints what each asks).
MATMUL_SHAPE_SHARE = 0.897
# bitsandbytes' 4-bit matmul: the bf16 matmul on a freshly dequantised weight (its traffic is dequant_seconds').
# The fit rows FMS-06/07 (TRL QLoRA with peft's kbit preparation, whose fp32 stream the elementwise, cast and
# LoRA terms count; FMS-03/04 the same runs over a 16-bit base) ask for 0.992 and 0.95 with the share above in
# place (`make bench-throughput`): no slowdown beyond that matmul, which is torch's own bf16 one, so 1 and no
# less. They asked for 1.316 while their fp32 stream was not counted, 1.029 / 0.986 before the LoRA path was.
QUANT_MATMUL_SLOWDOWN = 1.0


def achievable_matmul_flops(gpu: GpuSpec, precision: str) -> float:
    """FLOP/s a large matmul sustains in `precision`: the dense peak scaled by the card's measured share."""
    peak = gpu.tflops(precision)
    if gpu.matmul_tflops is not None:
        share = gpu.matmul_tflops / gpu.tflops("bf16" if gpu.supports_bf16 else "fp16")
    else:
        share = DEFAULT_MATMUL_SHARE["consumer" if gpu.kind == "consumer" else "other"]
    return peak * share * 1e12


def achievable_bytes_per_second(gpu: GpuSpec) -> float:
    """Bytes/s a streaming kernel moves: BANDWIDTH_SHARE of the memory's spec rate."""
    return gpu.bandwidth_gbs * 1e9 * BANDWIDTH_SHARE


def dequant_bytes_per_second(gpu: GpuSpec) -> float:
    """Bytes/s dequantising a 4/8-bit weight moves: the card's measured rate (a CPU card times bitsandbytes'
    CPU kernel, lorafit.hostcard), else the streaming rate."""
    return gpu.dequant_gbs * 1e9 if gpu.dequant_gbs is not None else achievable_bytes_per_second(gpu)


def quant_matmul_slowdown(gpu: GpuSpec) -> float:
    """A 4/8-bit base's matmuls over a resident weight's, beyond dequantising: the card's measured figure (a CPU
    card measures it), else QUANT_MATMUL_SLOWDOWN."""
    return gpu.quant_matmul_slowdown if gpu.quant_matmul_slowdown is not None else QUANT_MATMUL_SLOWDOWN


def roofline_seconds(flops: float, moved_bytes: float, flop_rate: float, byte_rate: float) -> float:
    """An op takes as long as the slower of its arithmetic and its memory traffic."""
    return max(flops / flop_rate, moved_bytes / byte_rate)


# --- how often the step runs each op ------------------------------------------------------------------------
def forward_passes(settings: Settings) -> int:
    """The forward runs once, and again in backward under checkpointing (the recomputation)."""
    return 2 if settings.grad_ckpt else 1


# The norms', activations', rotary's and residuals' backward moves about three times their forward's bytes: each
# op reads the upstream gradient and what it saved and writes its input's gradient, and autograd adds up the
# gradients that reach one tensor from several users (the base and LoRA paths, the residual). Traced: 3.09x the
# forward under (Q)LoRA, 2.93x for full fine-tuning (`make bench-time-trace`, Llama-3.1-8B).
ELEMENTWISE_BACKWARD_TRAFFIC = 3.0
# FlashAttention's backward runs five matmuls to its forward's two (it recomputes the scores): 2.5 forwards.
ATTENTION_BACKWARD_FLOPS = 2.5


# --- the ops of one micro-batch -----------------------------------------------------------------------------
def head_params(spec: ModelSpec) -> int:
    """The LM head's weights, a matmul whether or not it is tied to the embeddings."""
    return spec.vocab_size * spec.hidden_size


def layer_matmul_params(spec: ModelSpec) -> int:
    """Weights a token passes through in the decoder layers' matmuls: the active parameters less the embedding
    and the head (and the norms, too few to count), and less Gemma 4 E2B / E4B's per-layer embedding table."""
    return spec.active_params - spec.embedding_params - spec.lm_head_params - gemma4.per_layer_table_params(spec)


def base_matmul_seconds(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> float:
    """The base model's matmuls: 2 x params FLOPs per token per pass, at MATMUL_SHAPE_SHARE of the card's matmul
    rate, or its weights' read time if that is longer (a few tokens); QUANT_MATMUL_SLOWDOWN over a 4/8-bit base.

    Passes: the forward, the input gradients, for full fine-tuning the weight gradients, and under checkpointing
    the layers' forward again (not the head's: it runs after the last checkpoint). The chunked loss runs the
    head's forward again in backward (chunked_loss_flops_per_token). The slowdown is the decoder layers' (the
    head stays 16-bit). train_embeddings adds the head's weight gradient, one more pass: 2 x V x h x N FLOPs."""
    tokens = settings.tokens_per_micro_batch
    passes = 2 + (1 if settings.method == "full" else 0)
    layers = layer_matmul_params(spec) * passes + recomputed_layer_params(spec, settings)
    read = layers + idle_experts_read(spec, settings) * (passes + forward_passes(settings) - 1)
    head = head_params(spec) * (passes + (1 if memory.saved_module_params(spec, settings) else 0))
    rate = achievable_matmul_flops(gpu, settings.precision) * MATMUL_SHAPE_SHARE
    byte_rate, c = achievable_bytes_per_second(gpu), DTYPE_BYTES[settings.precision]
    slowdown = quant_matmul_slowdown(gpu) if settings.quant != "none" else 1.0
    # bitsandbytes quantises the nn.Linear layers only: an MoE's fused experts run at the 16-bit rate
    if spec.is_moe:
        quantized_share = spec.layer_linear_params * spec.num_hidden_layers / layer_matmul_params(spec)
        slowdown = 1 + (slowdown - 1) * quantized_share
    head_flops = 2 * head * tokens + chunked_loss_flops_per_token(spec, settings) * tokens
    return roofline_seconds(2 * layers * tokens, read * c, rate, byte_rate) * slowdown + roofline_seconds(
        head_flops, head * c, rate, byte_rate
    )


def idle_experts_read(spec: ModelSpec, settings: Settings) -> int:
    """An MoE's grouped matmuls read the weights of every expert some token of the micro-batch is routed to,
    not only a token's k: all of them once tokens x k reaches the expert count (the traced _grouped_mm reads
    its whole 3-D weight)."""
    if not spec.is_moe:
        return 0
    k, experts = spec.num_experts_per_tok, spec.num_local_experts
    hit = min(experts, settings.tokens_per_micro_batch * k)
    return (hit - k) * spec.expert_params // experts * spec.num_hidden_layers


def recomputed_layer_params(spec: ModelSpec, settings: Settings) -> int:
    """Weights the checkpointed recomputation runs again: the layers' matmuls, less the MLP's down projection
    under full fine-tuning, whose output nothing saves, so checkpointing's early stop never reruns it (under
    (Q)LoRA its adapter's path reruns it). Traced: `make bench-time-trace`."""
    if not settings.grad_ckpt:
        return 0
    params = layer_matmul_params(spec)
    if settings.method == "full":
        # an MoE runs its routed experts' down projections only
        active = spec.num_experts_per_tok if spec.is_moe else 1
        down = sum(i * o * active for name, i, o, n in spec.layer_linears() if name == "down_proj")
        params -= down * spec.num_hidden_layers
    return params


def chunked_loss_flops_per_token(spec: ModelSpec, settings: Settings) -> float:
    """The chunked loss runs the LM head's forward again in backward: 2 x V x h more FLOPs per token."""
    return 2 * spec.vocab_size * spec.hidden_size if settings.loss == "chunked" else 0.0


def eager_score_bytes(c: float) -> tuple[float, float]:
    """(forward, backward) bytes an eager attention moves per score element (transformers'
    eager_attention_forward), as traced (`make bench-time-trace`): forward, the QK^T matmul writes the scores
    (c), the scaling reads and writes them (2c), the mask is added (read c, write c: the mask itself is
    broadcast over the heads), the upcast to fp32 (c + 4), the softmax (4 + 4), the cast back (4 + c) and the
    PV matmul reads them (c): 8c + 16; backward about 8c + 20. 32 and 36 bytes for bf16."""
    return 8 * c + 16, 8 * c + 20


def attention_seconds(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> float:
    """Attention by kernel. sdpa and flash: 2 x seq x q_size FLOPs per token and layer (QK^T and PV, causal
    half), the backward 2.5 times that, at ATTENTION_SHARE of the matmul rate. eager: the whole square (twice the
    FLOPs) at the matmul rate, plus the scores it materialises, heads x seq^2 per sequence and layer, moved
    eager_score_bytes each in every forward and in backward."""
    tokens, seq, layers = settings.tokens_per_micro_batch, settings.seq_len, spec.num_hidden_layers
    if spec.linear_attention:  # a hybrid (Qwen3.5): attention in its full-attention layers, DeltaNet in the rest
        full = spec.linear_attention.full_layers(layers)
        plain = spec.model_copy(update={"num_hidden_layers": max(full, 1), "linear_attention": None})
        return attention_seconds(plain, settings, gpu) * (full > 0) + deltanet_seconds(spec, settings, gpu)
    passes = forward_passes(settings) + ATTENTION_BACKWARD_FLOPS
    forward_flops = 2 * seq * spec.q_size * layers * tokens
    rate = achievable_matmul_flops(gpu, settings.precision)
    if settings.attn != "eager":
        return forward_flops * passes / (rate * ATTENTION_SHARE)
    c = DTYPE_BYTES[settings.precision]
    scores = settings.micro_batch * spec.num_attention_heads * seq * seq * layers
    forward, backward = eager_score_bytes(c)
    moved = scores * (forward * forward_passes(settings) + backward)
    return roofline_seconds(2 * forward_flops * passes, moved, rate, achievable_bytes_per_second(gpu))


def deltanet_seconds(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> float:
    """A hybrid's linear-attention layers: linear_attention.chunk_flops_per_token in every forward pass and twice
    that in backward (each matmul's two gradients), in fp32 (the PyTorch chunked path casts q, k, v to fp32) at
    the card's fp32 matmul rate. The chunk loop's small kernels are not counted."""
    block = spec.linear_attention
    if block is None:
        return 0.0
    layers = spec.num_hidden_layers - block.full_layers(spec.num_hidden_layers)
    flops = chunk_flops_per_token(block) * settings.tokens_per_micro_batch * layers * (forward_passes(settings) + 2)
    return flops / achievable_matmul_flops(gpu, "fp32")


def quantized_params(spec: ModelSpec) -> int:
    """Weights bitsandbytes packs: every decoder block's nn.Linear (the embeddings and the head stay 16-bit), but
    those a pre-quantised checkpoint keeps 16-bit."""
    return spec.layer_linear_params * spec.num_hidden_layers - spec.kept_16bit_params


def dequant_seconds(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> float:
    """A 4/8-bit base is dequantised to the compute dtype before every matmul that uses a weight: in the forward,
    in the recomputation and for the input gradients. Each reads the packed weight and its state and writes a
    16-bit copy: (packed + c) bytes per weight, once per pass and micro-batch, whatever the tokens - so it
    weighs most at small micro-batches on cards with little bandwidth. With double quantisation bitsandbytes
    first dequantises the absmax (read the nested 8-bit codes, write fp32), adds its offset (read and write fp32)
    and reads it back: DOUBLE_QUANT_BYTES per weight more."""
    if settings.quant == "none":
        return 0.0
    # Unsloth's 4-bit experts: every expert's stack is dequantised for each grouped matmul, routed tokens or not
    weights = quantized_params(spec) + memory.quantized_expert_params(spec, settings, memory.stack_runtime(settings))
    per_pass = memory.quantized_weight_bytes(weights, settings) + weights * DTYPE_BYTES[settings.precision]
    if nested_absmax(settings):
        per_pass += weights * DOUBLE_QUANT_BYTES
    return per_pass * (forward_passes(settings) + 1) / dequant_bytes_per_second(gpu)


# The nested absmax's fp32 traffic per weight under double quantisation: one absmax per 64 weights written (4
# bytes), read and written by the offset add (8) and read by the 4-bit dequantisation (4): 16/64, traced at about
# 15/64 (`make bench-time-trace`).
DOUBLE_QUANT_BYTES = 15 / 64


def nested_absmax(settings: Settings) -> bool:
    """NF4 with double quantisation: three kernels a dequantisation (absmax, offset, weights), not one."""
    return settings.quant == "nf4" and settings.double_quant


def lora_dtype_bytes(settings: Settings, runtime: memory.Runtime) -> tuple[float, float, float]:
    """(c, a, m): bytes per element of the compute dtype, of the adapters (fp32 under peft's
    autocast_adapter_dtype) and of the adapters' matmuls (the compute dtype under autocast, else the adapters')."""
    c = DTYPE_BYTES[settings.precision]
    a = memory.trainable_dtype_bytes(settings, runtime)
    m = c if runtime.autocast and settings.precision != "fp32" else a
    return c, a, m


def lora_bytes_per_element(settings: Settings, runtime: memory.Runtime, s: float) -> tuple[float, float]:
    """(bytes per input element, bytes per output element) one adapted module's LoRA path moves in forward.

    peft casts the module's input (s bytes: the compute dtype, or the fp32 stream a 4-bit base passes on) to the
    adapter dtype a (s + a, when a != s), drops it out (read a, write a and a 1-byte mask, when lora_dropout > 0),
    autocast casts it back for the matmul (a + m) and lora_A reads it (m, the matmul dtype); on the output side
    lora_B writes m, the scaling reads and writes it (2m), the sum with the base output reads s and m and writes
    the wider (s + m + w), and the cast back reads w and writes s (when w != s). peft's bitsandbytes layers cast
    neither way while CUDA's autocast is on (`requires_conversion = not torch.is_autocast_enabled()` in
    tuners/lora/bnb.py, peft 0.13-0.21): dropout runs on the input as it comes (2s + 1) and autocast casts it
    for lora_A (s + m, when s != m). Under torch.compile the casts, dropout, scaling and sum fuse into two
    kernels."""
    c, a, m = lora_dtype_bytes(settings, runtime)
    if runtime.compiled:
        # one kernel casts and drops out the input (read c, write m) for lora_A to read (m); lora_B writes m and
        # one kernel scales it, adds the base output and casts the sum (read m and c, write c)
        return c + 2 * m, 2 * m + 2 * c
    w = max(s, m)
    drops = settings.lora_dropout > 0
    if bnb_layers_skip_casts(settings, runtime):
        dropout = 2 * s + 1 if drops else 0
        autocast_in = s + m if s != m else 0
        return dropout + autocast_in + m, 3 * m + s + m + w
    cast_in = s + a if a != s else 0
    dropout = 2 * a + 1 if drops else 0
    autocast_in = a + m if m != a else 0
    cast_out = w + s if w != s else 0
    return cast_in + dropout + autocast_in + m, 3 * m + s + m + w + cast_out


def linear_input_bytes(name: str, settings: Settings, runtime: memory.Runtime) -> float:
    """Bytes per element of a linear's input, and over a 4-bit base of its output (bitsandbytes' Linear4bit hands
    it back in its input's dtype, stream_cast_seconds): the compute dtype, or the residual stream's where that is
    fp32 - except the attention's output projection under autocast, whose input the attention writes in the
    compute dtype (SDPA and flash-attention run in it, eager's last matmul too)."""
    c = DTYPE_BYTES[settings.precision]
    if settings.quant == "none" or (name == "o_proj" and runtime.autocast):
        return c
    return memory.stream_dtype_bytes(settings, runtime)


def bnb_layers_skip_casts(settings: Settings, runtime: memory.Runtime) -> bool:
    """peft's LoRA over a bitsandbytes layer under CUDA's autocast: no cast of the input to the adapter dtype,
    none of the output back (lora_bytes_per_element). On the CPU the check reads CUDA's autocast, which is off."""
    mixed = runtime.autocast and settings.precision != "fp32"
    return settings.quant != "none" and mixed and runtime.device == "cuda"


def lora_seconds(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> float:
    """The LoRA path of every adapted module: its casts, dropout, scaling and sum move memory in proportion to
    the tokens x the module's in and out widths (lora_bytes_per_element), in forward and recomputation, and
    about as much again in backward (traced, `make bench-time-trace`: 0.99x the forward with dropout, 0.98x
    without); over a 4/8-bit base peft's bitsandbytes layer also clones the base output (2c per output element)
    in every forward. Its rank-r matmuls (2 r (in + out) FLOPs per token, three times over with the gradients)
    run at the adapter dtype's rate."""
    if settings.method == "full":
        return 0.0
    runtime = memory.stack_runtime(settings)
    experts = set(spec.expert_target_names(settings.lora_targets))
    names = set(spec.lora_target_names(settings.lora_targets)) - experts
    forward = backward = 0.0
    widths = []
    for name, i, o, n in spec.layer_linears():
        if name not in names:
            continue
        s = linear_input_bytes(name, settings, runtime)
        per_in, per_out = lora_bytes_per_element(settings, runtime, s)
        clone = 2 * s if settings.quant != "none" else 0
        forward += i * n * per_in + o * n * (per_out + clone)
        backward += i * n * per_in + o * n * per_out
        widths.append((i * n, o * n))
    tokens = settings.tokens_per_micro_batch * spec.num_hidden_layers
    forward, backward = tokens * forward, tokens * backward
    flops = 2 * settings.lora_r * sum(i + o for i, o in widths) * tokens * (forward_passes(settings) + 2)
    matmul_bytes = lora_dtype_bytes(settings, runtime)[2]
    rate = achievable_matmul_flops(gpu, "fp32" if matmul_bytes == 4 else settings.precision)
    moved = forward * forward_passes(settings) + backward
    return roofline_seconds(flops, moved, rate, achievable_bytes_per_second(gpu)) + (
        expert_lora_seconds(spec, settings, gpu) if experts else 0.0
    )


def expert_lora_seconds(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> float:
    """lora_targets experts (peft's ParamWrapper on the fused experts): each forward merges W + B A for every
    expert (2 r FLOPs per weight; reads W and B A, writes the merged weight), and backward computes the merged
    weight's gradient for the routed tokens (2 x tokens x active expert weights, as full fine-tuning's weight
    gradients) before reducing it to A's and B's (4 r FLOPs per weight; writes and reads it back twice)."""
    c, layers = DTYPE_BYTES[settings.precision], spec.num_hidden_layers
    weights = spec.expert_params * layers
    active = weights * spec.num_experts_per_tok // spec.num_local_experts
    flops = 2 * settings.lora_r * weights * (forward_passes(settings) + 2)
    flops += 2 * settings.tokens_per_micro_batch * active
    moved = c * weights * (3 * forward_passes(settings) + 3)
    rate = achievable_matmul_flops(gpu, settings.precision) * MATMUL_SHAPE_SHARE
    return roofline_seconds(flops, moved, rate, achievable_bytes_per_second(gpu))


# Bytes transformers' RMSNorm moves per element: it casts to fp32 (c + 4), squares (8), averages (4), scales by
# the reciprocal root (8), casts back (4 + c) and multiplies by its weight (2c): 36 for bf16.
NORM_BYTES = 36
# Rotary embedding per element of q and k (apply_rotary_pos_emb): q x cos, rotate_half (two slices, a negation,
# a concatenation), x sin, and the sum: about ten c-byte reads and writes.
ROTARY_ELEMENT_PASSES = 10


def elementwise_bytes_per_token(spec: ModelSpec, settings: Settings) -> float:
    """Bytes the bandwidth-bound ops of one decoder layer move per token in forward: the norms (NORM_BYTES x h
    each), two residual sums (3 s x h each, s the residual stream's dtype), rotary on q and k, SwiGLU's
    activation and product (5c x the intermediate width, for each routed expert) and the attention output's
    copy back to the token layout (2c x q_size)."""
    runtime = memory.stack_runtime(settings)
    c, s = DTYPE_BYTES[settings.precision], memory.stream_dtype_bytes(settings, runtime)
    h = spec.hidden_size
    # DeepSeek's shared experts (mla.py) run the same SwiGLU, n_shared_experts x the routed expert's width, as
    # Gemma 4 26B-A4B's dense MLP does, intermediate_size wide, with four norms more (gemma4.py), and Qwen3-Next's /
    # Qwen3.5 MoE's gated shared expert, in routed experts' widths (linear_attention.py)
    experts: float = max(spec.num_experts_per_tok, 1) + (spec.latent.n_shared_experts if spec.latent else 0)
    norms = spec.norms_per_layer
    if gemma4.is_moe(spec):
        experts, norms = experts + spec.intermediate_size / spec.mlp_width, norms + gemma4.MOE_NORMS + 1
    experts_run = experts + shared_expert_width_share(spec)
    if runtime.compiled:
        return compiled_elementwise_bytes_per_token(spec, settings, runtime)
    if runtime.liger_kernels:
        return liger_elementwise_bytes_per_token(spec, settings, runtime)
    # the projections' outputs: fp32 over a 4-bit base under an fp32 stream (Linear4bit hands back its input's
    # dtype), so rotary runs on fp32 q and k as SwiGLU on fp32 gate and up
    projected = memory.swiglu_dtype_bytes(settings, runtime)
    return (
        norms * NORM_BYTES * h
        + 2 * 3 * s * h
        + ROTARY_ELEMENT_PASSES * projected * (spec.q_size + spec.kv_size)
        + 5 * projected * spec.mlp_width * experts_run
        + 2 * c * spec.q_size
    )


def compiled_elementwise_bytes_per_token(spec: ModelSpec, settings: Settings, runtime: memory.Runtime) -> float:
    """The same ops fused by torch.compile, each fused kernel reading its inputs and writing its outputs once:
    each residual sum with the norm after it (read the stream and the block's output, write the new stream and the
    normed input: 3s + c per element, twice a layer), rotary (read and write q and k), SwiGLU (read gate and up,
    write their product) and the attention output's copy."""
    c, s = DTYPE_BYTES[settings.precision], memory.stream_dtype_bytes(settings, runtime)
    experts = max(spec.num_experts_per_tok, 1)
    return (
        spec.norms_per_layer * (3 * s + c) * spec.hidden_size
        + 2 * c * (spec.q_size + spec.kv_size)
        + 3 * memory.swiglu_dtype_bytes(settings, runtime) * spec.mlp_width * experts
        + 2 * c * spec.q_size
    )


def liger_elementwise_bytes_per_token(spec: ModelSpec, settings: Settings, runtime: memory.Runtime) -> float:
    """The same ops with Liger's kernels (liger-kernel 0.8.2, catalog/stacks.toml [liger]), each one Triton
    kernel that reads its inputs and writes its outputs once: RMSNorm reads the stream and writes the normed input
    (s + c per element, the rsqrt in registers), rotary reads and writes q and k in place (2c), SwiGLU reads gate
    and up and writes their product (3c); the residual sums and the attention output's copy stay transformers'.
    From the kernels' source, not fitted."""
    c, s = DTYPE_BYTES[settings.precision], memory.stream_dtype_bytes(settings, runtime)
    experts = max(spec.num_experts_per_tok, 1)
    return (
        spec.norms_per_layer * (s + c) * spec.hidden_size
        + 2 * 3 * s * spec.hidden_size
        + 2 * c * (spec.q_size + spec.kv_size)
        + 3 * memory.swiglu_dtype_bytes(settings, runtime) * spec.intermediate_size * experts
        + 2 * c * spec.q_size
    )


def stream_cast_seconds(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> float:
    """An fp32 residual stream into a 4-bit base (peft's kbit preparation leaves the norms in fp32, and they
    promote the stream): bitsandbytes' Linear4bit casts each input to its compute dtype and its output back to
    the input's (`x.to(self.compute_dtype)`, `.to(inp_dtype)` in Linear4bit.forward, bitsandbytes 0.43 and
    0.50), and autograd casts both gradients back in backward: (4 + c) bytes per input and output element of
    every quantised linear, in forward, recomputation and backward. From the source, not fitted."""
    runtime = memory.stack_runtime(settings)
    c = DTYPE_BYTES[settings.precision]
    if settings.quant != "nf4" or c == 4:
        return 0.0
    # the nn.Linear layers bitsandbytes replaces (not an MoE's fused experts, copies > 1) that get an fp32 input
    fp32 = [
        (i, o) for name, i, o, n in spec.layer_linears() if n == 1 and linear_input_bytes(name, settings, runtime) == 4
    ]
    elements = sum(i + o for i, o in fp32)
    per_pass = (4 + c) * elements * spec.num_hidden_layers * settings.tokens_per_micro_batch
    return per_pass * (forward_passes(settings) + 1) / achievable_bytes_per_second(gpu)


def elementwise_seconds(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> float:
    """Norms, activations, rotary and residuals: bandwidth-bound, tokens x layers x elementwise_bytes_per_token,
    in forward, recomputation and backward (ELEMENTWISE_BACKWARD_TRAFFIC x the forward)."""
    passes = forward_passes(settings) + ELEMENTWISE_BACKWARD_TRAFFIC
    per_token = elementwise_bytes_per_token(spec, settings) * spec.num_hidden_layers
    return settings.tokens_per_micro_batch * per_token * passes / achievable_bytes_per_second(gpu)


# Bytes the loss moves per logit: the fp32 upcast (c + 4) and log-softmax (4 + 4) in forward; in backward the
# gradient of the gathered log-probabilities (4), log-softmax's backward (read 4 + 4, write 4) and the cast back
# (4 + c): 36 for bf16. The chunked and fused losses move the same per logit, a chunk at a time. Under the HF
# Trainer's autocast accelerate also copies the logits to fp32 (convert_to_fp32, c + 4 more; traced, `make
# bench-time-trace`: 42 bytes a logit for bf16).
LOSS_BYTES_PER_LOGIT = 36


# Compiled, the upcast, log-softmax and their backward fuse: the logits are read in forward, read again and their
# gradient written in backward, in the compute dtype (3c), with fp32 reductions in registers.
COMPILED_LOSS_PASSES = 3
# Liger's fused linear cross-entropy (ops/cross_entropy.py @ v0.8.2, liger_cross_entropy_kernel): one pass reads
# a chunk's logits for the running max and sum (l. 151), a second reads them again and writes their gradient in
# place (l. 206-252): three compute-dtype passes, no fp32 copy (the matmuls' own reads and writes are counted with
# them, as for transformers' loss). The head's matmuls are the
# same as transformers' (logits, then the hidden states' gradient in the forward instead of the backward): no
# matmul is run again.
LIGER_LOSS_PASSES = 3


def loss_seconds(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> float:
    """The cross-entropy over tokens x vocabulary logits, bandwidth-bound."""
    logits = settings.tokens_per_micro_batch * spec.vocab_size
    runtime, c = memory.stack_runtime(settings), DTYPE_BYTES[settings.precision]
    per_logit = LOSS_BYTES_PER_LOGIT + (c + 4 if runtime.autocast and c != 4 else 0)
    if runtime.compiled:
        per_logit = COMPILED_LOSS_PASSES * c
    if runtime.loss == "liger_fused":
        per_logit = LIGER_LOSS_PASSES * c
    return logits * per_logit / achievable_bytes_per_second(gpu)


# Kernels one decoder layer launches in its forward beyond its linears: two norms of six, two residual sums,
# rotary (about ten), SwiGLU (two), attention with its layout copies (about four), and the attention kernel;
# about twice the elementwise ones in backward. Traced: 30 + 1 forward (`make bench-time-trace`).
LAYER_KERNELS = 2 * 6 + 2 + 10 + 2 + 4
# Liger: the two norms, rotary and SwiGLU one kernel each, the two residual sums and the attention with its
# layout copies (about four), as in transformers
LIGER_LAYER_KERNELS = 2 + 2 + 1 + 1 + 4
# Compiled: two fused residual-and-norm kernels, rotary, SwiGLU and the attention with its layout copy (about 6);
# the LoRA path's two matmuls and two fused kernels.
COMPILED_LAYER_KERNELS = 6
COMPILED_LORA_KERNELS = 4


# An MoE block's kernels beyond its grouped matmuls, forward: the router's softmax and top-k, the sort that
# groups tokens by expert, the gathers and scatters, the routing weights' product and the sum over the k experts
# (transformers 5.25 integrations/moe.py grouped_mm_experts_forward). Fitted on the traced op list of Mixtral
# 8x7B QLoRA (348 kernels a layer traced, 288 without this term; counted four times a layer, as LAYER_KERNELS).
# Qwen3-MoE's and gpt-oss's layers trace about 60 more: their q/k norms and clamped SwiGLU, not counted.
MOE_ROUTING_KERNELS = 15


def lora_kernels(settings: Settings, runtime: memory.Runtime) -> int:
    """Kernels of one adapted module's LoRA path in forward, as lora_bytes_per_element counts its ops: the
    input's cast to the adapter dtype, dropout, autocast's cast back and its casts of the two fp32 adapter
    weights, lora_A, lora_B, the scaling, the sum, the cast back, and over a 4/8-bit base peft's clone of the
    base output. peft's bitsandbytes layers under CUDA's autocast cast nothing themselves: autocast casts the
    input (when the stream is fp32) and the fp32 adapter weights. Traced: 9 for LoRA with dropout, 8 without, 8
    for QLoRA (`make bench-time-trace`)."""
    if runtime.compiled:
        return COMPILED_LORA_KERNELS
    c, a, m = lora_dtype_bytes(settings, runtime)
    if bnb_layers_skip_casts(settings, runtime):
        s = memory.stream_dtype_bytes(settings, runtime)
        return 5 + (settings.lora_dropout > 0) + (s != m) + (2 if a != m else 0)  # with peft's clone
    return (
        4  # lora_A, lora_B, scaling, sum
        + (a != c)
        + (settings.lora_dropout > 0)
        + (3 if m != a else 0)
        + (max(c, m) != c)
        + (settings.quant != "none")
    )


def kernel_count(spec: ModelSpec, settings: Settings) -> int:
    """Kernels of one micro-batch, per layer. Forward (twice under checkpointing): LAYER_KERNELS and the
    attention, one per linear, per dequantised linear one (three with double quantisation), and lora_kernels per
    adapted module. Backward: twice the elementwise kernels, the linears' input gradients (and their weight
    gradients for full fine-tuning), the dequantisations again, and the LoRA paths' backward, one kernel more
    than their forward (traced: 10.4 for 9)."""
    runtime = memory.stack_runtime(settings)
    elementwise = (
        COMPILED_LAYER_KERNELS if runtime.compiled else LIGER_LAYER_KERNELS if runtime.liger_kernels else LAYER_KERNELS
    )
    # an MoE's experts run as one grouped matmul per fused parameter, in 16 bit, plus the routing's kernels
    linears = len(spec.layer_linears())
    quantized = linears - (len(spec.mlp_linears()) if spec.is_moe else 0)
    dequant = quantized * (3 if nested_absmax(settings) else 1) if settings.quant != "none" else 0
    experts = set(spec.expert_target_names(settings.lora_targets))
    adapted = len(set(spec.lora_target_names(settings.lora_targets)) - experts) if settings.method != "full" else 0
    lora = lora_kernels(settings, runtime) if adapted else 0
    if spec.is_moe:
        elementwise += MOE_ROUTING_KERNELS
    forward = elementwise + 1 + linears + dequant + adapted * lora
    backward = 2 * elementwise + linears * (2 if settings.method == "full" else 1) + dequant + adapted * (lora + 1)
    return (forward * forward_passes(settings) + backward) * spec.num_hidden_layers


def launch_seconds(spec: ModelSpec, settings: Settings) -> float:
    """What the kernels cost beyond their work: KERNEL_SECONDS each."""
    return kernel_count(spec, settings) * KERNEL_SECONDS


@dataclass(frozen=True)
class MicroBatchTime:
    """One micro-batch on one GPU, in seconds, op by op."""

    matmul: float  # the base model's matmuls
    attention: float  # the attention kernels
    dequant: float  # dequantising a 4/8-bit base
    lora: float  # the adapters' paths
    elementwise: float  # norms, activations, rotary, residuals
    loss: float  # the cross-entropy over the logits
    launches: float  # what the kernels cost beyond their work
    host_copies: float  # the savers' copies over the host link

    @property
    def total(self) -> float:
        """The ops run one after another: their sum."""
        return sum(asdict(self).values())


def trained_embedding_seconds(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> float:
    """train_embeddings: the input embedding's dense gradient (embedding_dense_backward zero-fills a V x h
    buffer and adds the N token rows into it), and, from the second micro-batch of an accumulation on, each
    trained copy's new gradient added into the one kept (read both, write one). Bandwidth-bound."""
    saved = memory.saved_module_params(spec, settings)
    if not saved:
        return 0.0
    g = memory.saved_module_dtype_bytes(settings, memory.stack_runtime(settings))
    rows = 3 * g * spec.hidden_size * settings.tokens_per_micro_batch
    accumulate = 3 * g * saved * (settings.grad_accum - 1) / settings.grad_accum
    return (g * spec.embedding_params + rows + accumulate) / achievable_bytes_per_second(gpu)


def micro_batch_time(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> MicroBatchTime:
    """Every op of one micro-batch, timed apart and summed in `total`: the GPU runs them one after another; of the
    checkpoint the stack loads (memory.as_loaded)."""
    spec = memory.as_loaded(spec, settings)
    ops = dict(
        matmul=base_matmul_seconds(spec, settings, gpu),
        attention=attention_seconds(spec, settings, gpu),
        dequant=dequant_seconds(spec, settings, gpu),
        lora=lora_seconds(spec, settings, gpu),
        elementwise=elementwise_seconds(spec, settings, gpu)
        + trained_embedding_seconds(spec, settings, gpu)
        + stream_cast_seconds(spec, settings, gpu),
        loss=loss_seconds(spec, settings, gpu),
        launches=launch_seconds(spec, settings),
    )
    return MicroBatchTime(**ops, host_copies=host_copy_seconds(spec, settings, gpu, sum(ops.values())))


def step_seconds(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> float:
    """One micro-batch on one GPU: the sum of its ops (micro_batch_time)."""
    return micro_batch_time(spec, settings, gpu).total


# --- the optimizer step on the GPU ------------------------------------------------------------------------
def optimizer_seconds(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> float:
    """The optimizer step is memory-bound: it streams every trainable parameter's state
    (optimizer_traffic_bytes) at the card's bandwidth."""
    runtime = memory.stack_runtime(settings)
    saved = memory.saved_module_params(spec, settings)  # train_embeddings: the copies, in their own dtype
    adapters = (memory.trainable_params(spec, settings) - saved) * optimizer_traffic_bytes(settings, runtime)
    copies = saved * optimizer_traffic_bytes(settings, runtime, memory.saved_module_dtype_bytes(settings, runtime))
    return (adapters + copies) / achievable_bytes_per_second(gpu)


@dataclass(frozen=True)
class StepTime:
    """One optimizer step on one GPU, in seconds, and what it is made of."""

    compute: float  # the micro-batches' compute, savers' host copies included
    communication: float  # the collectives not hidden behind compute
    offload: float  # the offload copies and the CPU step not hidden
    optimizer: float  # the optimizer step on the GPU
    micro_batches: float  # micro-batches each GPU runs a step
    # what `compute` is made of, op by op over the step's micro-batches (MicroBatchTime)
    matmul: float = 0.0
    attention: float = 0.0
    dequant: float = 0.0
    lora: float = 0.0
    elementwise: float = 0.0
    loss: float = 0.0
    launches: float = 0.0
    host_copies: float = 0.0

    @property
    def total(self) -> float:
        """The step's wall time: its parts do not overlap once each is counted as what is not hidden."""
        return self.compute + self.communication + self.offload + self.optimizer


def step_time(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> StepTime:
    """Compute, plus what the engine cannot hide of its communication and offload copies (COMM_OVERLAP of each
    micro-batch's compute hides the per-micro-batch part; the per-step part overlaps the last micro-batch's
    backward), plus the optimizer step. Over several nodes each GPU runs grad_accum / nodes micro-batches."""
    ops = micro_batch_time(spec, settings, gpu)
    micro = ops.total
    micro_batches = max(settings.grad_accum / settings.nodes, 1.0)
    overlap = COMM_OVERLAP[settings.shard] * micro
    rate = collective_bytes_per_second(settings, gpu)
    comm_micro, comm_step = (volume / rate for volume in communication_bytes(spec, settings))
    off_micro, off_step = offload_seconds(spec, settings, gpu)
    exposed_micro = max(0.0, comm_micro + off_micro - overlap)
    exposed_comm = micro_batches * exposed_micro * (comm_micro / (comm_micro + off_micro or 1.0))
    exposed_offload = micro_batches * exposed_micro - exposed_comm
    exposed_comm += max(0.0, comm_step - max(0.0, overlap - comm_micro - off_micro))
    optimizer = 0.0 if memory.on_host(settings)[2] else optimizer_seconds(spec, settings, gpu)
    return StepTime(
        compute=micro_batches * micro,
        communication=exposed_comm,
        offload=exposed_offload + off_step,
        optimizer=optimizer * memory.shard_factors(settings)[2] + paging_seconds(spec, settings, gpu),
        micro_batches=micro_batches,
        **{name: micro_batches * seconds for name, seconds in asdict(ops).items()},
    )


def tokens_per_second(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> float:
    """Whole-job throughput: every GPU's micro-batches of an optimizer step over the step's time (step_time)."""
    step = step_time(spec, settings, gpu)
    return memory.world_size(settings) * step.micro_batches * settings.tokens_per_micro_batch / step.total
