"""The LM head and the loss: the logits and their gradients as each stack makes them (whole, chunked, fused),
and what the head saves for backward."""

from __future__ import annotations

import math

from lorafit.memory.activations import (
    activation_bytes,
    bnb_held_bytes,
    keeps_bnb_inputs,
    norm_saved_bytes,
    stream_dtype_bytes,
)
from lorafit.memory.runtime import (
    HEAD_CHUNK,
    LOSS_CHUNK_TOKENS,
    UNSLOTH_CHUNK_TARGET_BYTES,
    ChunkSizing,
    Runtime,
)
from lorafit.memory.weights import (
    adapter_bytes,
    saved_module_dtype_bytes,
    saved_module_params,
    weights_bytes,
)
from lorafit.models import ModelSpec
from lorafit.schema import Settings
from lorafit.units import BYTES_PER_GIB as GIB
from lorafit.units import DTYPE_BYTES


def head_saved_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """The final RMSNorm saves its fp32 input (and, training the head, the normalised bf16 input, which the head
    saves too); Liger's saves its input as it comes (norm_saved_bytes). A quantised head under old bitsandbytes
    keeps that normalised input too."""
    c, h = DTYPE_BYTES[settings.precision], spec.hidden_size
    liger = runtime.liger_kernels
    per_token: float = norm_saved_bytes(spec, settings, runtime) if liger else 4 * h + 4
    if settings.method == "full":
        per_token += (1 if liger else 2) * c * h
    elif settings.train_embeddings:  # the trained head copy saves its input for its weight gradient
        per_token += c * h
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
    n, vocab, c = settings.tokens_per_micro_batch, spec.vocab_size, DTYPE_BYTES[settings.precision]
    if settings.loss == "chunked" and runtime.loss == "hf":
        return chunked_loss_bytes(spec, settings)
    if runtime.loss == "chunked_compute":
        # litgpt: the logits list and every chunk's log-softmax (compute dtype, no upcast); in backward one
        # chunk's gradient, then the gradient of its log-softmax or the head's dequantised weight
        chunk = head_chunk_tokens(settings)
        backward_chunk = max(c * vocab * chunk, head_dequant_bytes(spec, settings, runtime))
        return 2 * c * vocab * n + c * vocab * chunk + backward_chunk
    if runtime.loss == "fused_logprob":
        return fused_head_bytes(spec, settings, runtime)
    if runtime.loss == "fused_chunked":
        target = unsloth_chunk_target(spec, settings, runtime, gpu_bytes)
        return fused_chunked_loss_bytes(spec, settings, target, runtime.fused_chunk_sizing)
    if runtime.loss == "liger_fused":
        return liger_loss_bytes(spec, settings, runtime)
    if runtime.loss == "cut_ce" and n > CUT_CE_MIN_TOKENS:
        # the hidden states' gradient, and its fp32 log-sum-exp per token: the logits stay in on-chip blocks
        return c * spec.hidden_size * n + 4 * n
    if runtime.loss in ("compute_logits", "cut_ce"):
        # the logits, made into their own gradient in place, and in backward the hidden states' gradient of the
        # head; before that the model returns its logits, and under mixed precision accelerate's
        # convert_outputs_to_fp32 (Accelerator.prepare_model with native AMP, utils/operations.py convert_to_fp32:
        # fp16/bf16 outputs to fp32) holds an fp32 copy of them until the loss is returned
        returned = 4 * vocab * n if runtime.autocast and c != 4 else 0
        return c * vocab * n + max(returned, c * spec.hidden_size * n)
    # Gemma-2 soft-caps the logits (tanh(logits / 30) x 30) in the compute dtype: tanh keeps its output
    softcap = c * vocab * n if spec.logit_softcapping else 0
    return 12 * vocab * n + softcap + head_weight_cast_bytes(spec, settings, runtime)


