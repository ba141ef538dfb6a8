"""The time model: how long one optimizer step takes on a GPU, hence the run's throughput, hours and cost.

A step is its micro-batches' compute (FLOPs at a measured share of the GPU's dense throughput), the host copies
of the savers that use the host link, what the engine cannot hide of its collectives and offload copies, and the
optimizer step. The planner (lorafit.plan) compares candidates by `tokens_per_second`; `make bench-throughput`
prints its predictions beside published runs. Pure Python, like the memory model it sits beside.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorafit import hardware, memory
from lorafit.hardware import GpuSpec
from lorafit.models import ModelSpec
from lorafit.schema import Settings
from lorafit.units import DTYPE_BYTES

# --- one micro-batch on one GPU ---------------------------------------------------------------------------
# Utilisation of the GPU's dense tensor throughput by the Hugging Face stack, as a function of tokens per
# micro-batch (small matmuls leave the GPU idle): MAX_MFU x N / (N + HALF_TOKENS). Calibrated on published HF
# Trainer runs (shared/calibration rows FMS-01..07, Mistral-7B on an A100, 16-32k tokens per micro-batch: 60-62%)
# and Qwen's seq-len sweep (QW-09..13: 256 tokens run at 55% of the 8k rate); `make bench-throughput` prints the
# predicted and published tokens/s side by side.
MAX_MFU = 0.62
HALF_TOKENS = 200
# LoRA skips the weight-gradient matmuls of the base, but its fp32 adapter path (input casts, dropout, small
# matmuls) costs about as much again: FMS-03 (LoRA) runs only 9% faster than FMS-01 (full) at the same batch.
LORA_BACKWARD_PASSES = 0.75
# bitsandbytes' 4-bit matmul (dequantise, then a bf16 matmul, in forward and backward) slows a step by ~13%
# (FMS-06/07 vs FMS-03/04, same batch): more than its memory traffic alone explains, so it is a measured factor.
QLORA_SLOWDOWN = 1.13
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


# --- time ---------------------------------------------------------------------------------------------------
def flops_per_token(spec: ModelSpec, settings: Settings) -> float:
    """Training FLOPs per token: 2 x active matmul parameters per forward pass, plus causal attention.

    Backward costs one forward for the input gradients and, training the weights (full), one more for the weight
    gradients (LoRA: see LORA_BACKWARD_PASSES); checkpointing recomputes the forward once."""
    matmul_params = (
        spec.active_params
        - spec.embedding_params
        + (spec.vocab_size * spec.hidden_size if spec.tie_word_embeddings else 0)
    )
    forward = 2 * matmul_params + 2 * settings.seq_len * spec.q_size * spec.num_hidden_layers
    passes = 3.0 if settings.method == "full" else 2.0 + LORA_BACKWARD_PASSES
    if settings.grad_ckpt:
        passes += 1.0
    return forward * passes + chunked_loss_flops_per_token(spec, settings)


def chunked_loss_flops_per_token(spec: ModelSpec, settings: Settings) -> float:
    """The chunked loss runs the LM head's forward again in backward: 2 x V x h more FLOPs per token."""
    return 2 * spec.vocab_size * spec.hidden_size if settings.loss == "chunked" else 0.0


def mfu(tokens_per_micro_batch: int) -> float:
    """The share of the GPU's dense throughput a micro-batch of this many tokens reaches: small matmuls leave
    the GPU idle, so the share grows with the tokens towards MAX_MFU (half of it at HALF_TOKENS)."""
    return MAX_MFU * tokens_per_micro_batch / (tokens_per_micro_batch + HALF_TOKENS)


