"""The traced op list of one micro-batch, timed op by op with the time model's own roofline and rates.

`OpTimer` is a `TorchDispatchMode` that sits under the live-tensor tracker during a fake-tensor training step and
records every aten op of step 1's first micro-batch (forward, recomputation and backward): its FLOPs from torch's
registered formulas (`torch.utils.flop_counter`), the bytes it moves (its tensor inputs and outputs; views and
metadata ops move nothing and launch nothing) and the category `lorafit.timing.micro_batch_time` puts it in. Each
op is then timed as timing.py times its category (`op_seconds`), so summing the traced op list checks the closed
form's FLOP, byte and kernel counts against the real code path: `make bench-time-trace`.

Categories: a LoRA module's own ops (its casts, dropout, rank-r matmuls, scaling and the sum with the base
output; found with module hooks in forward and by the autograd node that runs in backward) are `lora`; the
4-bit dequantisation is `dequant`; the other matmuls are `matmul`, except the attention's (batched matmuls and
ops on the (seq x seq) scores of eager attention, and the fused sdpa kernels), which are `attention`; what runs
between the LM head and the loss, forward and backward, is `loss`; the rest (norms, activations, rotary,
residuals, the embedding lookup) is `elementwise`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from lorafit import timing
from lorafit.trace.api import check_traceable, trace_depths
from lorafit.trace.model import at_depth, cuda_kernel_choices, eager_data_checks, fake_model
from lorafit.trace.step import in_backward, run_training_steps, token_batch
from lorafit.trace.tracker import LiveTensorTracker, Phase
from lorafit.train import build

if TYPE_CHECKING:
    from lorafit.hardware import GpuSpec
    from lorafit.models import ModelSpec
    from lorafit.schema import Settings

CATEGORIES = ("matmul", "attention", "dequant", "lora", "elementwise", "loss")
aten = torch.ops.aten
MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._grouped_mm}
# The CPU's fused attention kernels take the same leading arguments as the CUDA ones whose FLOPs torch counts.
CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward,
}
FUSED_ATTENTION = set(CPU_ATTENTION) | {k for k in flop_registry if "attention" in str(k)}
# Ops that allocate or describe a tensor without a kernel touching its data.
NO_KERNEL = {
    aten.empty,
    aten.empty_like,
    aten.empty_strided,
    aten.detach,
    aten.lift_fresh,
    aten.alias,
    aten._unsafe_view,  # a view that autograd does not track as one (matmul's folded batch)
    aten._local_scalar_dense,
    aten.sym_size,
    aten.sym_stride,
    aten.sym_numel,
    aten.sym_storage_offset,
    aten.is_same_size,
    aten.set_,
}
# Gathers: the kernel reads only the indexed rows of one argument (the embedding table, the log-probabilities
# the loss picks from), as many bytes as it writes; that argument is counted as the output's size.
GATHERED_ARGUMENT = {aten.embedding: 0, aten.nll_loss_forward: 0}
# An argument whose shape alone the kernel uses: nll_loss's backward writes the gradient without reading `self`.
UNREAD_ARGUMENT = {aten.nll_loss_backward: 1}
DEQUANT_OPS = ("bitsandbytes.dequantize_4bit", "bitsandbytes.dequantize_blockwise")
PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Op:
    """One kernel of the traced step."""

    name: str
    category: str
    flops: float
    moved_bytes: float
    precision: str  # the dtype its matmul runs in ("bf16", "fp16", "fp32")
    causal: bool = False  # a fused attention kernel that skips the masked half
    quantized: bool = False  # a matmul on a freshly dequantised 4-bit weight
    backward: bool = False  # run by the backward pass (the checkpoint's recomputation included)


class OpTimer(TorchDispatchMode):
    """Record the ops of one micro-batch (step `step`, micro-batch `micro_batch` by the tracker's `phase()`),
    each with its category; `watch(model)` first, so LoRA modules are told apart."""

    def __init__(self, phase: Callable[[], Phase], scores_len: int = 0, step: int = 1, micro_batch: int = 1) -> None:
        super().__init__()
        self.phase, self.step, self.micro_batch = phase, step, micro_batch
        self.scores_len = scores_len  # eager attention's sequence length (0: no eager scores to look for)
        self.ops: list[Op] = []
        self.context: list[str] = []  # "lora" / "base" while a LoRA module's forward runs
        self.lora_nodes: set[Any] = set()  # autograd nodes the LoRA paths created
        self.base_nodes: set[Any] = set()  # and their base layers
        self._dequantised: tuple[int, ...] | None = None  # the shape of the weight last dequantised
        self._absmax_pending = False  # the last op dequantised a nested absmax

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        # composite ops (linear, matmul) are opened into the kernels they launch, as FlopCounterMode does
        if func.namespace == "aten" and func._overloadpacket not in flop_registry:
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        current = self.phase()
        if (current.step, current.micro_batch) == (self.step, self.micro_batch) and current.stage != "batch":
            op = self._record(func, args, kwargs, out, current.stage)
            if op is not None:
                self.ops.append(op)
        return out

    # --- what one op is ------------------------------------------------------------------------------------
    def _record(self, func, args, kwargs, out, stage: str) -> Op | None:  # noqa: ANN001
        packet = func._overloadpacket
        if func.is_view or packet in NO_KERNEL or not _tensors(out):
            return None
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        moved = sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in outputs)
        if packet in GATHERED_ARGUMENT:
            moved += _nbytes(outputs[0]) - _nbytes(args[GATHERED_ARGUMENT[packet]])
        if packet in UNREAD_ARGUMENT:
            moved -= _nbytes(args[UNREAD_ARGUMENT[packet]])
        flops = _flops(packet, args, kwargs, out)
        precision = PRECISION.get(inputs[0].dtype if inputs else outputs[0].dtype, "fp32")
        category = self._category(func, packet, inputs + outputs, stage)
        quantized = False
        if self._absmax_pending and category == "elementwise":  # the offset added to the nested absmax
            category = "dequant"
        self._absmax_pending = str(packet) == DEQUANT_OPS[1]
        if category == "dequant":
            self._dequantised = tuple(outputs[0].shape) if str(packet) == DEQUANT_OPS[0] else self._dequantised
        elif category == "matmul" and self._dequantised is not None:
            quantized = any(sorted(t.shape) == sorted(self._dequantised) for t in inputs)
            self._dequantised = None if quantized else self._dequantised
        causal = packet in FUSED_ATTENTION and bool(_argument(func, args, kwargs, "is_causal"))
        return Op(str(packet), category, flops, moved, precision, causal, quantized, in_backward())

    def _category(self, func, packet, tensors: list[torch.Tensor], stage: str) -> str:  # noqa: ANN001
        if str(packet) in DEQUANT_OPS:
            return "dequant"
        if self._in_lora():
            return "lora"
        if packet in FUSED_ATTENTION or packet in (aten.bmm, aten.baddbmm) or self._on_scores(tensors):
            return "attention"
        if packet in MATMULS:
            return "matmul"
        if stage in ("forward: loss", "backward: loss"):
            return "loss"
        return "elementwise"

    def _in_lora(self) -> bool:
        """Inside a LoRA module's own path: by the module stack in a forward (and the checkpoint's
        recomputation, which runs with grad enabled inside backward), else by the autograd node running."""
        if self.context:
            return self.context[-1] == "lora"
        if in_backward() and not torch.is_grad_enabled():
            return torch._C._current_autograd_node() in self.lora_nodes
        return False

    def _on_scores(self, tensors: list[torch.Tensor]) -> bool:
        """An op on eager attention's (batch, heads, seq, seq) scores (told apart by shape: a sequence as long
        as a head is wide would look the same as q and k)."""
        return bool(self.scores_len) and any(
            t.dim() == 4 and t.shape[-1] == t.shape[-2] == self.scores_len for t in tensors
        )

    # --- LoRA modules ----------------------------------------------------------------------------------------
    def watch(self, model: torch.nn.Module) -> None:
        """Hook every peft LoRA layer: its base layer's ops are the base model's, the rest are the adapter's."""
        from peft.tuners.lora import LoraLayer

        for module in model.modules():
            if isinstance(module, LoraLayer):
                self._hook(module, "lora")
                self._hook(module.get_base_layer(), "base")

    def _hook(self, module: torch.nn.Module, name: str) -> None:
        def before(_module, _args) -> None:  # noqa: ANN001
            self.context.append(name)

        def after(_module, args, output) -> None:  # noqa: ANN001
            self.context.pop()
            stops = {t.grad_fn for t in tree_leaves(args) if isinstance(t, torch.Tensor)}
            roots = [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
            if in_backward() or output is None:
                return  # a recomputation's graph is thrown away; backward runs the forward's
            if name == "base":
                self.base_nodes.update(_new_nodes(roots, stops | self.base_nodes))
            else:
                self.lora_nodes.update(_new_nodes(roots, stops | self.base_nodes | self.lora_nodes))

        module.register_forward_pre_hook(before)
        # always_call: the checkpoint's recomputation stops early by raising inside a module's forward
        module.register_forward_hook(after, always_call=True)


# --- the traced step ---------------------------------------------------------------------------------------
def trace_ops(spec: ModelSpec, settings: Settings, num_layers: int | None = None, *, autocast: bool = True) -> list[Op]:
    """The ops of one micro-batch of `spec` (at `num_layers` decoder layers; default all) on fake tensors, built
    and run as `trace_step` does (lorafit's trainer: fused AdamW, CUDA's kernel choices, autocast)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    check_traceable(settings)
    depth_spec = at_depth(spec, num_layers or spec.num_hidden_layers)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model, _ = fake_model(depth_spec, settings, fake_mode)
    optimizer = build.build_optimizer(model, settings, fused=True)
    tracker = LiveTensorTracker()
    timer = OpTimer(lambda: tracker.phase, settings.seq_len if settings.attn == "eager" else 0)
    timer.watch(model)
    make_batch = token_batch(spec.vocab_size, settings.micro_batch, settings.seq_len)
    # the timer goes under the tracker, so it sees the ops the tracker expands bitsandbytes' 4-bit matmul into
    with fake_mode, eager_data_checks(), cuda_kernel_choices(), timer:
        run_training_steps(model, optimizer, settings, tracker, make_batch, steps=1, autocast=autocast)
    return timer.ops


def op_seconds(op: Op, gpu: GpuSpec) -> float:
    """One op as timing.py times its category, without its launch (KERNEL_SECONDS, counted apart): the slower
    of its FLOPs at the category's matmul rate and its bytes at the card's bandwidth."""
    rate = timing.achievable_matmul_flops(gpu, op.precision)
    flops = op.flops
    if op.category == "matmul":
        rate *= timing.MATMUL_SHAPE_SHARE
    elif op.category == "attention" and op.name in {str(k) for k in FUSED_ATTENTION}:
        rate *= timing.ATTENTION_SHARE
        flops *= 0.5 if op.causal else 1.0  # FlashAttention skips the blocks above the diagonal
    seconds = timing.roofline_seconds(flops, op.moved_bytes, rate, timing.achievable_bytes_per_second(gpu))
    return seconds * (timing.QUANT_MATMUL_SLOWDOWN if op.quantized else 1.0)


@dataclass(frozen=True)
class OpListTime:
    """A traced op list summed by category: seconds (launches apart), kernels, FLOPs and bytes."""

    seconds: dict[str, float]
    kernels: dict[str, float]
    flops: dict[str, float]
    moved_bytes: dict[str, float]

    FIELDS = ("seconds", "kernels", "flops", "moved_bytes")

    @property
    def launches(self) -> float:
        return sum(self.kernels.values()) * timing.KERNEL_SECONDS

    @property
    def total(self) -> float:
        return sum(self.seconds.values()) + self.launches


def time_ops(ops: list[Op], gpu: GpuSpec) -> OpListTime:
    sums: dict[str, dict[str, float]] = {key: dict.fromkeys(CATEGORIES, 0.0) for key in OpListTime.FIELDS}
    for op in ops:
        sums["seconds"][op.category] += op_seconds(op, gpu)
        sums["kernels"][op.category] += 1
        sums["flops"][op.category] += op.flops
        sums["moved_bytes"][op.category] += op.moved_bytes
    return OpListTime(**sums)


@dataclass(frozen=True)
class TracedOps:
    """The op lists of one micro-batch traced at two depths (or at the full depth, for up to three layers)."""

    num_layers: int
    traces: tuple[tuple[int, list[Op]], ...]  # (decoder layers, ops)

    def time(self, gpu: GpuSpec) -> OpListTime:
        """The op list timed on `gpu`, at the full depth: along the line through the two traced depths, as
        every decoder layer runs the same ops."""
        if len(self.traces) == 1:
            return time_ops(self.traces[0][1], gpu)
        (a, small), (b, large) = ((n, time_ops(ops, gpu)) for n, ops in self.traces)

        def line(at_a: dict[str, float], at_b: dict[str, float]) -> dict[str, float]:
            return {c: at_a[c] + (at_b[c] - at_a[c]) * (self.num_layers - a) / (b - a) for c in CATEGORIES}

        return OpListTime(**{key: line(getattr(small, key), getattr(large, key)) for key in OpListTime.FIELDS})


def trace_micro_batch(spec: ModelSpec, settings: Settings, *, autocast: bool = True) -> TracedOps:
    """One micro-batch's ops at the depths that fix the full depth's (trace_depths, as trace_depth)."""
    depth = spec.num_hidden_layers
    depths = (depth,) if depth <= max(trace_depths(spec)) else trace_depths(spec)
    return TracedOps(depth, tuple((n, trace_ops(spec, settings, n, autocast=autocast)) for n in depths))


def _new_nodes(roots: list[Any], stops: set[Any]) -> Iterator[Any]:
    """Autograd nodes reachable from `roots` without passing a node in `stops`."""
    seen: set[Any] = set()
    todo = [r for r in roots if r is not None]
    while todo:
        node = todo.pop()
        if node in seen or node in stops:
            continue
        seen.add(node)
        yield node
        todo += [n for n, _ in node.next_functions if n is not None]


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _nbytes(tensor: torch.Tensor) -> int:
    """What a kernel reads or writes of a tensor: its elements, or its storage if a broadcast repeats it."""
    logical = tensor.numel() * tensor.element_size()
    try:
        return min(logical, tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return logical


def _flops(packet, args, kwargs, out) -> float:  # noqa: ANN001
    if packet is aten._grouped_mm:
        return _grouped_mm_flops(args[0], args[1])
    formula = flop_registry.get(CPU_ATTENTION.get(packet, packet))
    return float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor) -> float:
    """MoE experts' grouped matmul (transformers' grouped_mm experts), which torch's flop registry lacks: the
    groups split the shared dimension of a 2-D and a 3-D operand (tokens x in by experts x in x out: each token
    row meets one expert, 2 x tokens x in x out) or of two 2-D ones (the weights' gradient: in x tokens by
    tokens x out, 2 x in x tokens x out)."""
    if a.dim() == 2 and b.dim() == 3:
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[-1]
    if a.dim() == 2 and b.dim() == 2:
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    return 0.0


def _argument(func, args, kwargs, name: str) -> Any:  # noqa: ANN001
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            return kwargs.get(name, args[index] if index < len(args) else argument.default_value)
    return None
