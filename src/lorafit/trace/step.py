"""Two training steps as transformers.Trainer runs them, with hooks that tell the tracker where it is.

The same function runs the fake trace and the real CPU steps it is checked against, so both count the same
code. One step is what `Trainer.training_step` and its inner loop do: forward with labels (the model computes
the loss), scale the loss by the accumulation steps, backward, clip the gradient norm to 1.0, optimizer step,
`model.zero_grad()`. With gradient accumulation a step runs two micro-batches (the gradients are alive during
the second's forward; a third would repeat the second). The second step is the first with optimizer states.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_leaves

from lorafit.trace.tracker import (
    GRADIENTS,
    OPTIMIZER_STATES,
    PAGED_OPTIMIZER_STATES,
    TEMPORARIES,
    LiveTensorTracker,
    Phase,
)
from lorafit.train import build, savers

if TYPE_CHECKING:
    from lorafit.schema import Settings

STEPS = 2
MAX_GRAD_NORM = 1.0  # TrainingArguments.max_grad_norm default
PAGED_MIN_NUMEL = 100_000  # bnb's get_state_buffer pages states of at least this many elements (on CUDA)


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class PhaseLabels:
    """Module hooks for the forward pass and gradient hooks for the backward pass, naming each phase.

    A gradient hook on a module's output fires when backward reaches that module, so the label changes as
    the backward pass walks the model in reverse. Checkpointed layers run their sub-modules again inside the
    backward pass; those hooks mark the recomputation."""

    def __init__(self, model: torch.nn.Module, tracker: LiveTensorTracker) -> None:
        self.tracker = tracker
        self.step = 0
        self.micro_batch = 0
        parts = model_parts(model)
        self._label_module(parts["embeddings"], "embeddings")
        for index, layer in enumerate(parts["layers"]):
            self._label_module(layer, "layer", index)
            for child in layer.children():
                child.register_forward_pre_hook(partial(self._recompute, index))
                child.register_forward_hook(partial(self._recompute_done, index))
        if parts["norm"] is not None:
            self._label_module(parts["norm"], "final norm")
        self._label_module(parts["lm_head"], "LM head", after="loss")

    def set(self, stage: str, layer: int | None = None) -> None:
        self.tracker.set_phase(Phase(self.step, self.micro_batch, stage, layer))

    def _label_module(
        self, module: torch.nn.Module, name: str, layer: int | None = None, after: str | None = None
    ) -> None:
        def before(_module, _args) -> None:  # noqa: ANN001
            if not in_backward():
                self.set(f"forward: {name}", layer)

        def done(_module, _args, output) -> None:  # noqa: ANN001
            if in_backward():
                return
            if after is not None:
                self.set(f"forward: {after}")
            tensor = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if tensor is not None:
                tensor.register_hook(lambda _grad: self.set(f"backward: {name}", layer))

        module.register_forward_pre_hook(before)
        module.register_forward_hook(done)

    def _recompute(self, layer: int, _module, _args) -> None:  # noqa: ANN001
        if in_backward():
            self.set("backward: recompute", layer)

    def _recompute_done(self, layer: int, _module, _args, _output) -> None:  # noqa: ANN001
        if in_backward():
            self.set("backward: layer", layer)


def model_parts(model: torch.nn.Module) -> dict[str, Any]:
    """Embeddings, decoder layers, final norm and LM head of a (peft-wrapped) transformers causal LM. The layers
    are those text rows run: Llama 3.2 Vision's cross-attention layers are skipped (mllama.py)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = savers.decoder_of(base)
    skipped = set(getattr(decoder, "cross_attention_layers", None) or ())
    return {
        "embeddings": base.get_input_embeddings(),
        "layers": [layer for index, layer in enumerate(decoder.layers) if index not in skipped],
        "norm": getattr(decoder, "norm", None),
        "lm_head": base.get_output_embeddings(),
    }


class _TaggingState(dict):
    """An optimizer's per-parameter state dict that tells the tracker which tensors are optimizer states."""

    def __init__(self, tracker: LiveTensorTracker) -> None:
        super().__init__()
        self._tracker = tracker

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self._tracker.retag(value, OPTIMIZER_STATES, only_from=(TEMPORARIES,))
        super().__setitem__(key, value)


