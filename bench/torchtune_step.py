"""torchtune's step where no stack lorafit offers goes: the terms the measured torchtune rows need beyond lorafit's
estimator (`make bench-memory`, bench/memory_accuracy.py: TTPR-01/02, TT-20..25).

src/lorafit/memory.py sums the terms of the steps `--stack` offers (src/lorafit/catalog/stacks.toml). Three code
paths of torchtune's recipes (torchtune 0.6, recipes/full_finetune_single_device.py and
lora_finetune_single_device.py) are in none of those steps, so they live here, beside the rows that ran them:

- `optimizer_in_backward` (optimizer_in_bwd=True): each parameter is stepped as soon as its gradient exists,
  inside backward, so about one layer's gradients are alive at a time, the LM head's and the embedding's are
  never held for a later step, and no optimizer temporaries outlive one parameter;
- `activation_offload` (enable_activation_offloading): the checkpointed layer inputs wait in host memory;
- `loss="chunked"` (CEWithChunkedOutputLoss): every chunk's logits are upcast to fp32 and its log-softmax kept
  (4 x V bytes per token), with one chunk's temporaries of up to 1024 tokens.

`StepRuntime` is memory.Runtime with these flags; `estimate` runs lorafit's own `memory.estimate` with the terms
they change in place of memory's while it runs. With the flags off every term is memory's own.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Literal

from lorafit import memory
from lorafit.hardware import GpuSpec
from lorafit.models import ModelSpec
from lorafit.options import DEFAULT_HEADROOM
from lorafit.schema import Estimate, Settings

# memory's own terms, which the versions below fall back to
_PRODUCT = {
    name: getattr(memory, name)
    for name in (
        "gradient_bytes",
        "head_grad_bytes",
        "embedding_grad_bytes",
        "optimizer_step_temp_bytes",
        "checkpoint_bytes_per_layer",
        "logits_bytes",
    )
}
# lorafit.memory's modules, where its terms call one another
MEMORY_MODULES = ("runtime", "weights", "activations", "loss", "host", "allocator")
TORCHTUNE_LOSS_CHUNK_TOKENS = 1024  # the most tokens one of CEWithChunkedOutputLoss's chunks holds in this model


class StepRuntime(memory.Runtime):
    """memory.Runtime with torchtune's code paths that no offered stack runs (the module docstring)."""

    # "chunked": torchtune's CEWithChunkedOutputLoss, besides the losses of the offered stacks
    loss: Literal["hf", "chunked", "chunked_compute", "fused_logprob"] = "hf"  # type: ignore[assignment]
    optimizer_in_backward: bool = False  # step each parameter in backward: gradients never pile up
    activation_offload: bool = False  # checkpointed layer inputs live in host memory


def _flag(runtime: memory.Runtime, name: str) -> bool:
    return isinstance(runtime, StepRuntime) and bool(getattr(runtime, name))


def gradient_bytes(spec: ModelSpec, settings: Settings, runtime: memory.Runtime) -> float:
    """Stepping each parameter inside backward keeps only about one layer's gradients alive at a time."""
    grads = _PRODUCT["gradient_bytes"](spec, settings, runtime)
    return grads / spec.num_hidden_layers if _flag(runtime, "optimizer_in_backward") else grads


def head_grad_bytes(spec: ModelSpec, settings: Settings, runtime: memory.Runtime) -> float:
    """The LM head's gradients are consumed by its step in backward, never held for a later one."""
    return 0.0 if _flag(runtime, "optimizer_in_backward") else _PRODUCT["head_grad_bytes"](spec, settings, runtime)


def embedding_grad_bytes(spec: ModelSpec, settings: Settings, runtime: memory.Runtime) -> float:
    """As the head's: the embedding's gradient is stepped as it is made."""
    if _flag(runtime, "optimizer_in_backward"):
        return 0.0
    return _PRODUCT["embedding_grad_bytes"](spec, settings, runtime)


def optimizer_step_temp_bytes(spec: ModelSpec, settings: Settings, runtime: memory.Runtime) -> float:
    """A step inside backward runs one parameter at a time: no parameter-sized temporaries over the model."""
    if _flag(runtime, "optimizer_in_backward"):
        return 0.0
    return _PRODUCT["optimizer_step_temp_bytes"](spec, settings, runtime)


def checkpoint_bytes_per_layer(spec: ModelSpec, settings: Settings, runtime: memory.Runtime) -> float:
    """Offloaded activations: the checkpointed layer inputs are in host memory, none on the GPU."""
    if _flag(runtime, "activation_offload"):
        return 0.0
    return _PRODUCT["checkpoint_bytes_per_layer"](spec, settings, runtime)


def logits_bytes(spec: ModelSpec, settings: Settings, runtime: memory.Runtime, gpu_bytes: float | None = None) -> float:
    """torchtune's chunked loss keeps the fp32 log-softmax of every chunk (4 x V x N) and one chunk's three fp32
    temporaries of up to 1024 tokens (12 x V each); the other losses are memory's."""
    if isinstance(runtime, StepRuntime) and runtime.loss == "chunked":
        n, vocab = settings.tokens_per_micro_batch, spec.vocab_size
        return 4 * vocab * n + 3 * 4 * vocab * min(n, TORCHTUNE_LOSS_CHUNK_TOKENS)
    return _PRODUCT["logits_bytes"](spec, settings, runtime, gpu_bytes)


TERMS: dict[str, Callable[..., float]] = {
    "gradient_bytes": gradient_bytes,
    "head_grad_bytes": head_grad_bytes,
    "embedding_grad_bytes": embedding_grad_bytes,
    "optimizer_step_temp_bytes": optimizer_step_temp_bytes,
    "checkpoint_bytes_per_layer": checkpoint_bytes_per_layer,
    "logits_bytes": logits_bytes,
}


def _binding_modules(name: str) -> list[ModuleType]:
    """lorafit.memory and each of its modules that holds `name`: its functions call one another by the names
    their own module holds."""
    modules = [memory, *(importlib.import_module(f"lorafit.memory.{part}") for part in MEMORY_MODULES)]
    return [module for module in modules if hasattr(module, name)]


@contextmanager
def torchtune_terms() -> Iterator[None]:
    """memory's terms replaced by the ones above while an estimate runs, in every module of lorafit.memory that
    calls them; memory's own restored after."""
    for name, term in TERMS.items():
        for module in _binding_modules(name):
            setattr(module, name, term)
    try:
        yield
    finally:
        for name, term in _PRODUCT.items():
            for module in _binding_modules(name):
                setattr(module, name, term)


def estimate(
    spec: ModelSpec,
    settings: Settings,
    gpu: GpuSpec | None = None,
    headroom: float = DEFAULT_HEADROOM,
    runtime: memory.Runtime | None = None,
) -> Estimate:
    """memory.estimate of a row's step: with torchtune's terms where `runtime` is a StepRuntime."""
    if not isinstance(runtime, StepRuntime):
        return memory.estimate(spec, settings, gpu, headroom, runtime)
    with torchtune_terms():
        return memory.estimate(spec, settings, gpu, headroom, runtime)
