"""Analytic peak memory of one training step: one function per term, summed in `estimate()`.

Every term counts the tensors that the real code path (transformers + peft + bitsandbytes, as `train/build.py`
sets it up) keeps alive, derived op by op in docs/memory-model.md and checked against the live-tensor trace of
real steps (`lorafit estimate --exact`, tests/test_trace.py). Pure Python: no torch import, so planning is instant.

Notation (per micro-batch): N tokens (micro_batch x seq_len), L layers, h hidden, q = heads x head_dim,
kv = kv_heads x head_dim, I intermediate, V vocabulary, r LoRA rank, c bytes of the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorafit.gemma4 import last_layer
from lorafit.hardware import GpuSpec
from lorafit.memory.activations import (
    activation_bytes,
    activation_bytes_per_layer,
    activation_parts_per_token,
    bnb_held_bytes,
    bnb_input_bytes_per_token,
    checkpoint_bytes_per_layer,
    dequant_bytes,
    first_layer_input_requires_grad,
    grad_buffer_bytes,
    host_saver_bytes,
    host_saver_problem,
    keeps_bnb_inputs,
    lora_module_saved_bytes,
    offloaded_activation_bytes,
    optimizer_step_temp_bytes,
    recompute_bytes,
    stream_dtype_bytes,
    swiglu_dtype_bytes,
    unsloth_offloads,
)
from lorafit.memory.allocator import (
    EXPANDABLE_RESERVE_FIT,
    RESERVED_ALLOCATED_SHARE,
    UNSIMULATED_RESERVE_BYTES,
    device_bytes,
    reserved_bytes,
    transient_bytes,
    unsimulated_reserve_bytes,
)
from lorafit.memory.host import (
    HOST_OPTIMIZER_BYTES_PER_PARAM,
    gpu_loading_bytes,
    host_loads_the_base,
    host_ram_parts,
    offloaded_state_bytes,
)
from lorafit.memory.loss import (
    CUT_CE_MIN_TOKENS,
    chunked_loss_bytes,
    head_forward_bytes,
    head_saved_bytes,
    logits_bytes,
    loss_chunk_tokens,
    previous_step_bytes,
    unsloth_chunk_target,
    unsloth_chunk_tokens,
)
from lorafit.memory.runtime import (
    LOSS_CHUNK_TOKENS,
    Runtime,
    quantized_expert_params,
    rope_cache_bytes,
    stack_runtime,
)
from lorafit.memory.weights import (
    DEEPSPEED_BUCKET_ELEMENTS,
    adapter_bytes,
    communication_buffer_bytes,
    embedding_backward_bytes,
    embedding_grad_bytes,
    embedding_offload_applies,
    gathered_layer_bytes,
    gathered_param_bytes,
    gradient_bytes,
    head_grad_bytes,
    offload_of,
    offloaded_embedding_bytes,
    on_host,
    optimizer_bytes,
    paged,
    quant_state_bytes,
    quantized_weight_bytes,
    saved_module_dtype_bytes,
    saved_module_params,
    shard_factors,
    sharded_weight_bytes,
    trainable_dtype_bytes,
    trainable_params,
    weights_bytes,
    world_size,
)
from lorafit.models import ModelSpec, unsloth_dynamic_copy
from lorafit.options import DEFAULT_HEADROOM
from lorafit.schema import Estimate, Settings
from lorafit.units import BYTES_PER_GIB as GIB
from lorafit.units import gib

# what the rest of lorafit reads as memory.NAME
__all__ = [
    "as_loaded",
    "DEEPSPEED_BUCKET_ELEMENTS",
    "EXPANDABLE_RESERVE_FIT",
    "GIB",
    "HOST_OPTIMIZER_BYTES_PER_PARAM",
    "LOSS_CHUNK_TOKENS",
    "RESERVED_ALLOCATED_SHARE",
    "Runtime",
    "UNSIMULATED_RESERVE_BYTES",
    "activation_bytes",
    "activation_bytes_per_layer",
    "activation_parts_per_token",
    "adapter_bytes",
    "StepPeak",
    "assemble",
    "bnb_held_bytes",
    "breakdown",
    "checkpoint_bytes_per_layer",
    "chunked_loss_bytes",
    "communication_buffer_bytes",
    "dequant_bytes",
    "device_side",
    "embedding_grad_bytes",
    "embedding_offload_applies",
    "estimate",
    "gathered_layer_bytes",
    "gathered_param_bytes",
    "gpu_loading_bytes",
    "grad_buffer_bytes",
    "gradient_bytes",
    "head_forward_bytes",
    "head_saved_bytes",
    "host_loads_the_base",
    "host_ram_parts",
    "host_saver_bytes",
    "host_saver_problem",
    "logits_bytes",
    "lora_module_saved_bytes",
    "loss_chunk_tokens",
    "offload_of",
    "offloaded_activation_bytes",
    "offloaded_embedding_bytes",
    "offloaded_state_bytes",
    "on_host",
    "optimizer_bytes",
    "optimizer_step_temp_bytes",
    "paged",
    "previous_step_bytes",
    "quant_state_bytes",
    "quantized_expert_params",
    "quantized_weight_bytes",
    "recompute_bytes",
    "reserved_bytes",
    "saved_module_dtype_bytes",
    "saved_module_params",
    "shard_factors",
    "sharded_weight_bytes",
    "stack_runtime",
    "stream_dtype_bytes",
    "swiglu_dtype_bytes",
    "trainable_dtype_bytes",
    "trainable_params",
    "transient_bytes",
    "CUT_CE_MIN_TOKENS",
    "unsloth_chunk_target",
    "unsloth_chunk_tokens",
    "unsloth_offloads",
    "weights_bytes",
    "world_size",
]


# --- the checkpoint the stack loads ---------------------------------------------------------------------------
def as_loaded(spec: ModelSpec, settings: Settings) -> ModelSpec:
    """The checkpoint a step loads for this model: with load_in_4bit Unsloth loads a 16-bit name from its dynamic
    4-bit copy where its mapper has one (unsloth/models/loader_utils.py @ 015bdef0 __get_model_name, mapper.py),
    counted with the 16-bit layers catalog/unsloth_dynamic.toml gives; any other model or stack as named."""
    if settings.stack == "unsloth" and settings.quant == "nf4" and spec.prequantized is None:
        return unsloth_dynamic_copy(spec) or spec
    return spec


# --- the sum ------------------------------------------------------------------------------------------------
def breakdown(
    spec: ModelSpec, settings: Settings, runtime: Runtime = Runtime(), gpu_bytes: float | None = None
) -> tuple[dict[str, float], str]:
    """Bytes per GPU of each part alive at the peak, and which phase the peak is in; `gpu_bytes`, the GPU's
    memory, where a loss sizes its chunks by what is free (Unsloth's)."""
    w_share, g_share, o_share = shard_factors(settings)
    weights_host, grads_host, optimizer_host = on_host(settings)  # offloaded: in host RAM, not on the GPU
    g_share, o_share = (0.0 if grads_host else g_share), (0.0 if optimizer_host else o_share)
    # (with Unsloth's per-layer rotary caches where the run's versions built them: resident from the load on)
    weights = sharded_weight_bytes(spec, settings, runtime) + rope_cache_bytes(spec, settings, runtime)
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
    backward = recompute_bytes if settings.grad_ckpt else grad_buffer_bytes
    # the last layer can be another shape than the first (Gemma 4's is a global-attention layer: gemma4.py)
    layer_backward, last_backward = backward(spec, settings, runtime), backward(last_layer(spec), settings, runtime)
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
            static + grads_at_top + layer_activations + last_backward + dequant,
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
    if saved_module_params(spec, settings):  # train_embeddings: every gradient made, the embedding's last
        at_embeddings = gradients + embedding_backward_bytes(spec, settings, runtime) * g_share
        phases["embeddings backward"] = (static + at_embeddings, at_embeddings, 0.0)
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
    backward_now = {"backward through the last layers": last_backward}.get(phase, layer_backward)
    backward_now = backward_now if phase.startswith("backward") else 0.0
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
    (or `runtime`, where a caller describes a step itself), of the checkpoint the stack loads (as_loaded)."""
    spec = as_loaded(spec, settings)
    runtime = runtime or stack_runtime(settings)
    gpu_bytes = gpu.memory_gib * GIB if gpu else None
    parts, phase = breakdown(spec, settings, runtime, gpu_bytes)
    transient = transient_bytes(spec, settings, runtime, gpu_bytes)
    paged_state = optimizer_bytes(spec, settings, runtime) * shard_factors(settings)[2] if paged(settings) else 0.0
    peak = StepPeak(
        parts,
        phase,
        transient,
        paged_state,
        trainable=trainable_params(spec, settings),
        total=spec.num_params,
        host_ram=host_ram_parts(spec, settings, runtime),
        loading_bytes=gpu_loading_bytes(spec, settings, runtime),
    )
    return assemble(peak, settings, runtime, gpu, headroom)


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


@dataclass(frozen=True)
class StepPeak:
    """What a step's peak is made of, in bytes, counted by the analytic estimate or the `--exact` trace:
    the allocated parts at the peak phase, the largest transient block, the paged optimizer states, the host
    RAM parts one machine needs, the trace's caching allocator simulation (None: modelled), and the whole base
    on the GPU while it loads before it is sharded (0: not loaded whole)."""

    parts: dict[str, float]
    phase: str
    transient_bytes: float
    paged_state_bytes: float
    trainable: int
    total: int
    host_ram: dict[str, float] | None = None
    simulated_reserved: float | None = None
    loading_bytes: float = 0.0


def assemble(peak: StepPeak, settings: Settings, runtime: Runtime, gpu: GpuSpec | None, headroom: float) -> Estimate:
    """An Estimate from a step's peak: the device side and the verdict added the same way for the analytic
    estimate and the `--exact` trace."""
    parts, paged_state_bytes, host_ram = peak.parts, peak.paged_state_bytes, peak.host_ram
    allocated = sum(parts.values())
    reserved, device = device_side(
        allocated,
        peak.transient_bytes,
        settings,
        runtime,
        paged_state_bytes,
        reserved=peak.simulated_reserved,
        kept_from_loading=peak.loading_bytes,
    )
    breakdown_gib = {name: round(gib(value), 4) for name, value in parts.items() if value > 0}
    breakdown_gib["allocator_reserve"] = round(gib(reserved - allocated), 4)
    breakdown_gib["cuda_context"] = round(gib(device - reserved - paged_state_bytes), 4)
    if paged_state_bytes:
        breakdown_gib["paged_optimizer_states"] = round(gib(paged_state_bytes), 4)
    # loading: the whole base on the GPU before it is sharded, with the CUDA context (gpu_loading_bytes)
    loading = peak.loading_bytes + runtime.cuda_context_gib * GIB if peak.loading_bytes else None
    usable = gpu.usable_gib(headroom) if gpu else None
    return Estimate(
        peak_allocated_gib=round(gib(allocated), 4),
        peak_reserved_gib=round(gib(reserved), 4),
        peak_device_gib=round(gib(device), 4),
        breakdown_gib=breakdown_gib,
        peak_phase=peak.phase,
        gpu_memory_gib=gpu.memory_gib * gpu.usable_fraction if gpu else None,
        headroom=headroom,
        fits=None if usable is None else gib(max(device, loading or 0.0)) <= usable,
        trainable_params=peak.trainable,
        total_params=peak.total,
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
    kept_from_loading: float = 0.0,
) -> tuple[float, float]:
    """(reserved, device) bytes for an allocated peak: the same device-side model for the analytic estimate
    and the `--exact` trace (whose `reserved` comes from its allocator simulation; never below allocated).

    `kept_from_loading`: a quantised base loaded whole onto the GPU and sharded after (gpu_loading_bytes). The
    shard frees the whole tensors into PyTorch's cache and nothing empties it before the step (the HF Trainer
    empties it at the start of its loop, before the engine shards the model, and after that only with
    torch_empty_cache_steps; DeepSpeed's engine only when it offloads states), so the cache stays at least that
    large while the step runs in it."""
    if reserved is None:
        reserved = reserved_bytes(allocated_bytes, transient_bytes, settings)
    else:  # the simulation's two same-shaped steps, plus what a run strands beyond them
        reserved = max(reserved, allocated_bytes) + unsimulated_reserve_bytes(settings)
    reserved = max(reserved, allocated_bytes, kept_from_loading)
    return reserved, device_bytes(reserved, settings, runtime, paged_state_bytes)
