"""Live tensor bytes of a training step, counted storage by storage at the dispatcher.

`LiveTensorTracker` is a `TorchDispatchMode`: every tensor an op returns is looked at, and a storage it has not
seen yet is counted once, by its `nbytes()`, until a weakref finalizer on the untyped storage says it is gone.
Views, in-place ops and tensors that share a storage therefore cost nothing extra - the same accounting as
the CUDA caching allocator's `memory_allocated()`, minus the allocator's rounding to 512-byte blocks. It works
the same on real tensors and on `FakeTensorMode` tensors, which is what lets the trace be checked against
real steps on the CPU.

Every live storage carries a category; the step code and hooks move storages between categories as their
role becomes known (a gradient once autograd accumulates it, an optimizer state once the optimizer stores it,
an activation once autograd saves it or a backward pass begins while it is still alive).

With `attach_allocators`, the tracker also drives simulations of the CUDA caching allocator
(`trace.allocator.CachingAllocator`): a malloc when a device storage is first seen, a free when it is released,
so the trace knows what `memory_reserved()` would be. Host tensors and bnb's paged states are not in torch's
allocator and stay out of it.

This module imports torch at import time; `lorafit.trace` imports it only when a trace runs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from lorafit.trace.allocator import CachingAllocator

PARAMETERS = "parameters"
GRADIENTS = "gradients"
OPTIMIZER_STATES = "optimizer_states"
ACTIVATIONS = "activations"
TEMPORARIES = "temporaries"
CATEGORIES = (PARAMETERS, GRADIENTS, OPTIMIZER_STATES, ACTIVATIONS, TEMPORARIES)
# bitsandbytes' paged optimizers keep big states in CUDA managed memory, which torch's allocator never counts.
PAGED_OPTIMIZER_STATES = "paged_optimizer_states"
# What the memory savers keep in host memory (offloaded activations, an embedding table on the CPU): the
# trace runs on the CPU device, so these are told apart by role, not by device.
HOST = "host"
OUTSIDE_ALLOCATOR = (PAGED_OPTIMIZER_STATES, HOST)


class Phase(NamedTuple):
    """Where in the step an allocation happens: step 1 or 2, micro-batch, what runs, and which decoder layer."""

    step: int
    micro_batch: int
    stage: str
    layer: int | None = None

    def describe(self, num_layers: int | None = None) -> str:
        """'step 2, micro-batch 1: backward: recompute of layer 31 (of 32)', 'step 2: optimizer step'."""
        where = self.stage
        if self.layer is not None:
            where += f" {self.layer}" if self.stage.endswith("layer") else f" of layer {self.layer}"
            if num_layers is not None:
                where += f" (of {num_layers})"
        when = f"step {self.step}" + (f", micro-batch {self.micro_batch}" if self.micro_batch else "")
        return f"{when}: {where}"


SET_UP = Phase(0, 0, "set-up")


@dataclass(frozen=True)
class Snapshot:
    """Live bytes at one moment, in total and by category."""

    total_bytes: int
    by_category: dict[str, int]


@dataclass
class _Storage:
    nbytes: int
    category: str
    born_in: int  # the tracker's forward-pass counter when it was allocated
    handles: list[int] | None = None  # its block in each attached allocator simulation


class LiveTensorTracker(TorchDispatchMode):
    """Count every live tensor storage; keep the peak of each phase with its breakdown by category."""

    def __init__(self) -> None:
        super().__init__()
        self.phase: Phase = SET_UP
        self.forward_pass = 0
        self.live_bytes = 0
        self.paged_bytes = 0
        self.host_bytes = 0
        self.host_peak_bytes = 0
        self.by_category: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.phase_peaks: dict[Phase, Snapshot] = {}
        self.phase_starts: dict[Phase, Snapshot] = {}  # live bytes when each phase first began
        self._storages: dict[int, _Storage] = {}
        self._expansions: dict[Any, Any] = _bitsandbytes_expansions()
        self.allocators: tuple[CachingAllocator, ...] = ()

    def attach_allocators(self, *allocators: CachingAllocator) -> None:
        """From now on drive these allocator simulations; the device storages alive now (the loaded model) are
        allocated first, in the order they were seen."""
        self.allocators = allocators
        for storage in self._storages.values():
            if storage.category not in OUTSIDE_ALLOCATOR:
                self._malloc(storage)

    # --- the dispatcher hook -------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        expansion = self._expansions.get(func)
        out = expansion(self, *args, **kwargs) if expansion else func(*args, **kwargs)
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.track(leaf)
        return out

    # --- storages ------------------------------------------------------------------------------------------
    def track(self, tensor: torch.Tensor, category: str = TEMPORARIES) -> None:
        """Count the storage(s) behind `tensor` if they are new; note a resize of a known one."""
        for storage in _untyped_storages(tensor):
            key = id(storage)
            known = self._storages.get(key)
            nbytes = storage.nbytes()
            if known is None:
                known = self._storages[key] = _Storage(nbytes, category, self.forward_pass)
                weakref.finalize(storage, self._release, key)
                if category not in OUTSIDE_ALLOCATOR:
                    self._malloc(known)
                self._add(category, nbytes)
            elif known.nbytes != nbytes:  # resize_ or an out= op grew the storage
                self._add(known.category, nbytes - known.nbytes)
                old, known.nbytes = known.handles, nbytes
                if old is not None:  # a new block, the old one freed after the copy
                    self._malloc(known)
                    for allocator, handle in zip(self.allocators, old, strict=True):
                        allocator.free(handle)

    def retag(self, tensor: torch.Tensor, category: str, only_from: tuple[str, ...] | None = None) -> None:
        """Move `tensor`'s storage to `category` (tracking it first if it is new)."""
        for storage in _untyped_storages(tensor):
            known = self._storages.get(id(storage))
            if known is None:
                self.track(tensor, category)
                continue
            if known.category == category or (only_from is not None and known.category not in only_from):
                continue
            self._move(known, category)

    def retag_forward_leftovers(self) -> None:
        """At the start of a backward pass, whatever this forward allocated and is still alive is held for it."""
        for storage in self._storages.values():
            if storage.category == TEMPORARIES and storage.born_in == self.forward_pass:
                self._move(storage, ACTIVATIONS)

    def mark_host(self, tensor: torch.Tensor) -> None:
        """`tensor` lives in host memory (savers.ActivationOffload's copies, a HostEmbedding's table)."""
        self.retag(tensor, HOST)

    def pack_saved(self, tensor: torch.Tensor) -> torch.Tensor:
        """saved_tensors_hooks pack hook: what autograd saves for backward is an activation."""
        self.retag(tensor, ACTIVATIONS, only_from=(TEMPORARIES,))
        return tensor

    # --- phases --------------------------------------------------------------------------------------------
    def set_phase(self, phase: Phase) -> None:
        self.phase = phase
        self.phase_starts.setdefault(phase, self.now())
        self._note_peak()

    def start_forward(self) -> None:
        self.forward_pass += 1

    @property
    def peak(self) -> tuple[Phase, Snapshot]:
        """The highest moment of all phases (the first one, if two phases tie)."""
        phase = max(self.phase_peaks, key=lambda p: self.phase_peaks[p].total_bytes)
        return phase, self.phase_peaks[phase]

    def now(self) -> Snapshot:
        return Snapshot(self.live_bytes, dict(self.by_category))

    # --- bookkeeping ---------------------------------------------------------------------------------------
    def _add(self, category: str, nbytes: int) -> None:
        if category == PAGED_OPTIMIZER_STATES:
            self.paged_bytes += nbytes
            return
        if category == HOST:
            self.host_bytes += nbytes
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
            return
        self.live_bytes += nbytes
        self.by_category[category] += nbytes
        if nbytes > 0:
            self._note_peak()

    def _move(self, storage: _Storage, category: str) -> None:
        self._add(storage.category, -storage.nbytes)
        storage.category = category
        if category in OUTSIDE_ALLOCATOR and storage.handles is not None:
            # a host copy or a managed-memory state, learnt of after the op returned: it never reached the device
            for allocator, handle in zip(self.allocators, storage.handles, strict=True):
                allocator.cancel(handle)
            storage.handles = None
        elif category not in OUTSIDE_ALLOCATOR and storage.handles is None:
            self._malloc(storage)
        self._add(category, storage.nbytes)

    def _malloc(self, storage: _Storage) -> None:
        if self.allocators:
            storage.handles = [allocator.malloc(storage.nbytes) for allocator in self.allocators]

    def _release(self, key: int) -> None:
        storage = self._storages.pop(key, None)
        if storage is not None:
            self._add(storage.category, -storage.nbytes)
            if storage.handles is not None:
                for allocator, handle in zip(self.allocators, storage.handles, strict=True):
                    allocator.free(handle)

    def _note_peak(self) -> None:
        best = self.phase_peaks.get(self.phase)
        if best is None or self.live_bytes > best.total_bytes:
            self.phase_peaks[self.phase] = self.now()