# Unsloth ran Apple's cut cross-entropy only for micro-batches of more than this many tokens (bsz * q_len <= 1024
# returned the logits: unsloth/models/llama.py @ 0a2c3973, l. 1015, from b9fe2588 on)
CUT_CE_MIN_TOKENS = 1024


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
    (`make bench-stacks` traces TRL's SFTTrainer step). A trained head (train_embeddings) adds its weight's
    gradient: an fp32 V x h accumulator, cast to the weight's dtype at the end (chunked_logprob.py @ v1.16.0,
    l. 409-411 and 456-457)."""
    c, h = DTYPE_BYTES[settings.precision], spec.hidden_size
    scored = settings.micro_batch * (settings.seq_len - 1)
    tile = min(scored, FUSED_TILE_TOKENS)
    buffers = tile * FUSED_VOCAB_CHUNK * c + 4 * h * scored
    if saved_module_params(spec, settings):  # the trained head's gradient: fp32, and its cast
        buffers += (4 + saved_module_dtype_bytes(settings, runtime)) * (spec.lm_head_params or spec.embedding_params)
    if runtime.device == "cpu":
        gathered = c * h * scored if settings.micro_batch > 1 else 0
        fold = FUSED_CPU_BACKWARD_TILES * 4 * tile * min(spec.vocab_size, FUSED_VOCAB_CHUNK)
        return gathered + buffers + max(fold, c * h * scored)
    return c * h * scored + buffers + c * h * scored


def unsloth_chunk_target(
    spec: ModelSpec, settings: Settings, runtime: Runtime, gpu_bytes: float | None = None
) -> float:
    """The most fp32 logits one chunk of Unsloth's fused cross-entropy may hold: half the memory free when the
    loss first runs, at most 4 GiB where the version caps it (Runtime.fused_chunk_sizing). _get_chunk_multiplier
    is functools.cache'd, so the free memory is read once, at the first micro-batch's loss: before any optimizer
    state exists (torch and bitsandbytes create it at the first step) and before any gradient. Free: the GPU's
    memory less the CUDA context, the weights, adapters, the saved activations and the gradient of the hidden
    states the loss allocates; without a GPU, the 4 GiB cap."""
    if gpu_bytes is None:
        return UNSLOTH_CHUNK_TARGET_BYTES
    used = (
        runtime.cuda_context_gib * GIB
        + weights_bytes(spec, settings, runtime)
        + adapter_bytes(spec, settings, runtime)
        + activation_bytes(spec, settings, runtime)
        + head_saved_bytes(spec, settings, runtime)
        + DTYPE_BYTES[settings.precision] * spec.hidden_size * settings.tokens_per_micro_batch
    )
    half_free = max(gpu_bytes - used, 0.0) / 2
    return half_free if runtime.fused_chunk_sizing == "half_free" else min(half_free, UNSLOTH_CHUNK_TARGET_BYTES)


def unsloth_chunk_tokens(
    spec: ModelSpec,
    settings: Settings,
    target_bytes: float = UNSLOTH_CHUNK_TARGET_BYTES,
    sizing: ChunkSizing = "capped",
) -> int:
    """Tokens in one chunk of Unsloth's fused cross-entropy: the micro-batch cut into as many chunks as its fp32
    logits over `target_bytes` (unsloth_chunk_target), a multiple of 4 (get_chunk_size): rounded up where the
    version caps the target, to the nearest (at least one chunk) before. Where nothing is free, one token a
    chunk: Unsloth itself stops there."""
    n = settings.tokens_per_micro_batch
    if target_bytes <= 0:
        return 1
    exact = 4 * spec.vocab_size * n / target_bytes
    if sizing == "half_free":
        return math.ceil(n / max(4 * round(exact / 4), 1))
    chunks = 1 if exact <= 1 else 4 * math.ceil(exact / 4)
    return math.ceil(n / chunks)


def fused_chunked_loss_bytes(
    spec: ModelSpec,
    settings: Settings,
    target_bytes: float = UNSLOTH_CHUNK_TARGET_BYTES,
    sizing: ChunkSizing = "capped",
) -> float:
    """Unsloth's fused cross-entropy (UnslothFusedLoss.forward): the gradient of the hidden states it fills in
    forward (N x h x c, saved for backward) and one chunk at its peak, twice its fp32 logits (8 x V per token):
    compute_fused_ce_loss upcasts the logits to fp32 and torch.func.grad_and_value, compiled, turns them into
    their gradient, and Unsloth sizes a chunk's fp32 logits to half the free memory, so that the two fit.
    Gemma-2's soft-capping keeps its tanh output too (c x V). Read from the source, not traced: Unsloth needs a
    GPU; checked by the USC-* rows of `make bench-memory`."""
    c, chunk = DTYPE_BYTES[settings.precision], unsloth_chunk_tokens(spec, settings, target_bytes, sizing)
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
