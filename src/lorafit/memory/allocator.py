"""The device side: PyTorch's caching allocator's reserve above the allocated peak, the CUDA context and
NCCL, which together make what nvidia-smi shows."""

from __future__ import annotations

from typing import NamedTuple

from lorafit.memory.activations import dequant_bytes, optimizer_step_temp_bytes, recompute_bytes
from lorafit.memory.loss import logits_bytes
from lorafit.memory.runtime import Runtime
from lorafit.memory.weights import world_size
from lorafit.models import ModelSpec
from lorafit.schema import Settings
from lorafit.units import BYTES_PER_GIB as GIB


# --- device side --------------------------------------------------------------------------------------------
class ReserveFit(NamedTuple):
    """reserved - allocated = transient_share x transient + allocated_share x allocated + fixed_bytes."""

    transient_share: float
    allocated_share: float
    fixed_bytes: float


# Fitted by `make bench-allocator` (bench/allocator_fit.py --quick, bench/results/allocator-fit.json) to the
# simulated caching allocator (trace.allocator) over full-depth traces of 72 steps: Llama-2-7B, Llama-3.1-8B,
# Mistral-7B, Qwen2.5-7B x QLoRA/LoRA/full x 1x512, 2x2048, 4x4096 tokens x checkpointing on/off. No measured
# row was used. Error against the simulated reserved: plain mean 3.2 %, worst 10.7 %; expandable mean 1.2 %,
# worst 9.9 % (the worst are checkpointed steps with a small allocated peak and large logits: how much of the
# loss's blocks the recomputed layers reuse depends on their exact sizes, which no closed form in these terms
# follows). `--exact` uses the simulation itself, not this fit.
RESERVE_FIT = ReserveFit(transient_share=0.27, allocated_share=0.0125, fixed_bytes=0.60 * GIB)
# expandable_segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): one growing segment per pool mapped in
# 2 MiB / 20 MiB pages, so a free tail serves any size; the holes inside it remain. Fitted without a fixed term
# (with one it comes out at -0.12 GiB and fits no better).
EXPANDABLE_RESERVE_FIT = ReserveFit(transient_share=0.20, allocated_share=0.013, fixed_bytes=0.0)
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
