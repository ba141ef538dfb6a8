"""`lorafit estimate --exact`: the peak memory of a training step, traced through the real code path.

The model is built from its config with fake tensors (shapes and dtypes, no data) through the trainer's own
set-up (`lorafit.train.build`: quantisation, checkpointing, LoRA, the optimizer), two training steps run under
a dispatch-level tracker that counts every live tensor storage, and module and autograd hooks name the phase
each byte belongs to. See docs/exact.md.

Nothing heavy is imported until a function is called (torch inside them), so importing `lorafit.trace` stays
instant; the names are reached through `__getattr__` so that the libraries are quietened first.
"""

from __future__ import annotations

from typing import Any

from lorafit.trace import api
from lorafit.train.build import quiet_libraries

__all__ = ["DepthTrace", "StepTrace", "exact_estimate", "real_step", "trace_depth", "trace_step"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        quiet_libraries()  # before torch and bitsandbytes load: the trace prints lorafit's figures only
        return getattr(api, name)
    raise AttributeError(f"module 'lorafit.trace' has no attribute {name!r}")
