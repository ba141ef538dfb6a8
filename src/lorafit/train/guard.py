"""Never run out of memory mid-run: a pre-flight check before step 1, and a retry at half the micro-batch.

Pre-flight (CUDA only): a few real steps on the worst micro-batch the data can produce (micro_batch copies of
its longest row), with the learning rate at zero and the optimizer state cleared afterwards, so the run
itself is unchanged; `torch.cuda.max_memory_reserved` is compared with the GPU's memory less the headroom.

Mid-run: an out-of-memory error inside a step leaves the weights and the optimizer as the previous step left
them (the step's gradients are thrown away), so the run saves a checkpoint of that step (with the random
state it had then) and goes on from it with half the micro-batch and twice the accumulation: the same
sequences form each optimizer step, and the loss is normalised over the whole step, so the results are the
same. Only an error inside the optimizer's own update, which may have changed some weights already, falls
back to the newest checkpoint on disk.

`LORAFIT_FAULT_OOM_AT_STEP=N` makes training step N raise torch.OutOfMemoryError once, to test this path.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from lorafit.errors import TrainError
from lorafit.units import gib

if TYPE_CHECKING:
    from lorafit.schema import Settings

FAULT_OOM_VARIABLE = "LORAFIT_FAULT_OOM_AT_STEP"
OOM_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory")
PREFLIGHT_STEPS = 2


class InjectedOom:
    """Raises torch.OutOfMemoryError in training step N (from LORAFIT_FAULT_OOM_AT_STEP), once per process."""

    def __init__(self) -> None:
        value = os.environ.get(FAULT_OOM_VARIABLE, "").strip()
        if value and not value.isdigit():
            raise TrainError(f"{FAULT_OOM_VARIABLE} must be a step number, got {value!r}")
        self.step = int(value) if value else None
        self.fired = False

    def check(self, step: int, last_micro_batch: bool) -> None:
        """Fire on the step's last micro-batch, after the others have accumulated gradients."""
        if self.step is None or self.fired or step != self.step or not last_micro_batch:
            return
        import torch

        self.fired = True
        raise torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate 2.00 GiB (injected at step {step} by {FAULT_OOM_VARIABLE})"
        )


_fault: InjectedOom | None = None


def injected_oom() -> InjectedOom:
    """One injector per process, shared by the trainers that retries build, so that it fires only once."""
    global _fault
    if _fault is None:
        _fault = InjectedOom()
    return _fault


def reset_injected_oom() -> None:
    """Read LORAFIT_FAULT_OOM_AT_STEP again (a new run in the same process, as in tests)."""
    global _fault
    _fault = None


def is_out_of_memory(error: BaseException) -> bool:
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in OOM_MESSAGES)


