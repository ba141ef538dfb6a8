"""`lorafit estimate --exact`: the peak memory of a training step, traced through the real code path.

The model is built from its config with fake tensors (shapes and dtypes, no data) through the trainer's own
set-up (`lorafit.train.build`: quantisation, checkpointing, LoRA, the optimizer), two training steps run under
a dispatch-level tracker that counts every live tensor storage, and module and autograd hooks name the phase
each byte belongs to. See docs/exact.md.

Nothing heavy is imported until a function is called, so importing `lorafit.trace` stays instant.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DepthTrace", "StepTrace", "exact_estimate", "real_step", "trace_depth", "trace_step"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from lorafit.train.build import quiet_libraries

        quiet_libraries()  # before torch and bitsandbytes load: the trace prints lorafit's figures only
        from lorafit.trace import api

        return getattr(api, name)
    raise AttributeError(f"module 'lorafit.trace' has no attribute {name!r}")
