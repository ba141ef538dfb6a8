"""The memory savers of `lorafit train`, each plain PyTorch around the transformers model, and each one a
setting of the plan (`Settings.loss`, `offload_activations`, `offload_embeddings`, `expandable_segments`).

- The chunked loss runs the LM head and the fp32 cross-entropy on `memory.LOSS_CHUNK_TOKENS` tokens at a time
  under non-reentrant checkpointing, so no chunk's logits outlive its own forward and backward: the same sum
  over the same tokens as transformers' `ForCausalLMLoss`, in a few hundred MiB instead of 12 bytes x vocabulary
  per token.
- Activation offload copies the residual stream that each checkpointed layer saves for backward into pinned
  host memory (a side stream on CUDA, so the copy overlaps the next layer) and back when backward needs it.
- Embedding offload keeps a frozen, untied input embedding in host memory: the lookup runs there and only the
  looked-up rows go to the GPU.
- Expandable segments is PyTorch's allocator setting, put in the environment before CUDA starts.

The trainer (`LorafitTrainer.compute_loss`) and the `--exact` trace (`trace.step.forward`) both call
`micro_batch_loss`, so the trace measures the code that trains. torch is imported inside the functions.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from lorafit.memory import LOSS_CHUNK_TOKENS

if TYPE_CHECKING:
    import torch

    from lorafit.schema import Settings

IGNORE_INDEX = -100  # transformers' label for a token that is not scored
ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # the new name first; torch reads both


def uses_own_loss(settings: Settings) -> bool:
    """Whether the step runs the decoder and the loss itself instead of the model's own forward."""
    return settings.loss == "chunked" or settings.offload_activations


