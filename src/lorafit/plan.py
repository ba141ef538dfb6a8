"""The planner: search the settings for the fastest step that fits, then time and cost the whole run.

Every candidate is priced by `memory.estimate` (memory) and `step_seconds` (time); the plan explains each choice
with the numbers that forced it. When nothing fits, it says so and finds the smallest changes that do.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

from lorafit import hardware, memory, options, serving, stacks
from lorafit.errors import LorafitError
from lorafit.hardware import GpuSpec
from lorafit.memory import estimate
from lorafit.models import ModelSpec
from lorafit.schema import Estimate, Plan, PlanRequest, Settings, Suggestion
from lorafit.units import DTYPE_BYTES, gib

# A run when the user gives no data: Alpaca-sized (52k rows of ~300 tokens), three epochs.
DEFAULT_TOKENS_PER_EPOCH = 15_000_000
DEFAULT_SEQ_LEN = options.DEFAULT_SEQ_LEN

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
    return MAX_MFU * tokens_per_micro_batch / (tokens_per_micro_batch + HALF_TOKENS)


def step_seconds(spec: ModelSpec, settings: Settings, gpu: GpuSpec) -> float:
    """One micro-batch on one GPU at the utilisation above; 4/8-bit bases pay the bitsandbytes factor, the
    savers that copy over the host link pay their copies."""
    tokens = settings.tokens_per_micro_batch
    compute = flops_per_token(spec, settings) * tokens / (gpu.tflops(settings.precision) * 1e12 * mfu(tokens))
    compute *= QLORA_SLOWDOWN if settings.quant != "none" else 1.0
    return compute + host_copy_seconds(spec, settings, gpu, compute)


def host_link_bytes_per_second(gpu: GpuSpec) -> float:
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


# --- search -------------------------------------------------------------------------------------------------
@dataclass
class Candidate:
    """One searched configuration. Its speed is worked out when first asked for: the search only compares the
    speeds of the candidates that fit."""

    settings: Settings
    estimate: Estimate
    speed: Callable[[], float] = field(repr=False, compare=False)

    @cached_property
    def tokens_per_s(self) -> float:
        return self.speed()


OPTIMIZERS = {
    "full": ["adamw", "adamw_8bit", "paged_adamw_8bit"],
    "lora": ["adamw", "paged_adamw_8bit"],
    "qlora": ["adamw", "paged_adamw_8bit"],
}


def _micro_batches(batch_size: int, n_gpus: int) -> list[int]:
    """Micro-batches that divide the per-GPU share of the effective batch, largest first."""
    per_gpu = max(batch_size // n_gpus, 1)
    return [b for b in range(per_gpu, 0, -1) if per_gpu % b == 0 and (b & (b - 1) == 0 or b == per_gpu)]


SAVERS = tuple(options.SAVER_ON)
SAVER_ON = options.SAVER_ON


def savers_on(settings: Settings) -> list[str]:
    """The memory savers these settings turn on, in SAVERS order."""
    return [name for name in SAVERS if getattr(settings, name) == SAVER_ON[name]]


def saver_choices(fixed: dict, spec: ModelSpec, gpu: GpuSpec | None, on_cpu: bool) -> dict[str, list]:
    """The values the search tries for each saver not set: off, and on where it can apply. Without a GPU the
    savers stay off; the host-memory and allocator savers need a CUDA card (Apple's memory is the host's)."""
    off = {name: options.BY_NAME[name].default for name in SAVERS}
    cuda = gpu is not None and gpu.kind != "apple" and not on_cpu
    has = stacks.resolve(fixed.get("stack") or options.BY_NAME["stack"].default).savers
    applies = {
        "loss": gpu is not None,
        "offload_embeddings": cuda and fixed["method"] != "full" and not spec.tie_word_embeddings,
        "offload_activations": cuda,
        "expandable_segments": cuda,
    }
    applies = {name: can and name in has for name, can in applies.items()}  # only the stack's own switches
    return {
        name: [fixed.pop(name)] if name in fixed else [off[name], SAVER_ON[name]] if applies[name] else [off[name]]
        for name in SAVERS
    }


def candidates(
    request: PlanRequest,
    gpu: GpuSpec | None,
    seq_len: int,
    n_gpus: int = 1,
    shard: str = "none",
    method: str | None = None,
    offload: str = "none",
) -> list[Candidate]:
    """Every combination of the free settings, the memory savers among them, each with its estimate and speed.
    A pinned shard or offload wins over the one asked for; an offload without a shard that has one runs
    ZeRO-3 (ZeRO-Offload on one GPU)."""
    method = method or request.method
    pinned = dict(request.pinned)
    pinned.pop("method", None)
    if method != request.method:
        pinned.pop("quant", None)  # a suggested method brings its own base
        if method == "full":
            pinned.pop("offload_embeddings", None)  # full fine-tuning trains the embeddings
    offload = pinned.pop("offload", offload)
    shard = pinned.pop("shard", "zero3" if offload != "none" and shard not in options.SHARDED_SHARDS else shard)
    if n_gpus * pinned.get("nodes", 1) == 1 and offload == "none":
        shard = "none"  # one bigger card for a run pinned to several: nothing to split
    fixed: dict[str, Any] = {"method": method, "seq_len": seq_len, "n_gpus": n_gpus, "shard": shard, "offload": offload}
    fixed |= pinned
    on_cpu = request.device == "cpu"
    fixed |= options.step_defaults(fixed, request.model, gpu, on_cpu=on_cpu)
    free_ckpt = [fixed.pop("grad_ckpt")] if "grad_ckpt" in fixed else [False, True]
    # an offloaded optimizer steps on the CPU with 32-bit AdamW (options: _offload_steps_adamw)
    free_opt = (
        [fixed.pop("optimizer")] if "optimizer" in fixed else OPTIMIZERS[method] if offload == "none" else ["adamw"]
    )
    free_savers = saver_choices(fixed, request.model, gpu, on_cpu)
    batch_size = request.effective_batch
    batches = [fixed.pop("micro_batch")] if "micro_batch" in fixed else _micro_batches(batch_size, n_gpus)
    pinned_accum = fixed.pop("grad_accum", None)
    found = []
    for micro_batch in batches:
        accum = pinned_accum or max(batch_size // (micro_batch * n_gpus), 1)
        for ckpt in free_ckpt:
            for optimizer in free_opt:
                step = {"micro_batch": micro_batch, "grad_accum": accum, "grad_ckpt": ckpt, "optimizer": optimizer}
                fitting: list[set[str]] = []
                for chosen in saver_sets(free_savers):
                    on = {name for name in SAVERS if chosen[name] == SAVER_ON[name]}
                    if chosen["offload_activations"] and not ckpt:
                        continue  # nothing checkpointed to offload
                    if any(subset <= on for subset in fitting):
                        continue  # fewer savers fit already: more only cost time
                    settings = Settings(**(fixed | chosen | step))
                    if on - set(pinned) and memory.host_saver_problem(request.model, settings, request.host_ram_gib):
                        continue  # the planner does not choose an offload the host RAM cannot hold
                    peak = estimate(request.model, settings, gpu, request.headroom)
                    speed = partial(tokens_per_second, request.model, settings, gpu) if gpu else float
                    found.append(Candidate(settings, peak, speed))
                    if peak.fits:
                        fitting.append(on)
    return found


def saver_sets(free_savers: dict[str, list]) -> list[dict[str, object]]:
    """Every combination of the savers' values, those with the fewest savers on first."""
    sets = [dict(zip(SAVERS, values, strict=True)) for values in itertools.product(*free_savers.values())]
    return sorted(sets, key=lambda chosen: sum(chosen[name] == SAVER_ON[name] for name in SAVERS))


