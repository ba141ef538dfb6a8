"""Time of the bytes a step moves beyond the GPU's own compute: the savers' copies over the host link, a paged
optimizer's migrations, the collectives of several GPUs and the offloads' copies and CPU step, and what the
optimizer step moves per parameter (which lorafit.timing also streams on the GPU). lorafit.timing adds them to
its micro-batches (step_time); these are its host and multi-GPU side, kept apart so each reads on its own.
"""

from __future__ import annotations

from lorafit import hardware, memory
from lorafit.hardware import GpuSpec
from lorafit.models import ModelSpec
from lorafit.schema import Settings
from lorafit.units import DTYPE_BYTES

# --- host copies --------------------------------------------------------------------------------------------
# offload_activations copies with torch.autograd.graph.save_on_cpu(pin_memory=True): both copies are queued on
# the compute stream, so the GPU runs them between its kernels instead of beside them. None of the transfer is
# hidden behind compute (OFFLOAD_OVERLAP 0): the cost is the whole transfer at the link's copy rate.
OFFLOAD_OVERLAP = 0.0
# Pinned copies reach about 80% of the link's rate (CUDA's bandwidthTest on PCIe 4.0 x16: ~25-26 GB/s of 31.5):
# a typical figure for large copies, not one measured by this project.
HOST_COPY_EFFICIENCY = 0.8
# A GPU whose catalog entry gives no host link (a plan saved before the field existed): PCIe 3.0 x16, the
# slowest link of the catalog's cards.
DEFAULT_HOST_LINK_GBS = 15.75


def host_link_bytes_per_second(gpu: GpuSpec) -> float:
    """The rate pinned copies between host memory and this GPU reach: its host link at HOST_COPY_EFFICIENCY."""
    return (gpu.host_link_gbs or DEFAULT_HOST_LINK_GBS) * 1e9 * HOST_COPY_EFFICIENCY


def host_copy_seconds(spec: ModelSpec, settings: Settings, gpu: GpuSpec, compute_seconds: float) -> float:
    """Time the host-memory savers add to one micro-batch.

    offload_activations: every layer's checkpointed input (N x h x c) goes to host memory in forward and back in
    backward, 2 x L x N x h x c bytes; what is not overlapped with the micro-batch's compute is added
    (max(0, transfer - OFFLOAD_OVERLAP x compute)). offload_embeddings: the N rows gathered on the CPU come over
    once (N x h x c), a copy too small to hide or to matter."""
    c = DTYPE_BYTES[settings.precision]
    row_bytes = c * spec.hidden_size * settings.tokens_per_micro_batch
    rate = host_link_bytes_per_second(gpu)
    seconds = 0.0
    runtime = memory.stack_runtime(settings)
    # Unsloth's checkpointing copies the layer inputs out and back on a side stream the same way
    unsloth = runtime.offloaded_checkpoints and memory.unsloth_offloads(spec, settings)
    if (settings.offload_activations or unsloth) and settings.grad_ckpt:
        transfer = 2 * spec.num_hidden_layers * row_bytes / rate
        seconds += max(0.0, transfer - OFFLOAD_OVERLAP * compute_seconds)
    if memory.offloaded_embedding_bytes(spec, settings, runtime):
        seconds += row_bytes / rate
    return seconds


# Gradient clipping (max_grad_norm 1.0, the HF Trainer's and lorafit's default) reads every gradient for the
# norm and reads and writes it again to scale it: three passes over the gradients.
CLIP_GRADIENT_PASSES = 3


def optimizer_traffic_bytes(settings: Settings, runtime: memory.Runtime, param_bytes: float | None = None) -> float:
    """Bytes the optimizer step moves per trainable parameter, p the parameter's bytes, g the gradient's, s one
    moment's, counted from the kernels each implementation runs:

    fused AdamW (adamw_torch_fused, bitsandbytes' 8-bit and paged kernels, DeepSpeed's): one kernel reads p, g
    and both moments and writes p and both moments, 2p + g + 4s.
    torch's default multi-tensor AdamW (foreach, when `fused` is not set): weight decay on p (read, write), lerp
    of the first moment (read m and g, write m), the second moment scaled (read, write) and addcmul'd (read v and
    g twice, write v), its square root into a temporary (read v, write t), divided and shifted by eps (two
    read-writes of t), and addcdiv into p (read p, m, t, write p): 4p + 3g + 12s.
    SGD without momentum: read p and g, write p. Plus gradient clipping, CLIP_GRADIENT_PASSES x g.

    bitsandbytes' 32-bit optimizers keep fp32 moments whatever the parameter's dtype (get_state_buffer); its
    8-bit ones one byte a moment. ZeRO steps an fp32 master copy with fp32 moments and writes the 16-bit
    parameter back (2 more bytes). `param_bytes`: a parameter of another dtype than the adapters' (the copies
    train_embeddings trains, memory.saved_module_dtype_bytes)."""
    p = g = param_bytes or memory.trainable_dtype_bytes(settings, runtime)
    cast_back = 0.0
    if settings.shard in ("zero2", "zero3"):
        p, cast_back = 4, DTYPE_BYTES[settings.precision]
    clip = CLIP_GRADIENT_PASSES * g
    if settings.optimizer == "sgd":
        return 2 * p + g + cast_back + clip
    s = 1 if settings.optimizer.endswith("8bit") else (4 if settings.optimizer == "paged_adamw_32bit" else p)
    fused = runtime.fused_optimizer or settings.optimizer != "adamw" or settings.shard in ("zero2", "zero3")
    step = 2 * p + g + 4 * s if fused else 4 * p + 3 * g + 12 * s
    return step + cast_back + clip