# --- the loss --------------------------------------------------------------------------------------------------
def causal_lm_loss(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    labels: torch.Tensor,
    *,
    chunk_tokens: int | None,
    num_items_in_batch: torch.Tensor | int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Next-token cross-entropy of `head(hidden)` against `labels`, as transformers' ForCausalLMLoss computes
    it (fp32 logits, labels shifted by one, the sum over scored tokens divided by `num_items_in_batch`, else
    their mean). With `chunk_tokens`, the head and the loss run on that many tokens at a time, and each chunk
    is recomputed in backward instead of keeping its logits."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    # position t predicts label t + 1; the last position predicts nothing (transformers pads, we drop it)
    flat_hidden = hidden[:, :-1, :].reshape(-1, hidden.shape[-1])
    flat_labels = labels[:, 1:].reshape(-1).to(hidden.device)

    def chunk_loss(chunk_hidden: torch.Tensor, chunk_labels: torch.Tensor) -> torch.Tensor:
        logits = head(chunk_hidden)
        if softcap:  # Gemma-2 caps the logits in the compute dtype before the loss upcasts them
            logits = torch.tanh(logits / softcap) * softcap
        return F.cross_entropy(logits.float(), chunk_labels, ignore_index=IGNORE_INDEX, reduction="sum")

    if chunk_tokens is None or chunk_tokens >= flat_labels.numel():
        total = chunk_loss(flat_hidden, flat_labels)
    else:
        total = sum(
            checkpoint(chunk_loss, part_hidden, part_labels, use_reentrant=False)
            for part_hidden, part_labels in zip(
                flat_hidden.split(chunk_tokens), flat_labels.split(chunk_tokens), strict=True
            )
        )
    if num_items_in_batch is None:
        return total / (flat_labels != IGNORE_INDEX).sum().clamp(min=1)
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def micro_batch_loss(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    settings: Settings,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
    on_host: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """The loss of one micro-batch with the savers `settings` turns on: the decoder (its saved residual
    stream in host memory with offload_activations), then the head and the loss (chunked or whole).
    `on_host` is told of each host copy (the trace counts them as host memory, not device memory)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    batch = {key: value for key, value in inputs.items() if key != "labels"}
    decoder = decoder_of(base)
    offload = (
        ActivationOffload(base.config.hidden_size, on_host, stop_at=getattr(decoder, "norm", None))
        if settings.offload_activations
        else contextlib.nullcontext()
    )
    with offload:
        hidden = decoder(**batch, use_cache=False).last_hidden_state
    chunk = LOSS_CHUNK_TOKENS if settings.loss == "chunked" else None
    return causal_lm_loss(
        hidden,
        base.get_output_embeddings(),
        inputs["labels"],
        chunk_tokens=chunk,
        num_items_in_batch=num_items_in_batch,
        softcap=getattr(base.config, "final_logit_softcapping", None),
    )


def decoder_of(base: torch.nn.Module) -> Any:
    """The causal LM's decoder (`get_decoder()`), except where transformers' lookup returns the whole model:
    MllamaForCausalLM's base_model_prefix names a `language_model` it does not have; its decoder is `model`
    (transformers 5.25 modeling_mllama.py:1170-1177, modeling_utils.py get_decoder)."""
    decoder = base.get_decoder()
    return base.model if decoder is base and hasattr(base, "model") else decoder


# --- activation offload ----------------------------------------------------------------------------------------
class ActivationOffload:
    """saved_tensors_hooks that keep what the checkpointed decoder layers save for backward (their inputs, the
    residual stream: a tensor whose last dimension is the hidden size) in host memory until backward needs it.

    Around the decoder's forward only: inside a checkpointed layer the checkpoint's own hooks take over, so
    what reaches these hooks is what the checkpoint keeps, the layers' inputs. The final norm runs after the
    layers and keeps its few saved tensors on the device (`stop_at`: its forward switches the offload off), as
    do the rotary tables and masks, which are not hidden-sized."""

    def __init__(
        self,
        hidden_size: int,
        on_host: Callable[[torch.Tensor], None] | None = None,
        stop_at: torch.nn.Module | None = None,
    ) -> None:
        import torch

        self.hidden_size = hidden_size
        self.on_host = on_host
        self.stop_at = stop_at
        self.active = True
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._stop_hook: Any = None

    def __enter__(self) -> ActivationOffload:
        self.active = True
        if self.stop_at is not None:
            self._stop_hook = self.stop_at.register_forward_pre_hook(self._stop)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        if self._stop_hook is not None:
            self._stop_hook.remove()
            self._stop_hook = None

    def _stop(self, *_: object) -> None:
        self.active = False

    def pack(self, tensor: torch.Tensor) -> Any:
        if (
            not self.active
            or tensor.dim() < 2
            or tensor.shape[-1] != self.hidden_size
            or not tensor.is_floating_point()
        ):
            return tensor
        import torch

        on_cuda = tensor.device.type == "cuda"
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=on_cuda)
        if on_cuda and self.stream is not None:
            # the copy waits for the kernel that made the tensor, then runs beside the next layer's compute;
            # record_stream keeps the allocator from reusing the tensor's memory before the copy is done
            self.stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(self.stream):
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self.stream)
        else:
            host.copy_(tensor)
        if self.on_host is not None:
            self.on_host(host)
        return (tensor.device, host, self.stream)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if not isinstance(packed, tuple):
            return packed
        import torch

        device, host, stream = packed
        if device.type == "cuda" and stream is not None:
            torch.cuda.current_stream(device).wait_stream(stream)  # the copy out has finished
            return host.to(device, non_blocking=True)
        return host.clone() if device.type == "cpu" else host.to(device)


# --- embedding offload -----------------------------------------------------------------------------------------
@functools.cache
def host_embedding_class() -> type:
    """The class, made once torch is imported (this module imports no torch at import time)."""
    import torch

    class HostEmbedding(torch.nn.Module):
        """A frozen input embedding kept in host memory: `model.to(device)` leaves it there, the lookup runs
        on the CPU and the looked-up rows are copied to wherever the token ids are."""

        def __init__(self, embedding: torch.nn.Module) -> None:
            super().__init__()
            embedding.requires_grad_(False)
            self.embedding = embedding.to("cpu")

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.embedding(input_ids.to("cpu")).to(input_ids.device, non_blocking=True)

        def _apply(self, fn: Any, recurse: bool = True) -> HostEmbedding:
            return self  # moves and casts of the model stop here: the table stays in host memory as it is

        @property
        def weight(self) -> torch.Tensor:
            return self.embedding.weight

    return HostEmbedding


def keep_embeddings_on_host(model: torch.nn.Module) -> torch.nn.Module:
    """Replace the input embedding of a (peft-wrapped) causal LM by a HostEmbedding; return the new module."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    host = host_embedding_class()(base.get_input_embeddings())
    base.set_input_embeddings(host)
    return host


def host_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors of `model` that keep_embeddings_on_host put in host memory."""
    kind = host_embedding_class()
    return [module.weight for module in model.modules() if isinstance(module, kind)]


# --- the allocator ---------------------------------------------------------------------------------------------
def allocator_environment(settings: Settings, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment variables to set before CUDA starts for `settings.expandable_segments`: the user's own
    allocator settings kept, expandable segments added (or, when they asked for it, left as they set it)."""
    if not settings.expandable_segments:
        return {}
    name = next((var for var in ALLOC_CONF_VARIABLES if environ.get(var)), ALLOC_CONF_VARIABLES[0])
    current = environ.get(name, "")
    if "expandable_segments" in current:
        return {}
    return {name: ",".join(part for part in (current, "expandable_segments:True") if part)}


def use_allocator_settings(settings: Settings, on_cuda: bool) -> None:
    """Expandable segments for this process (and what it starts), before the model takes any CUDA memory."""
    import os

    added = allocator_environment(settings, os.environ)
    os.environ.update(added)
    if added and on_cuda:
        import torch

        torch.cuda.memory._set_allocator_settings("expandable_segments:True")  # CUDA may have read the env already