# Speeds closer than this are equal for the time model: 8-bit optimizer states stream less memory, but that
# makes a LoRA step faster by well under 0.1%, which must not outweigh the preference for 32-bit AdamW.
SPEED_TIE = 0.01


def best(found: list[Candidate]) -> Candidate | None:
    """The fastest candidate that fits; among equals (within SPEED_TIE), the first optimizer of OPTIMIZERS (a
    pinned one outside that list after them), then the fewest memory savers (a saver is turned on only where it
    makes the step fit or faster), then the smallest peak."""
    fitting = [c for c in found if c.estimate.fits]
    if not fitting:
        return None
    preference = OPTIMIZERS[fitting[0].settings.method]
    fastest = max(c.tokens_per_s for c in fitting)
    equal = [c for c in fitting if c.tokens_per_s >= fastest * (1 - SPEED_TIE)]

    def rank(c: Candidate) -> tuple[int, int, float]:
        optimizer = c.settings.optimizer
        order = preference.index(optimizer) if optimizer in preference else len(preference)
        return (order, len(savers_on(c.settings)), c.estimate.peak_device_gib)

    return min(equal, key=rank)


def smallest(found: list[Candidate]) -> Candidate:
    return min(found, key=lambda c: c.estimate.peak_device_gib)


# --- explanations -------------------------------------------------------------------------------------------
def explain(chosen: Candidate, found: list[Candidate], gpu: GpuSpec, headroom: float, spec: ModelSpec) -> list[str]:
    """Plain words for each choice, with the number that forced it."""
    s, card = chosen.settings, gpu.usable_gib(headroom)
    reasons = [
        f"peak {chosen.estimate.peak_device_gib:.2f} GiB on the device (nvidia-smi) of {gpu.memory_gib:.1f} GiB; "
        f"{headroom:.0%} kept free leaves {card:.2f} GiB",
    ]
    if s.grad_ckpt:
        without = [c for c in found if not c.settings.grad_ckpt]
        if without:
            least = smallest(without)
            reasons.append(
                f"gradient checkpointing on: without it even micro-batch {least.settings.micro_batch} "
                f"needs {least.estimate.peak_device_gib:.1f} GiB and the card has {card:.1f}; it "
                "recomputes the forward pass in backward (about a third more compute)"
            )
    else:
        reasons.append("gradient checkpointing off: activations fit, so no forward pass is recomputed")
    bigger = [
        c
        for c in found
        if c.settings.micro_batch == 2 * s.micro_batch
        and c.settings.grad_ckpt == s.grad_ckpt
        and c.settings.optimizer == s.optimizer
        and savers_on(c.settings) == savers_on(s)
    ]
    accum = f"micro-batch {s.micro_batch} x gradient accumulation {s.grad_accum}"
    if s.n_gpus > 1:
        accum += f" x {s.n_gpus} GPUs"
    if bigger:
        need = smallest(bigger).estimate
        larger = f"micro-batch {2 * s.micro_batch}"
        larger += (
            f" fits too ({need.peak_device_gib:.1f} GiB) but runs no faster"
            if need.fits
            else f" would need {need.peak_device_gib:.1f} GiB"
        )
        reasons.append(f"{accum} = effective batch {s.effective_batch}: {larger}")
    else:
        reasons.append(f"{accum} = effective batch {s.effective_batch}")
    if s.optimizer != "adamw":
        full = [
            c
            for c in found
            if c.settings.optimizer == "adamw"
            and c.settings.micro_batch == s.micro_batch
            and c.settings.grad_ckpt == s.grad_ckpt
        ]
        adamw = f" (32-bit AdamW would need {smallest(full).estimate.peak_device_gib:.1f} GiB)" if full else ""
        reasons.append(f"optimizer {s.optimizer}: 8-bit states are a quarter of 32-bit ones{adamw}")
    reasons += explain_savers(chosen, found, gpu, spec)
    if s.method == "qlora":
        reasons.append(
            "QLoRA: the frozen base is stored in 4-bit NF4"
            f"{' with double quantisation' if s.double_quant else ''}; only LoRA adapters "
            f"(r={s.lora_r}, {s.lora_targets} linear layers) train, in fp32"
        )
    return reasons