def paging_seconds(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> float:
    """A paged optimizer whose states do not fit beside the rest of the step (bitsandbytes keeps them in CUDA
    managed memory) has the part that does not fit migrated in before its update and evicted after it, every
    step: twice the overflow over the host link. Zero when everything fits, or for other optimizers."""
    if not memory.paged(settings):
        return 0.0
    estimate = memory.estimate(spec, settings, gpu)
    gib = 1024**3
    runtime = memory.stack_runtime(settings)
    paged_state = memory.optimizer_bytes(spec, settings, runtime) * memory.shard_factors(settings)[2]
    overflow = min(max(0.0, (estimate.peak_device_gib - gpu.memory_gib) * gib), paged_state)
    return 2 * overflow / host_link_bytes_per_second(gpu)


# --- several GPUs: communication and offload ----------------------------------------------------------------
# NCCL's ring collectives reach about 75-80% of a link's rate as bus bandwidth for large messages (nccl-tests'
# all_reduce_perf on 8 A100 SXM: ~230 of 300 GB/s per direction): a typical figure, not measured by this project.
COLLECTIVE_EFFICIENCY = 0.75
# The share of a micro-batch's compute the engine hides its communication behind. DDP and ZeRO-2 reduce gradient
# buckets while backward goes on (backward and recomputation are about 3/4 of a LoRA step's compute), the last
# bucket after it; ZeRO-3 and FSDP prefetch the next layer's gather during forward and backward. Chosen from how
# the engines schedule their collectives, not fitted to a measurement.
COMM_OVERLAP = {"none": 0.0, "ddp": 0.7, "zero2": 0.7, "zero3": 0.9, "fsdp": 0.9}
# Host memory bandwidth the CPU optimizer step streams its states at, shared by a node's processes: about a
# quarter of an 8-channel DDR5-4800 server socket's 307 GB/s peak (8 x 38.4 GB/s), as DeepSpeed's CPU Adam
# (AVX512, one thread per core) reaches on large tensors. A typical figure, not measured by this project.
HOST_MEMORY_GBS = 80.0


def collective_bytes_per_second(settings: Settings, gpu: GpuSpec) -> float:
    """Bus bandwidth of the run's collectives: a ring runs at the slowest link it crosses, inside a machine
    (NVLink, PCIe peer-to-peer, or through host memory) and, over several machines, each machine's network
    (catalog/interconnects.toml)."""
    within, between = hardware.links_of(gpu)
    rate = within.gbs_for(gpu) if settings.n_gpus > 1 else float("inf")
    if settings.nodes > 1:
        rate = min(rate, between.gbs_for(gpu))
    return rate * 1e9 * COLLECTIVE_EFFICIENCY


def communication_bytes(spec: ModelSpec, settings: Settings) -> tuple[float, float]:
    """(bytes per micro-batch, bytes per optimizer step) each GPU sends in the run's collectives.

    A ring all-gather or reduce-scatter of S bytes moves (n-1)/n x S per GPU, an all-reduce twice that (ZeRO,
    Rajbhandari et al. 2020, section 7). With Psi the bytes of the parameters:
    DDP all-reduces the gradients once an optimizer step (no_sync during accumulation): 2 Psi_grad.
    ZeRO-2 reduce-scatters the gradients every micro-batch and all-gathers the updated trainable parameters once
    a step: 2 Psi for full fine-tuning.
    ZeRO-3 / FSDP all-gather every layer in forward and again in backward (resharded after forward) and
    reduce-scatter its gradients every micro-batch: 3 Psi. For LoRA and QLoRA the gathers move the whole frozen
    base (packed 4-bit bytes for QLoRA) and the reductions only the adapters' gradients."""
    n = memory.world_size(settings)
    if n == 1:
        return 0.0, 0.0
    runtime = memory.stack_runtime(settings)
    ring = (n - 1) / n
    trainable = memory.trainable_params(spec, settings)
    grads = trainable * memory.trainable_dtype_bytes(settings, runtime)
    if settings.shard in ("none", "ddp"):
        return 0.0, 2 * ring * grads
    if settings.shard == "zero2":
        return ring * grads, ring * trainable * DTYPE_BYTES[settings.precision]
    params = memory.gathered_param_bytes(spec, settings, runtime)
    return ring * (2 * params + grads), 0.0


def offload_seconds(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> tuple[float, float]:
    """(seconds per micro-batch, seconds per optimizer step) the offload adds to one GPU, before overlap.

    offload params: each micro-batch copies the GPU's parameter shard in from host memory for the forward
    gather and again for the backward one (2 x Psi / n over the card's PCIe link). Either offload: once a step
    the gradient shard goes out and the updated trainable shard comes back over PCIe, and the CPU steps the shard,
    moving what the same optimizer moves on a GPU (optimizer_traffic_bytes): ZeRO-Offload's fp32 master copy
    and moments; under FSDP's CPU offload, torch's AdamW on the parameters in their own dtype, whose moments it
    makes in that dtype (torchtune's bf16 full fine-tune keeps no fp32 copy). At the host memory bandwidth
    every process of the machine shares."""
    offload = memory.offload_of(settings)
    if offload == "none":
        return 0.0, 0.0
    runtime = memory.stack_runtime(settings)
    n = memory.world_size(settings)
    pcie = host_link_bytes_per_second(gpu)
    per_micro = 0.0
    if offload == "params":
        per_micro = 2 * memory.gathered_param_bytes(spec, settings, runtime) / n / pcie
    shard = memory.trainable_params(spec, settings) / n
    copies = shard * (memory.trainable_dtype_bytes(settings, runtime) + DTYPE_BYTES[settings.precision]) / pcie
    cpu_step = settings.n_gpus * shard * optimizer_traffic_bytes(settings, runtime) / (HOST_MEMORY_GBS * 1e9)
    return per_micro, copies + cpu_step
