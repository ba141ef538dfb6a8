"""`trace_step` (one traced depth) and `exact_estimate` (the full depth, extrapolated), plus the real-step twin.

The decoder layers of a model are identical, so every phase's peak is a straight line in the number of layers
(each layer adds the same parameters, saved tensors and states). A trace at depths 2 and 3 fixes that line
for each phase - "backward of the last layer", "loss", "optimizer step", ... - and the full model's peak is the
highest phase at its real depth. tests/test_trace.py checks this against a full-depth trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lorafit import memory
from lorafit.errors import LorafitError
from lorafit.options import DEFAULT_HEADROOM
from lorafit.trace.allocator import CachingAllocator
from lorafit.train import build, savers

if TYPE_CHECKING:
    from lorafit.hardware import GpuSpec
    from lorafit.models import ModelSpec
    from lorafit.schema import Estimate, Settings
    from lorafit.trace.tracker import Phase, Snapshot

TRACE_DEPTHS = (2, 3)  # two depths fix each phase's line; with 2 and 3 the first and last layers differ


@dataclass(frozen=True)
class StepTrace:
    """Live tensor bytes of two training steps at one depth: the peak, when, and what was alive."""

    num_layers: int
    peak_bytes: int
    peak_phase: Phase
    breakdown: dict[str, int]  # bytes by category at the peak
    phase_peaks: dict[Phase, Snapshot]
    phase_starts: dict[Phase, Snapshot]
    paged_bytes: int  # bnb paged optimizer states (CUDA managed memory, outside peak_bytes)
    trainable_params: int
    total_params: int
    host_peak_bytes: int = 0  # what the memory savers kept in host memory at most (outside peak_bytes)
    # memory_reserved() at its peak, from the caching allocator simulation the tracker drove (trace.allocator):
    # plain, and with expandable_segments
    reserved_bytes: int = 0
    expandable_reserved_bytes: int = 0

    @property
    def peak_description(self) -> str:
        return self.peak_phase.describe(self.num_layers)

    @property
    def transient_bytes(self) -> int:
        """The largest short-lived excursion of step 2: one phase's peak above its start, the loss counted
        from the LM head's forward. What the caching allocator keeps reserved after the step comes from these."""
        from lorafit.trace.tracker import Phase

        excursions = [0]
        for phase, peak in self.phase_peaks.items():
            if phase.step != 2:
                continue
            start = self.phase_starts[phase]
            if phase.stage == "backward: loss":
                start = self.phase_starts.get(Phase(phase.step, phase.micro_batch, "forward: LM head"), start)
            excursions.append(peak.total_bytes - start.total_bytes)
        return max(excursions)