def step_seconds(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> float:
    """One micro-batch on one GPU at the utilisation above; 4/8-bit bases pay the bitsandbytes factor, the
    savers that copy over the host link pay their copies."""
    tokens = settings.tokens_per_micro_batch
    compute = flops_per_token(spec, settings) * tokens / (gpu.tflops(settings.precision) * 1e12 * mfu(tokens))
    compute *= QLORA_SLOWDOWN if settings.quant != "none" else 1.0
    return compute + host_copy_seconds(spec, settings, gpu, compute)


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
    if settings.offload_activations and settings.grad_ckpt:
        transfer = 2 * spec.num_hidden_layers * row_bytes / rate
        seconds += max(0.0, transfer - OFFLOAD_OVERLAP * compute_seconds)
    if memory.offloaded_embedding_bytes(spec, settings, memory.stack_runtime(settings)):
        seconds += row_bytes / rate
    return seconds


# Bytes the optimizer step reads and writes per trainable parameter: parameter, gradient and two moments.
OPTIMIZER_TRAFFIC_BYTES = {"adamw": 24, "paged_adamw_32bit": 24, "adamw_8bit": 12, "paged_adamw_8bit": 12, "sgd": 8}


def optimizer_seconds(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> float:
    """The optimizer step is memory-bound: it streams every trainable parameter's state once."""
    trainable = (
        spec.num_params if settings.method == "full" else spec.lora_params(settings.lora_r, settings.lora_targets)
    )
    return trainable * OPTIMIZER_TRAFFIC_BYTES[settings.optimizer] / (gpu.bandwidth_gbs * 1e9)


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
    the gradient shard goes out and the updated trainable shard comes back over PCIe, and the CPU steps the
    shard's fp32 states (16 bytes a parameter, read and written), at the host memory bandwidth every process
    of the machine shares."""
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
    cpu_step = settings.n_gpus * shard * 2 * memory.HOST_OPTIMIZER_BYTES_PER_PARAM / (HOST_MEMORY_GBS * 1e9)
    return per_micro, copies + cpu_step


@dataclass(frozen=True)
class StepTime:
    """One optimizer step on one GPU, in seconds, and what it is made of."""

    compute: float  # the micro-batches' compute, savers' host copies included
    communication: float  # the collectives not hidden behind compute
    offload: float  # the offload copies and the CPU step not hidden
    optimizer: float  # the optimizer step on the GPU
    micro_batches: float  # micro-batches each GPU runs a step

    @property
    def total(self) -> float:
        """The step's wall time: its parts do not overlap once each is counted as what is not hidden."""
        return self.compute + self.communication + self.offload + self.optimizer


def step_time(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> StepTime:
    """Compute, plus what the engine cannot hide of its communication and offload copies (COMM_OVERLAP of each
    micro-batch's compute hides the per-micro-batch part; the per-step part overlaps the last micro-batch's
    backward), plus the optimizer step. Over several nodes each GPU runs grad_accum / nodes micro-batches."""
    micro = step_seconds(spec, settings, gpu)
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
        optimizer=optimizer * memory.shard_factors(settings)[2],
        micro_batches=micro_batches,
    )


def tokens_per_second(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> float:
    """Whole-job throughput: every GPU's micro-batches of an optimizer step over the step's time (step_time)."""
    step = step_time(spec, settings, gpu)
    return memory.world_size(settings) * step.micro_batches * settings.tokens_per_micro_batch / step.total


# --- cost ---------------------------------------------------------------------------------------------------
def costs(
    gpu: GpuSpec | None, n_gpus: int, hours: float, kwh_price: float
) -> tuple[float | None, float | None, float | None]:
    """Renting vs owning: cloud price per hour, or board power x hours x electricity; break-even in runs."""
    if gpu is None:
        return None, None, None
    cloud = hours * gpu.rent_usd_per_hour * n_gpus if gpu.rent_usd_per_hour is not None else None
    local = hours * gpu.board_power_w / 1000 * kwh_price * n_gpus
    break_even = None
    if cloud is not None and gpu.price_usd and cloud > local:
        break_even = gpu.price_usd * n_gpus / (cloud - local)
    return cloud, local, break_even


def time_and_cost(
    gpu: GpuSpec | None, n_gpus: int, speed: float, total_tokens: float, kwh_price: float
) -> dict[str, float | None]:
    """The Plan's speed, hours and costs for `total_tokens` at `speed` tokens/s, rounded as a Plan shows them."""
    hours = total_tokens / speed / 3600 if speed else 0.0
    cloud, local, break_even = costs(gpu, n_gpus, hours, kwh_price)
    return {
        "tokens_per_s": round(speed, 1),
        "hours": round(hours, 3),
        "cost_cloud_usd": None if cloud is None else round(cloud, 2),
        "cost_local_usd": None if local is None else round(local, 2),
        "break_even_runs": None if break_even is None else round(break_even, 1),
    }