def smaller(settings: Settings) -> Settings | None:
    """The same effective batch with a smaller micro-batch: half (or the largest proper divisor), or None at 1."""
    micro = settings.micro_batch
    divisor = next((d for d in range(micro // 2, 0, -1) if micro % d == 0), None)
    if divisor is None:
        return None
    factor = micro // divisor
    return settings.model_copy(update={"micro_batch": divisor, "grad_accum": settings.grad_accum * factor})


def memory_savers(settings: Settings) -> list[str]:
    """The changes that would lower the peak of this run, and only those: a QLoRA run is not told to use
    QLoRA, nor a checkpointed one to turn checkpointing on. A shorter sequence always helps."""
    savers = [f"a shorter --seq-len (now {settings.seq_len})"]
    if not settings.grad_ckpt:
        savers.append("--grad-ckpt (recomputes activations in backward)")
    if settings.method == "full":
        savers.append("--method qlora or lora (trains adapters; the base gets no gradients or optimizer state)")
    elif settings.method == "lora":
        savers.append("--method qlora (a 4-bit base)")
    elif settings.quant == "int8":
        savers.append("--quant nf4 (a 4-bit base instead of 8-bit)")
    elif not settings.double_quant:
        savers.append("--double-quant (quantised scales)")
    if settings.optimizer in ("adamw", "adamw_8bit", "paged_adamw_32bit"):
        savers.append("--optimizer paged_adamw_8bit (8-bit states, paged out under pressure)")
    if settings.attn == "eager":
        savers.append("--attn sdpa (no materialised attention matrix)")
    return savers


def out_of_memory_at_one(step: int, settings: Settings) -> TrainError:
    """The one line for an out-of-memory error that halving cannot fix (micro-batch 1 already)."""
    return TrainError(
        f"out of memory in step {step} at micro-batch 1; try {'; or '.join(memory_savers(settings))}; "
        "or a GPU with more memory"
    )


def diverged(losses: dict[int, float], learning_rate: float) -> TrainError | None:
    """The one line for a training loss that became NaN or infinite (`losses`: step -> loss), None if none did."""
    bad = [step for step, loss in sorted(losses.items()) if not math.isfinite(loss)]
    if not bad:
        return None
    return TrainError(
        f"the training loss became {losses[bad[0]]} at step {bad[0]}: training diverged and the run stopped "
        f"unfinished; lower the learning rate (now {learning_rate:g}) and train again with --overwrite"
    )


# --- random state -------------------------------------------------------------------------------------------
@dataclass
class RandomState:
    python: Any
    numpy: Any
    torch_cpu: Any
    torch_cuda: Any


def capture_random_state() -> RandomState:
    import numpy as np
    import torch

    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return RandomState(random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda)


def restore_random_state(state: RandomState) -> None:
    import numpy as np
    import torch

    random.setstate(state.python)
    np.random.set_state(state.numpy)
    torch.set_rng_state(state.torch_cpu)
    if state.torch_cuda is not None:
        torch.cuda.set_rng_state(state.torch_cuda)


# --- pre-flight ---------------------------------------------------------------------------------------------
class MemoryProbe(Protocol):
    """Where the pre-flight reads memory from: the CUDA allocator (tests pass a stand-in)."""

    def reset(self) -> None: ...
    def peak_bytes(self) -> int: ...
    def budget_bytes(self) -> int: ...


class CudaProbe:
    def __init__(self, headroom: float) -> None:
        self.headroom = headroom

    def reset(self) -> None:
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    def peak_bytes(self) -> int:
        import torch

        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_reserved())

    def budget_bytes(self) -> int:
        import torch

        free, total = torch.cuda.mem_get_info()
        used_by_others = total - free - torch.cuda.memory_reserved()
        return int(total * (1 - self.headroom) - used_by_others)


@dataclass(frozen=True)
class PreflightResult:
    settings: Settings
    peak_bytes: int
    budget_bytes: int
    halvings: int


def preflight(
    trainer: Any, longest: dict[str, list[int]], settings: Settings, probe: MemoryProbe, steps: int = PREFLIGHT_STEPS
) -> PreflightResult:
    """Real steps on `micro_batch` copies of the longest row; halve the micro-batch until the peak fits.

    The learning rate is zero during these steps (AdamW, 8-bit or not, then changes no weight), the optimizer
    state they create is dropped, and the random state is put back, so training starts exactly as without
    them."""
    halvings = 0
    while True:
        try:
            peak = _measure(trainer, longest, settings.micro_batch, probe, steps)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            peak = None
        budget = probe.budget_bytes()
        if peak is not None and peak <= budget:
            return PreflightResult(settings, peak, budget, halvings)
        reduced = smaller(settings)
        if reduced is None:
            measured = "ran out of memory" if peak is None else f"needs {gib(peak):.1f} GiB"
            raise TrainError(
                f"does not fit: one step at micro-batch 1 of the longest row ({len(longest['input_ids'])} tokens) "
                f"{measured} and {gib(budget):.1f} GiB are free after headroom; try "
                f"{'; or '.join(memory_savers(settings))}"
            )
        settings = reduced
        halvings += 1


def _measure(trainer: Any, longest: dict[str, list[int]], micro_batch: int, probe: MemoryProbe, steps: int) -> int:
    import torch

    model = trainer.model
    state = capture_random_state()
    optimizer = trainer.create_optimizer()
    rates = [group["lr"] for group in optimizer.param_groups]
    batch = trainer.data_collator([dict(longest) for _ in range(micro_batch)])
    batch = {key: value.to(trainer.args.device) for key, value in batch.items() if torch.is_tensor(value)}
    probe.reset()
    try:
        model.train()
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        for _ in range(steps):
            with trainer.compute_loss_context_manager():
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return probe.peak_bytes()
    finally:
        del batch
        model.zero_grad(set_to_none=True)
        for group, rate in zip(optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        optimizer.state.clear()
        restore_random_state(state)