def trace_step(
    spec: ModelSpec,
    settings: Settings,
    num_layers: int | None = None,
    *,
    fused_optimizer: bool = True,
    kbit_upcast: bool = False,
    autocast: bool = True,
    device: Literal["cuda", "cpu"] = "cuda",
    lengths: Sequence[int] = (),
) -> StepTrace:
    """Two training steps of `spec` (at `num_layers` decoder layers; default all) on fake tensors.

    Fake tensors have shapes, dtypes and storages but no data, so this costs the same for 7B and 70B. They
    live on the CPU device; `device="cuda"` (the default) makes the kernel choices that differ between the
    devices in what they keep (dropout's mask) the CUDA ones, `device="cpu"` keeps the CPU ones, to compare
    with a real CPU step. The attention kernel saves the same tensors on both. AdamW runs fused (lorafit's
    trainer, `memory.Runtime.fused_optimizer`) or, with `fused_optimizer=False`, torch's CUDA default
    (foreach); `kbit_upcast` adds peft's `prepare_model_for_kbit_training`; `autocast` runs a bf16/fp16
    forward under autocast, as transformers' Trainer does with `bf16=True` / `fp16=True`. `lengths`: instead of
    two steps at the settings' length, as many as these micro-batch lengths make, each padded to its own (a
    collator padding every batch to its longest row), to see what changing shapes strand in the allocator."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lorafit.trace.model import at_depth, fake_model

    check_traceable(settings)
    depth_spec = at_depth(spec, num_layers or spec.num_hidden_layers)
    # Real tensors may meet fake ones: bitsandbytes' optimizers build their quantisation maps (1 KiB) as real
    # tensors in __init__, which needs data and so runs outside the fake mode.
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model, total_params = fake_model(depth_spec, settings, fake_mode, kbit_upcast=kbit_upcast)
    optimizer = build.build_optimizer(
        model, settings, fused=fused_optimizer, **optimizer_overrides(settings, fused_optimizer)
    )
    how = StepsRun(fake_mode, cuda=device == "cuda", autocast=autocast, lengths=lengths)
    return _run(model, optimizer, depth_spec, settings, total_params, how)


def optimizer_overrides(settings: Settings, fused: bool) -> dict[str, bool]:
    """An unfused torch optimizer picks foreach by default on CUDA tensors; on CPU tensors it would loop."""
    if settings.optimizer == "sgd" or (settings.optimizer == "adamw" and not fused):
        return {"foreach": True}
    return {}


def check_traceable(settings: Settings) -> None:
    if settings.n_gpus > 1 or settings.shard != "none":
        raise LorafitError("--exact traces a single-GPU step; for --n-gpus > 1 use the analytic estimate")


@dataclass(frozen=True)
class StepsRun:
    """How _run runs the steps: in a fake-tensor `mode` (None: real tensors), with CUDA's kernel choices, under
    autocast, at these micro-batch lengths (empty: the settings' length, two steps), calling `before_steps` just
    before the first."""

    mode: Any = None
    cuda: bool = False
    autocast: bool = True
    lengths: Sequence[int] = ()
    before_steps: Callable[[], None] | None = None


def _run(model, optimizer, spec: ModelSpec, settings: Settings, total_params: int, how: StepsRun) -> StepTrace:  # noqa: ANN001
    import contextlib

    from lorafit.trace.model import cuda_kernel_choices, eager_data_checks, parameter_tensors
    from lorafit.trace.step import STEPS, padded_batches, run_training_steps
    from lorafit.trace.tracker import PARAMETERS, LiveTensorTracker

    tracker = LiveTensorTracker()
    for tensor in parameter_tensors(model):
        tracker.track(tensor, PARAMETERS)
    for tensor in savers.host_tensors(model):
        tracker.mark_host(tensor)
    plain, expandable = CachingAllocator(), CachingAllocator(expandable=True)
    tracker.attach_allocators(plain, expandable)  # the loaded model first, then the steps' blocks
    micro_batches = min(settings.grad_accum, 2)  # a step's, as run_training_steps runs them
    lengths = how.lengths or [settings.seq_len] * (STEPS * micro_batches)
    make_batch = padded_batches(spec.vocab_size, settings.micro_batch, lengths)
    steps = len(lengths) // micro_batches
    if how.before_steps is not None:
        how.before_steps()
    try:
        with (
            how.mode if how.mode is not None else contextlib.nullcontext(),
            eager_data_checks(),
            cuda_kernel_choices() if how.cuda else contextlib.nullcontext(),
        ):
            run_training_steps(model, optimizer, settings, tracker, make_batch, steps, autocast=how.autocast)
    except (RuntimeError, ValueError) as error:  # what the first training step of `lorafit train` would hit
        raise build.setup_error(spec, "the training step fails", error) from None
    phase, snapshot = tracker.peak
    return StepTrace(
        num_layers=spec.num_hidden_layers,
        peak_bytes=snapshot.total_bytes,
        peak_phase=phase,
        breakdown=snapshot.by_category,
        phase_peaks=dict(tracker.phase_peaks),
        phase_starts=dict(tracker.phase_starts),
        paged_bytes=tracker.paged_bytes,
        trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
        total_params=total_params,
        host_peak_bytes=tracker.host_peak_bytes,
        reserved_bytes=plain.peak_reserved,
        expandable_reserved_bytes=expandable.peak_reserved,
    )


def real_step(
    model_dir: Path,
    spec: ModelSpec,
    settings: Settings,
    *,
    fused_optimizer: bool = True,
    autocast: bool = True,
    seed: int = 0,
    before_steps: Callable[[], None] | None = None,
) -> StepTrace:
    """The same two steps with real tensors on the CPU: the model loaded from `model_dir` the way `lorafit
    train` loads it (real bitsandbytes 4-bit, real peft), the optimizer built the same way, the same tracker.
    `before_steps` is called just before the first step (the benchmark samples the process's memory there)."""
    import torch

    check_traceable(settings)
    torch.manual_seed(seed)
    model = build.load_model(Path(model_dir), settings)
    total_params = model.num_parameters()
    model.train()
    model = build.checked_prepare(model, spec, settings)
    optimizer = build.build_optimizer(
        model, settings, fused=fused_optimizer, **optimizer_overrides(settings, fused_optimizer)
    )
    return _run(model, optimizer, spec, settings, total_params, StepsRun(autocast=autocast, before_steps=before_steps))


# --- the full depth ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DepthTrace:
    """The peak of a full-depth step, from traces at two depths."""

    num_layers: int
    peak_bytes: int
    peak_phase: str
    breakdown: dict[str, int]
    paged_bytes: int
    trainable_params: int
    total_params: int
    traces: tuple[StepTrace, ...]
    host_peak_bytes: int = 0
    reserved_bytes: int = 0  # the simulated memory_reserved() peak (extended to the full depth: trace_depth)
    expandable_reserved_bytes: int = 0

    @property
    def transient_bytes(self) -> int:
        """The deepest trace's (a layer's or the loss's excursion does not grow with depth)."""
        return self.traces[-1].transient_bytes

    def reserved_for(self, settings: Settings) -> int:
        """The simulated reserve under the settings' allocator mode, never below the allocated peak."""
        reserved = self.expandable_reserved_bytes if settings.expandable_segments else self.reserved_bytes
        return max(reserved, self.peak_bytes)

    def step_peak(self, settings: Settings | None) -> memory.StepPeak:
        """The traced peak for `memory.assemble`; `settings`: whose allocator mode the simulated reserve is
        taken under (None: the reserve modelled, not simulated)."""
        return memory.StepPeak(
            self.breakdown,
            self.peak_phase,
            self.transient_bytes,
            self.paged_bytes,
            trainable=self.trainable_params,
            total=self.total_params,
            simulated_reserved=None if settings is None else self.reserved_for(settings),
        )


def _phase_class(phase: Phase, num_layers: int) -> tuple:
    """A phase with its layer index made relative: first, last or an inner layer."""
    if phase.layer is None:
        return (phase.step, phase.micro_batch, phase.stage, None)
    position = "first" if phase.layer == 0 else "last" if phase.layer == num_layers - 1 else "inner"
    return (phase.step, phase.micro_batch, phase.stage, position)


def trace_depths(spec: ModelSpec) -> tuple[int, int]:
    """The two depths a full-depth figure is extrapolated from: TRACE_DEPTHS, or, for a model whose layers repeat a
    pattern (Gemma 4: a global layer closes every `interval`; a hybrid such as Qwen3.5: one full-attention layer
    every group), one and two whole periods, so that each layer the line adds is the pattern's mean."""
    if spec.global_layers and spec.global_layers.kv_shared_layers:
        # Gemma 4 E2B / E4B: unshared layers then shared-KV ones, no whole periods: traced at full depth
        return spec.num_hidden_layers, spec.num_hidden_layers
    if spec.global_layers:
        period = spec.global_layers.interval
    elif spec.linear_attention:
        period = spec.linear_attention.full_attention_interval
    elif spec.cross_attention:  # Llama 3.2 Vision: a cross-attention layer after every 4 self-attention layers
        period = spec.cross_attention.period()
    else:
        period = 1
    return TRACE_DEPTHS if period == 1 else (period, 2 * period)


def _line(at_a: float, at_b: float, a: int, b: int, depth: int) -> float:
    return at_a + (at_b - at_a) * (depth - a) / (b - a)


def trace_depth(
    spec: ModelSpec,
    settings: Settings,
    *,
    fused_optimizer: bool = True,
    kbit_upcast: bool = False,
    autocast: bool = True,
    device: Literal["cuda", "cpu"] = "cuda",
) -> DepthTrace:
    """The full-depth peak: traced directly for up to three layers, else extrapolated from depths 2 and 3."""
    depth = spec.num_hidden_layers
    options = {"fused_optimizer": fused_optimizer, "kbit_upcast": kbit_upcast, "autocast": autocast, "device": device}
    a, b = trace_depths(spec)
    if depth <= b:
        trace = trace_step(spec, settings, **options)
        return DepthTrace(
            depth,
            trace.peak_bytes,
            trace.peak_description,
            trace.breakdown,
            trace.paged_bytes,
            trace.trainable_params,
            trace.total_params,
            (trace,),
            trace.host_peak_bytes,
            trace.reserved_bytes,
            trace.expandable_reserved_bytes,
        )
    small, large = (trace_step(spec, settings, n, **options) for n in (a, b))
    by_class_small = {_phase_class(p, a): s for p, s in small.phase_peaks.items()}
    by_class_large = {_phase_class(p, b): s for p, s in large.phase_peaks.items()}
    best: tuple[float, tuple, dict[str, float]] | None = None
    for key, at_a in by_class_small.items():
        at_b = by_class_large.get(key)
        if at_b is None or key[3] == "inner":
            continue
        total = _line(at_a.total_bytes, at_b.total_bytes, a, b, depth)
        if best is None or total > best[0]:
            parts = {
                name: _line(at_a.by_category[name], at_b.by_category[name], a, b, depth) for name in at_a.by_category
            }
            best = (total, key, parts)
    if best is None:
        raise LorafitError("the traces at two depths share no phase; cannot extrapolate")
    total, (step, micro_batch, stage, position), parts = best
    from lorafit.trace.tracker import Phase

    layer = None if position is None else 0 if position == "first" else depth - 1
    phase = Phase(step, micro_batch, stage, layer).describe(depth)

    def count(field: str) -> int:
        return round(_line(getattr(small, field), getattr(large, field), a, b, depth))

    def reserve(field: str) -> int:
        """The deeper trace's simulated reserve above its peak, grown with the peak at the rate the full-depth
        simulations of `make bench-allocator` show (memory.RESERVED_ALLOCATED_SHARE): the reserve is not a
        straight line through depths 2 and 3, whose few layers still fit in the holes the loss left."""
        gap = getattr(large, field) - large.peak_bytes
        return round(total + gap + memory.RESERVED_ALLOCATED_SHARE * (total - large.peak_bytes))

    return DepthTrace(
        depth,
        round(total),
        phase,
        {k: round(v) for k, v in parts.items()},
        count("paged_bytes"),
        count("trainable_params"),
        count("total_params"),
        (small, large),
        count("host_peak_bytes"),
        reserve("reserved_bytes"),
        reserve("expandable_reserved_bytes"),
    )


def runtime_options(runtime: memory.Runtime) -> dict[str, Any]:
    """The code-path facts of a `memory.Runtime` (the stack the estimate describes) as trace_step's and
    trace_depth's keyword arguments."""
    return {
        "fused_optimizer": runtime.fused_optimizer,
        "kbit_upcast": runtime.kbit_upcast,
        "autocast": runtime.autocast,
        "device": runtime.device,
    }


def trace_runtime(spec: ModelSpec, settings: Settings, runtime: memory.Runtime) -> DepthTrace:
    """`trace_depth` with the code-path facts of a `memory.Runtime` (the stack the estimate describes)."""
    return trace_depth(spec, settings, **runtime_options(runtime))


def exact_estimate(
    spec: ModelSpec,
    settings: Settings,
    gpu: GpuSpec | None = None,
    headroom: float = DEFAULT_HEADROOM,
    runtime: memory.Runtime | None = None,
) -> Estimate:
    """`lorafit estimate --exact`: peak memory of a training step from a trace of the real code path.

    peak_allocated is what the trace counts; peak_reserved is what the simulation of the CUDA caching allocator
    the trace drove reserved at most (`trace.allocator`, plain or with expandable_segments as the settings say),
    extended to the full depth like the phases; the device figure adds the same CUDA context (and paged
    optimizer states) as the analytic estimate (`memory.device_side`)."""
    runtime = runtime or memory.Runtime()
    depth = trace_runtime(spec, settings, runtime)
    return memory.assemble(depth.step_peak(settings), settings, runtime, gpu, headroom)