def watch_optimizer(optimizer: torch.optim.Optimizer, tracker: LiveTensorTracker) -> None:
    """Tag optimizer states as the optimizer creates them; put big paged states where CUDA would put them."""
    optimizer.state = defaultdict(partial(_TaggingState, tracker))
    if getattr(optimizer, "is_paged", False):
        # On CUDA, bnb's paged optimizers allocate every state of >= 1e5 elements in managed memory (outside
        # torch's allocator); on the CPU it falls back to ordinary tensors. Keep the CUDA split.
        def get_state_buffer(param: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            buffer = torch.zeros_like(param, dtype=dtype)
            if param.numel() >= PAGED_MIN_NUMEL:
                tracker.retag(buffer, PAGED_OPTIMIZER_STATES)
            return buffer

        optimizer.get_state_buffer = get_state_buffer


def watch_gradients(model: torch.nn.Module, tracker: LiveTensorTracker) -> None:
    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(lambda p: tracker.retag(p.grad, GRADIENTS))


def forward(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    settings: Settings,
    autocast: bool,
    on_host: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """The loss of one micro-batch, as the Trainer computes it.

    With bf16/fp16, transformers' Trainer hands the model to accelerate, which wraps its forward in
    `torch.autocast` and converts the outputs to fp32 afterwards (`convert_outputs_to_fp32`): the logits get an
    fp32 copy that lives until `compute_loss` drops the outputs. Under autocast peft does not cast the adapters'
    inputs to fp32 and the fp32 adapters run on bf16 copies of their weights. With the chunked loss or
    activation offload the trainer's `compute_loss` runs `savers.micro_batch_loss` under the same autocast
    (its loss is fp32 already); `on_host` hears of each offloaded copy."""
    own_loss = savers.uses_own_loss(settings)
    mixed = autocast and settings.precision != "fp32"
    with (
        torch.autocast(device_type=batch["input_ids"].device.type, dtype=build.compute_dtype(settings))
        if mixed
        else contextlib.nullcontext()
    ):
        if own_loss:
            return savers.micro_batch_loss(model, batch, settings, on_host=on_host)
        outputs = model(**batch)
    if not mixed:
        return outputs.loss
    from accelerate.utils import convert_to_fp32

    return convert_to_fp32(outputs).loss


def run_training_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    settings: Settings,
    tracker: LiveTensorTracker,
    make_batch: Callable[[], dict[str, torch.Tensor]],
    steps: int = STEPS,
    autocast: bool = True,
) -> None:
    """Run `steps` optimizer steps under `tracker` (which must already count the model's tensors)."""
    labels = PhaseLabels(model, tracker)
    watch_gradients(model, tracker)
    watch_optimizer(optimizer, tracker)
    trainable = [p for p in model.parameters() if p.requires_grad]
    micro_batches = min(settings.grad_accum, 2)
    with tracker, torch.autograd.graph.saved_tensors_hooks(tracker.pack_saved, _unpack):
        for step in range(1, steps + 1):
            labels.step = step
            for micro_batch in range(1, micro_batches + 1):
                labels.micro_batch = micro_batch
                labels.set("batch")
                tracker.start_forward()
                batch = make_batch()
                loss = forward(model, batch, settings, autocast, on_host=tracker.mark_host)
                if settings.grad_accum > 1:
                    loss = loss / settings.grad_accum
                tracker.retag_forward_leftovers()
                labels.set("backward: loss")
                loss.backward()
                del loss, batch
            labels.micro_batch = 0
            labels.set("gradient clipping")
            torch.nn.utils.clip_grad_norm_(trainable, MAX_GRAD_NORM, foreach=True)  # the CUDA default
            labels.set("optimizer step")
            optimizer.step()
            labels.set("zero grad")
            model.zero_grad(set_to_none=True)
        labels.step, labels.micro_batch = steps + 1, 0
        labels.set("after the steps")


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def token_batch(vocab_size: int, micro_batch: int, seq_len: int) -> Callable[[], dict[str, torch.Tensor]]:
    """input_ids and labels (a separate copy, as the causal-LM collators make). No attention mask: an all-ones
    mask is dropped by transformers, which then runs the same causal attention."""

    def make() -> dict[str, torch.Tensor]:
        input_ids = torch.randint(0, vocab_size, (micro_batch, seq_len))
        return {"input_ids": input_ids, "labels": input_ids.clone()}

    return make


def padded_batches(vocab_size: int, micro_batch: int, lengths: Sequence[int]) -> Callable[[], dict[str, torch.Tensor]]:
    """Micro-batches padded to their longest row, as a collator pads: one length after the other."""
    upcoming = iter(lengths)
    return lambda: token_batch(vocab_size, micro_batch, next(upcoming))()