def explain_savers(chosen: Candidate, found: list[Candidate], gpu: GpuSpec, spec: ModelSpec) -> list[str]:
    """One line per memory saver the plan turned on: what it moves or shrinks, what it costs, and what the same
    plan needs without it."""
    s = chosen.settings
    runtime = memory.stack_runtime(s)
    n = s.tokens_per_micro_batch
    lines = []
    for name in savers_on(s):
        off = s.model_copy(update={name: options.BY_NAME[name].default})
        twin = next((c for c in found if c.settings == off), None)
        without = f"; without it {twin.estimate.peak_device_gib:.2f} GiB" if twin else ""
        if name == "loss":
            full = memory.logits_bytes(spec, off, runtime)
            chunked = memory.chunked_loss_bytes(spec, s)
            extra = memory_cost_share(spec, s, off, gpu)
            lines.append(
                f"loss chunked: the LM head and fp32 cross-entropy run {memory.loss_chunk_tokens(s)} tokens at a "
                f"time, {gib(chunked):.2f} GiB instead of {gib(full):.2f} GiB of logits; the head runs again in "
                f"backward (+{extra:.1%} step time){without}"
            )
        elif name == "offload_embeddings":
            moved = memory.offloaded_embedding_bytes(spec, s, runtime)
            lines.append(
                f"offload_embeddings: the frozen input embedding ({gib(moved):.2f} GiB) stays in CPU RAM; each "
                f"micro-batch copies its {n:,} rows over{without}"
            )
        elif name == "offload_activations":
            host = memory.offloaded_activation_bytes(spec, s, runtime)
            extra = memory_cost_share(spec, s, off, gpu)
            lines.append(
                f"offload_activations: the {spec.num_hidden_layers} checkpointed layer inputs ({gib(host):.2f} GiB) "
                f"wait in pinned CPU RAM, {2 * host / 1e9:.2f} GB over the "
                f"{gpu.host_link_gbs or DEFAULT_HOST_LINK_GBS:g} GB/s host link per micro-batch "
                f"(+{extra:.1%} step time){without}"
            )
        elif name == "expandable_segments":
            plain = twin.estimate if twin else memory.estimate(spec, off)
            lines.append(
                "expandable_segments: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; the caching allocator keeps "
                f"{chosen.estimate.peak_reserved_gib - chosen.estimate.peak_allocated_gib:.2f} GiB above the "
                f"allocated peak instead of {plain.peak_reserved_gib - plain.peak_allocated_gib:.2f} GiB (its "
                f"simulation, not measured on a GPU){without}"
            )
    return lines