def _untyped_storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind a tensor; a wrapper subclass (DTensor, ...) is opened up."""
    if is_traceable_wrapper_subclass(tensor):
        inner, _ = tensor.__tensor_flatten__()
        return [s for name in inner for s in _untyped_storages(getattr(tensor, name))]
    try:
        return [tensor.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return []


# --- bitsandbytes' fused 4-bit matmul, as the GPU runs it at training sizes ------------------------------------
def _bitsandbytes_expansions() -> dict[Any, Any]:
    """`bitsandbytes::gemm_4bit` is one opaque op to the dispatcher, but on CUDA, for more than 1536 rows (any
    training micro-batch of real length) it dequantises the whole weight to the compute dtype and calls
    F.linear (`_dequant_linear_fallback` in bitsandbytes/backends/cuda/ops.py). The dequantised copy is a
    real allocation that an op-level view would miss, so the tracker runs that fallback op by op."""
    import sys

    if "bitsandbytes" not in sys.modules:  # no bitsandbytes op can run without it; importing it costs seconds
        return {}
    ops = torch.ops.bitsandbytes
    if not hasattr(ops, "gemm_4bit"):  # before bitsandbytes 0.49 MatMul4Bit dequantised with visible ops
        return {}

    def gemm_4bit(
        tracker: LiveTensorTracker,
        A,
        B,
        shapeB,
        absmax,
        blocksize,
        quant_type,
        bias=None,  # noqa: N803
        absmax_8bit=None,
        absmax_code=None,
        absmax_offset=None,
    ):
        if absmax_8bit is not None:
            nested = ops.dequantize_blockwise.default(absmax_8bit, absmax, absmax_code, 256, torch.float32)
            tracker.track(nested)
            absmax = nested + absmax_offset
            tracker.track(absmax)
        weight = ops.dequantize_4bit.default(B, absmax, blocksize, quant_type, shapeB, A.dtype)
        tracker.track(weight)
        out = torch.nn.functional.linear(A, weight, bias)
        tracker.track(out)  # allocated while the dequantised weight is still alive
        return out

    return {ops.gemm_4bit.default: gemm_4bit}