def explain_gpus(chosen: Candidate, gpu: GpuSpec, spec: ModelSpec) -> list[str]:
    """For several GPUs or an offload: what each GPU holds, what crosses which link, what the host needs."""
    s, e = chosen.settings, chosen.estimate
    if e.world_size == 1 and s.offload == "none":
        return []
    lines = []
    per_gpu = e.per_gpu_gib
    lines.append(
        f"{e.world_size} GPU(s), {SHARD_TITLES.get(s.shard, s.shard)}: each holds {per_gpu['sharded_weights']:.2f} "
        f"GiB of weights, {per_gpu['gradients']:.2f} GiB of gradients, {per_gpu['optimizer_states']:.2f} GiB of "
        f"optimizer states, {per_gpu['gathered_layers']:.2f} GiB of gathered layers"
    )
    if e.world_size > 1:
        within, between = hardware.links_of(gpu)
        link = within.title if s.nodes == 1 else f"{within.title} and {between.title}"
        per_micro, per_step = communication_bytes(spec, s)
        step = step_time(spec, s, gpu)
        moved = per_micro * step.micro_batches + per_step
        lines.append(
            f"communication: {moved / 1e9:.2f} GB per GPU per optimizer step over {link} "
            f"({collective_bytes_per_second(s, gpu) / 1e9:.1f} GB/s as NCCL runs it); "
            f"{step.communication / step.total:.0%} of the step waits for it"
        )
    if s.offload != "none":
        step = step_time(spec, s, gpu)
        host = sum(e.host_ram_breakdown_gib.get(part, 0.0) for part in ("offloaded_weights", "offloaded_optimizer"))
        lines.append(
            f"offload {s.offload}: {host:.1f} GiB in host RAM; the copies over PCIe and the CPU optimizer step "
            f"take {step.offload / step.total:.0%} of the step"
        )
    if e.host_ram_gib is not None:
        lines.append(f"host RAM: {e.host_ram_gib:.1f} GiB on each machine (the larger of loading and training)")
    return lines


def memory_cost_share(spec: ModelSpec, on: Settings, off: Settings, gpu: GpuSpec) -> float:
    """How much longer a micro-batch takes with a saver on than off."""
    return step_seconds(spec, on, gpu) / step_seconds(spec, off, gpu) - 1


# --- suggestions when nothing fits -------------------------------------------------------------------------
MIN_SUGGESTED_SEQ_LEN = 128


def shorter_lengths(seq_len: int) -> list[int]:
    """Lengths below `seq_len`, longest first: the powers of two and the halfway steps between them (1536,
    768, ...), down to 128."""
    lengths = set()
    power = MIN_SUGGESTED_SEQ_LEN
    while power < seq_len:
        lengths |= {power, power * 3 // 2}
        power *= 2
    return sorted((n for n in lengths if n < seq_len), reverse=True)


def suggestions(request: PlanRequest, gpu: GpuSpec, seq_len: int) -> list[Suggestion]:
    """The smallest changes that fit: a shorter sequence, QLoRA, a bigger GPU, or several GPUs sharded."""
    found: list[Suggestion] = []
    total_tokens = tokens_per_epoch(request) * request.epochs

    def suggest(change: str, fit: Candidate | None, on: GpuSpec = gpu) -> bool:
        if fit:
            s = fit.settings
            found.append(
                Suggestion(
                    change=change,
                    settings=s,
                    gpu=on.name,
                    estimate=fit.estimate,
                    n_gpus=s.n_gpus,
                    nodes=s.nodes,
                    shard=s.shard,
                    offload=s.offload,
                    tokens_per_s=round(fit.tokens_per_s, 1),
                    hours=round(total_tokens / fit.tokens_per_s / 3600, 3),
                )
            )
        return fit is not None

    for length in shorter_lengths(seq_len):
        if suggest(f"sequence length {length} instead of {seq_len}", best(candidates(request, gpu, length))):
            break
    if request.method != "qlora" and "quant" not in request.pinned:
        suggest(
            f"QLoRA (4-bit base) instead of {request.method}", best(candidates(request, gpu, seq_len, method="qlora"))
        )
    if request.method == "full":
        suggest("LoRA instead of full fine-tuning", best(candidates(request, gpu, seq_len, method="lora")))

    def size_then_price(g: GpuSpec) -> tuple[int, float, float]:
        return round(g.memory_gib / 8), g.rent_usd_per_hour or 1e9, g.price_usd or 1e9

    for bigger in sorted(hardware.catalog().values(), key=size_then_price):
        if bigger.kind == "apple" or bigger.memory_gib <= gpu.memory_gib:
            continue
        change = f"a GPU with more memory: {bigger.name} ({bigger.memory_gib:.0f} GiB)"
        if suggest(change, best(candidates(request, bigger, seq_len)), bigger):
            break
    for fit in fewest_gpus(request, gpu, seq_len):
        suggest(gpus_change(fit.settings, gpu, total_tokens / fit.tokens_per_s / 3600), fit)
    return found


# GPUs of one machine the suggestions try. One GPU with an offload (DeepSpeed's ZeRO-Offload) is estimated when
# asked for (--shard zero3 --offload ...) but not suggested: `lorafit train` launches DeepSpeed and FSDP only
# for several processes.
GPU_COUNTS = (2, 4, 8)
OFFLOADS = ("none", "optimizer", "params")  # fastest first
SHARD_TITLES = {"ddp": "DDP", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp": "FSDP"}
OFFLOAD_TITLES = {"optimizer": "the optimizer states", "params": "the parameters"}


def several_gpus_shard(request: PlanRequest) -> str:
    """The shard several GPUs run when none is pinned: ZeRO-3, or FSDP for a 4-bit base where the stack loads
    it whole onto every GPU under ZeRO-3 but in host memory under FSDP (lorafit's trainer), so that no GPU has
    to hold the whole base while it is loaded."""
    if "shard" in request.pinned:
        return request.pinned["shard"]
    quant = request.pinned.get("quant", options.default_quant(request.method))
    if quant != "nf4":
        return "zero3"
    probe = Settings(method=request.method, quant=quant, stack=request.pinned.get("stack", "lorafit"))
    whole_on_gpu = memory.stack_runtime(probe).quantized_whole_on_gpu
    return "fsdp" if "zero3" in whole_on_gpu and "fsdp" not in whole_on_gpu else "zero3"


def fewest_gpus(request: PlanRequest, gpu: GpuSpec, seq_len: int) -> list[Candidate]:
    """The fewest GPUs of this kind that fit, sharded with several_gpus_shard: the fewest without an offload
    and, where an offload to host memory fits on fewer, that one too (the first offload that fits at the
    smallest count: optimizer states before parameters, which cost more copies; FSDP offloads only both)."""
    pinned_offload = request.pinned.get("offload")
    shard = several_gpus_shard(request)
    # an offloaded optimizer steps 32-bit AdamW on the CPU: not tried for a pinned optimizer without a CPU step
    offloads: tuple[str, ...] = (
        OFFLOADS if request.pinned.get("optimizer", "adamw") in options.OFFLOAD_OPTIMIZERS else ("none",)
    )
    if shard == "fsdp":
        offloads = tuple(offload for offload in offloads if offload != "optimizer")
    found: list[Candidate] = []
    for n_gpus in (n for n in GPU_COUNTS if n >= request.n_gpus and request.effective_batch % n == 0):
        tried = [pinned_offload] if pinned_offload else list(offloads) if not found else ["none"]
        for offload in tried:
            if (n_gpus, offload) == (request.n_gpus, pinned_offload or "none"):
                continue  # the plan itself
            fit = best(candidates(request, gpu, seq_len, n_gpus=n_gpus, shard=shard, offload=offload))
            if fit:
                found.append(fit)
                break
        if found and found[-1].settings.offload == "none":
            break
    return found


def gpus_change(settings: Settings, gpu: GpuSpec, hours: float) -> str:
    """'2x RTX 4090 with FSDP and CPU offload of the parameters, 31.2 h'."""
    machines = f" on each of {settings.nodes} machines" if settings.nodes > 1 else ""
    change = f"{settings.n_gpus}x {gpu.name}{machines} with {SHARD_TITLES.get(settings.shard, settings.shard)}"
    if settings.offload != "none":
        change += f" and CPU offload of {OFFLOAD_TITLES[settings.offload]}"
    return f"{change}, {hours:.1f} h"


# --- the plan -----------------------------------------------------------------------------------------------
def resolve_seq_len(request: PlanRequest) -> int:
    """The user's length, else the data's longest row, else 2048; never past the model's maximum."""
    seq_len = request.seq_len or (request.tokens.max if request.tokens and request.tokens.max else DEFAULT_SEQ_LEN)
    request.model.check_seq_len(request.seq_len)
    return min(seq_len, request.model.max_position_embeddings)


def tokens_per_epoch(request: PlanRequest) -> int:
    if request.tokens_per_epoch:
        return request.tokens_per_epoch
    if request.tokens:
        return request.tokens.total_tokens
    return DEFAULT_TOKENS_PER_EPOCH


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


def automatic_choices(request: PlanRequest, settings: Settings) -> list[str]:
    """Plain words for the settings nobody set that follow from the model, the GPU or the device."""
    reasons = []
    if "attn" not in request.pinned and settings.attn != options.BY_NAME["attn"].default:
        reasons.append(f"attention {settings.attn}: {request.model.name} has no sdpa kernel in transformers")
    if "precision" not in request.pinned and settings.precision == "fp32" and request.device == "cpu":
        reasons.append("precision fp32: no GPU, training on the CPU (bf16 there runs ~20x slower)")
    elif "precision" not in request.pinned and settings.precision == "fp16" and request.gpu:
        reasons.append(f"precision fp16: the {request.gpu.name} has no bf16")
    return reasons


def serve_context(request: PlanRequest) -> int:
    """The context to size serving at: as set (past the model's maximum is an error), else the default capped at
    the model's maximum."""
    if "serve_context" in request.model_fields_set:
        return request.serve_context
    return min(request.serve_context, request.model.max_position_embeddings)


def make_plan(request: PlanRequest, truncated_rows: int | None = None) -> Plan:
    """The fastest settings that fit `request.gpu`, with time and cost, or the smallest changes that fit."""
    seq_len = resolve_seq_len(request)
    gpu = request.gpu
    if gpu is not None and request.rent_price is not None:  # the user's own price for this card
        gpu = gpu.model_copy(update={"rent_usd_per_hour": request.rent_price})
    options.check_against(
        request.pinned | {"method": request.method}, request.model, gpu, on_cpu=request.device == "cpu"
    )
    shard = several_gpus_shard(request) if request.n_gpus * request.pinned.get("nodes", 1) > 1 else "none"
    found = candidates(request, gpu, seq_len, n_gpus=request.n_gpus, shard=shard)
    chosen = best(found) if gpu else None
    reasons: list[str] = []
    extra: list[Suggestion] = []
    if chosen and gpu:
        reasons = explain(chosen, found, gpu, request.headroom, request.model)
        reasons += explain_gpus(chosen, gpu, request.model)
    elif gpu:
        chosen = smallest(found)
        reasons = [
            f"does not fit: even the smallest configuration needs {chosen.estimate.peak_device_gib:.1f} GiB "
            + (f"(with {', '.join(savers_on(chosen.settings))}) " if savers_on(chosen.settings) else "")
            + f"and {gpu.name} has {gpu.usable_gib(request.headroom):.1f} GiB after "
            f"{request.headroom:.0%} headroom"
        ]
        sharded = chosen.settings.model_copy(update={"n_gpus": 2, "shard": several_gpus_shard(request)})
        runtime = memory.stack_runtime(sharded)
        loading = gib(memory.gpu_loading_bytes(request.model, sharded, runtime))
        if loading and loading + runtime.cuda_context_gib > gpu.usable_gib(request.headroom):
            fsdp_loads_on_host = "fsdp" not in runtime.quantized_whole_on_gpu
            instead = "--shard fsdp" if fsdp_loads_on_host else "--stack lorafit (FSDP)"
            shards = SHARD_TITLES[sharded.shard] if fsdp_loads_on_host else "FSDP or ZeRO-3"
            reasons.append(
                f"several {gpu.name}s do not help {chosen.settings.stack}'s trainer with {shards}: it loads the "
                f"{chosen.settings.quant} base whole ({loading:.1f} GiB) onto every GPU before sharding it; "
                f"{instead} loads it in host memory and moves it to the GPUs a sharded layer at a time"
            )
        extra = suggestions(request, gpu, seq_len)
    else:
        modest = [c for c in found if c.settings.micro_batch <= 4] or found
        chosen = max(
            modest, key=lambda c: (c.settings.grad_ckpt, c.settings.optimizer == "adamw", c.settings.micro_batch)
        )
        reasons = ["no GPU given or detected: settings are the defaults, memory is reported without a verdict"]
    reasons += automatic_choices(request, chosen.settings)
    batching = options.resolve_batching(request.batching, chosen.settings.attn)
    if request.device is not None and request.batching == "auto":
        reasons.append(
            f"batching {batching}: "
            + (
                "flash attention takes packed rows exactly"
                if batching == "padding_free"
                else "rows of similar length together, so padding wastes little compute"
            )
        )
    if truncated_rows:
        reasons.append(f"sequence length {seq_len} truncates {truncated_rows} rows of the data")
    speed = chosen.tokens_per_s if gpu else 0.0
    timing = time_and_cost(
        gpu, memory.world_size(chosen.settings), speed, tokens_per_epoch(request) * request.epochs, request.kwh_price
    )
    return Plan(
        model=request.model,
        gpu=gpu,
        settings=chosen.settings,
        estimate=chosen.estimate,
        batch_size=request.effective_batch,
        epochs=request.epochs,
        batching=batching if request.device is not None else None,
        device=request.device,
        tokens=request.tokens,
        truncated_rows=truncated_rows,
        kwh_price=request.kwh_price,
        reasons=reasons,
        suggestions=extra,
        serving=serving.serving(request.model, serve_context(request), gpu, request.headroom),
        **timing,  # type: ignore[arg-type]  # hours and the costs, each typed in Plan
    )


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


def with_settings(plan: Plan, settings: Settings) -> Plan:
    """The same plan run with other settings (a setting the user overrides, the pre-flight's or the
    out-of-memory guard's smaller micro-batch): the memory estimated again, the time and cost with it."""
    if settings == plan.settings:
        return plan
    update: dict = {"settings": settings, "estimate": estimate(plan.model, settings, plan.gpu, plan.estimate.headroom)}
    if plan.gpu is not None and plan.tokens_per_s:
        speed = tokens_per_second(plan.model, settings, plan.gpu)
        total_tokens = plan.hours * 3600 * plan.tokens_per_s  # the same run: the tokens it trains stay
        update |= time_and_cost(plan.gpu, memory.world_size(settings), speed, total_tokens, plan.kwh_price)
    return plan.model_copy(update=update)


def compare(request: PlanRequest, max_price_hour: float | None = None) -> list[Plan]:
    """Plan the job on every rentable catalog GPU (or under a price cap); fitting ones first, fastest first."""
    if request.rent_price is not None:
        raise LorafitError("--rent-price is what one GPU costs you; --compare prices each card from the catalog")
    plans = []
    for gpu in hardware.gpus(max_price_hour=max_price_hour):
        if gpu.kind == "apple":
            continue
        plan = make_plan(request.model_copy(update={"gpu": gpu}))
        plans.append(plan if plan.fits else several_of(request, plan, gpu))
    return sorted(plans, key=lambda p: (not p.fits, p.hours if p.fits else p.estimate.peak_device_gib))


def several_of(request: PlanRequest, plan: Plan, gpu: GpuSpec) -> Plan:
    """Where one card does not fit: the plan on the fewest of it that do (sharded, or offloaded), the one of
    the plan's suggestions with the fewest GPU-hours; the plan itself when none does."""
    several = [s for s in plan.suggestions if s.gpu == gpu.name and (s.n_gpus * s.nodes > 1 or s.offload != "none")]
    if not several:
        return plan
    chosen = min(several, key=lambda s: ((s.hours or 0.0) * s.n_gpus * s.nodes, s.n_gpus))
    fixed = request.fixing(n_gpus=chosen.n_gpus, shard=chosen.shard, offload=chosen.offload, nodes=chosen.nodes)
    return make_plan(fixed.model_copy(update={"gpu": gpu}))


def cheapest(plans: list[Plan], max_usd_per_hour: float | None = None) -> Plan | None:
    rentable = [
        p
        for p in plans
        if p.fits
        and p.cost_cloud_usd is not None
        and p.gpu
        and (max_usd_per_hour is None or (p.gpu.rent_usd_per_hour or 0) <= max_usd_per_hour)
    ]
    return min(rentable, key=lambda p: p.cost_cloud_usd or 0.0) if rentable else None
