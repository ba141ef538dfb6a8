"""Real training steps at a model's real shapes with random weights, measured: the engine of `lorafit measure`
and of `make gpu-check` (bench/gpu_check.py), one implementation for both.

A base is built from the model's config with random weights (`build_random_model`; nothing is downloaded), loaded
(and quantised) by `lorafit.train.build.load_model` as `lorafit train` loads it (`load_base`), given its adapters
by `build.checked_prepare` (`prepare`), and trained by transformers' Trainer under the arguments of
`train/hf_args.py` for a warm-up step and some timed steps on random tokens (`train_steps`). Measured:
torch.cuda.max_memory_allocated and max_memory_reserved, the device figure (what nvidia-smi shows for the process,
`DeviceMemory`; on the CPU the process's peak resident memory, `HostMemory`) and tokens/s over the timed
steps. torch and transformers are imported inside the functions, so that `lorafit plan` never loads them.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafit.models import ModelSpec
from lorafit.options import Settings
from lorafit.train import build, hf_args, savers
from lorafit.train.config import TrainConfig
from lorafit.units import gib

if TYPE_CHECKING:
    import torch
    from transformers import TrainerCallback

WARMUP_STEPS = 1  # the first step loads kernels and creates the optimizer states: not timed
SAMPLE_INTERVAL_S = 0.02  # how often a memory figure without a recorded peak (NVML, RSS) is read


# --- the device figure ----------------------------------------------------------------------------------------
class DeviceMemory:
    """What nvidia-smi shows for this process: the device's used memory less what was used before this process
    started CUDA, so that the CUDA context counts as it does in nvidia-smi. Read through NVML (pynvml), else
    through the nvidia-smi command, else through torch.cuda.mem_get_info, whose baseline can only be taken once CUDA
    has started and so leaves out the context created then; `source` says which."""

    def __init__(self) -> None:
        import torch

        read, self.source, self.interval_s = reader_without_cuda()
        self.includes_context = read is not None
        if read is not None:
            self.baseline = read()
        torch.cuda.init()
        torch.cuda.synchronize()
        if read is None:
            read, self.source, self.interval_s = mem_used, MEM_GET_INFO, SAMPLE_INTERVAL_S
            self.baseline = read()
        self.read: Callable[[], int] = read

    def now(self) -> int:
        return self.read() - self.baseline

    def outside_allocator(self) -> int:
        """The process's device memory that torch's allocator does not hold: the CUDA context, loaded kernels."""
        import torch

        return max(self.now() - int(torch.cuda.memory_reserved()), 0)


BASELINE = "device memory used less its value before this process started CUDA"
MEM_GET_INFO = "torch.cuda.mem_get_info: used memory less its value at CUDA start-up (no CUDA context)"


def reader_without_cuda() -> tuple[Callable[[], int] | None, str, float]:
    """A reading of the GPU's used memory that needs no CUDA context, so that the baseline comes before this
    process's: NVML (every 20 ms), else the nvidia-smi command (every 0.5 s); (None, "", 0) without either."""
    handle = nvml_handle()
    if handle is not None:
        import pynvml

        return (lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)), "nvml: " + BASELINE, SAMPLE_INTERVAL_S
    smi = shutil.which("nvidia-smi")
    if smi is not None and nvidia_smi_used(smi) is not None:
        return (lambda: nvidia_smi_used(smi) or 0), "nvidia-smi memory.used: " + BASELINE, 0.5
    return None, "", 0.0


def mem_used() -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def visible_index() -> int:
    """The physical index of the GPU this process uses (the first of CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(visible) if visible.isdigit() else 0


def nvml_handle() -> Any:
    """NVML's handle of the GPU this process uses, None without pynvml or a driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(visible_index())
    except Exception:  # pynvml raises its own error types (no driver, no such device)
        return None


def nvidia_smi_used(command: str) -> int | None:
    """The GPU's used memory in bytes as nvidia-smi prints it (MiB), None where it answers nothing readable."""
    query = [command, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", str(visible_index())]
    try:
        done = subprocess.run(query, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = done.stdout.strip()
    return int(float(text.splitlines()[0]) * 2**20) if done.returncode == 0 and text and text[0].isdigit() else None


def resident_bytes() -> int | None:
    """This process's resident memory (/proc/self/statm), None where the system has no /proc (macOS)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def load_libraries() -> None:
    """Import what the measurement runs (torch, transformers, peft), so that a figure taken after this leaves
    their code out. The libraries are quietened first: bitsandbytes logs when it is imported."""
    build.quiet_libraries()
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401


def peak_resident_bytes() -> int | None:
    """The process's peak resident memory (VmHWM in /proc/self/status), None where the system has no /proc."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_resident() -> bool:
    """Start the process's peak resident memory again from what is resident now (Linux: "5" to clear_refs);
    False where the kernel does not allow it, and the peak then is the whole process's."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


class HostMemory:
    """The CPU's stand-in for the device figure: the process's peak resident memory while the model is built
    and trained (libraries and data included, as the device figure includes the CUDA context). A peak, not a
    growth: memory the process freed before is reused without growing what is resident. Only where /proc is
    readable (`available`)."""

    interval_s = SAMPLE_INTERVAL_S

    def __init__(self) -> None:
        since = "the measurement began" if reset_peak_resident() else "the process started"
        self.source = f"CPU: the process's peak resident memory (RSS high-water mark, VmHWM) since {since}"

    @staticmethod
    def available() -> bool:
        return peak_resident_bytes() is not None

    def now(self) -> int:
        return peak_resident_bytes() or 0


Probe = DeviceMemory | HostMemory


class PeakSampler:
    """The highest value `read` returns while the block runs: sampled from a thread and once more at the end."""

    def __init__(self, read: Callable[[], int], interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.read = read
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakSampler:
        self.peak = self.read()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.read())


# --- the process --------------------------------------------------------------------------------------------
def free_memory(on_cuda: bool) -> None:
    """Give the GPU back what the last run left: the Trainer and accelerate hold the optimizer in reference
    cycles, so a collection comes first (fast: `process_settings` freezes what the imports made)."""
    if on_cuda:
        import torch

        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def process_settings(on_cuda: bool, one_thread: bool = False) -> Iterator[None]:
    """Quiet libraries; on a GPU, the imports' objects frozen (never garbage, so each run's collection skips
    them); on the CPU, denormals flushed as `lorafit train` does there, and with `one_thread` a single thread
    (tiny matmuls run 10x slower when their threads wait on a busy machine's other processes). What is changed
    is put back (the tests run this in their process)."""
    import torch

    build.quiet_libraries()
    threads = torch.get_num_threads()
    flush = torch.set_flush_denormal(True) if not on_cuda else False  # unflushed tiny values: 10-100x slower
    if on_cuda:
        gc.freeze()
    elif one_thread:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if flush:
            torch.set_flush_denormal(False)
        gc.unfreeze()


# --- building and loading the model -------------------------------------------------------------------------
def build_random_model(spec: ModelSpec, settings: Settings, folder: Path, device: str) -> None:
    """Random weights at `spec`'s shapes, saved as safetensors, in bf16 as checkpoints are published. Built on
    `device` (initialising 8B parameters on the CPU takes minutes)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(build.hf_config(spec, settings), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    free_memory(device == "cuda")


def load_base(folder: Path, settings: Settings, device: str) -> Any:
    """`build.load_model` as `lorafit train` calls it: a quantised base goes straight to the GPU, a 16-bit one is
    loaded on the CPU and moved by the Trainer (here: before the optimizer is built, which the Trainer also does)."""
    import torch

    on_cuda = device == "cuda"
    device_map = {"": torch.cuda.current_device()} if on_cuda and settings.quant != "none" else None
    model = build.load_model(folder, settings, device_map=device_map)
    if on_cuda and settings.quant == "none":
        model.to("cuda")
    return model


def prepare(base: Any, spec: ModelSpec, settings: Settings) -> Any:
    """`build.checked_prepare` (checkpointing, LoRA adapters) on a loaded base, with the adapters' seed fixed."""
    from transformers import set_seed

    set_seed(0)
    base.gradient_checkpointing_disable()  # a base reused from a checkpointed run; prepare enables it again
    return build.checked_prepare(base, spec, settings)


def unprepare(model: Any) -> Any:
    """The base back without its adapters (peft's unload), to prepare it again for other settings."""
    return model.unload()


# --- lorafit train's step -----------------------------------------------------------------------------------
def step_timer(on_cuda: bool) -> TrainerCallback:
    """A Trainer callback whose `seconds` are those of each optimizer step (all its micro-batches, clipping, the
    optimizer and zero_grad), the GPU synchronised at both ends."""
    import torch
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self._start = 0.0

        def _now(self) -> float:
            if on_cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._start = self._now()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.seconds.append(self._now() - self._start)

    return StepTimer()


def random_tokens(vocab_size: int, settings: Settings, steps: int) -> list[dict[str, torch.Tensor]]:
    """Rows of seq_len random tokens, labels a copy (the causal-LM collators' layout), enough for `steps` steps."""
    import torch

    generator = torch.Generator().manual_seed(0)
    count = steps * settings.micro_batch * settings.grad_accum
    ids = torch.randint(0, vocab_size, (count, settings.seq_len), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def saver_trainer(settings: Settings) -> type:
    """transformers' Trainer, with the loss of `savers.micro_batch_loss` where the chunked loss or activation
    offload is on (as `lorafit train`'s LorafitTrainer.compute_loss runs it in one process)."""
    from transformers import Trainer

    class SaverTrainer(Trainer):
        def compute_loss(
            self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
        ) -> Any:
            if return_outputs or not savers.uses_own_loss(settings):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            with self.accelerator.autocast():
                return savers.micro_batch_loss(model, inputs, settings, num_items_in_batch=num_items_in_batch)

    return SaverTrainer


def train_steps(model: Any, spec: ModelSpec, settings: Settings, steps: int, device: str, workdir: Path) -> list[float]:
    """`steps` optimizer steps of transformers' Trainer with the arguments `lorafit train` gives it
    (hf_args.training_kwargs), the optimizer build.build_optimizer makes and the loss its savers take; no
    checkpoint is written. The seconds of each step."""
    from transformers import TrainingArguments, default_data_collator
    from transformers.trainer_callback import PrinterCallback

    on_cuda = device == "cuda"
    config = TrainConfig(max_steps=steps)
    arguments = hf_args.training_kwargs(config, settings, output_dir=str(workdir), on_cuda=on_cuda, eval_steps=None)
    optimizer = build.build_optimizer(
        model, settings, learning_rate=config.learning_rate, weight_decay=config.weight_decay
    )
    timer = step_timer(on_cuda)
    trainer = saver_trainer(settings)(
        model=model,
        args=TrainingArguments(**(arguments | {"save_strategy": "no"})),
        train_dataset=random_tokens(spec.vocab_size, settings, steps),
        data_collator=default_data_collator,
        optimizers=(optimizer, None),
        callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)
    try:
        trainer.train()
    finally:
        model.zero_grad(set_to_none=True)
        trainer.optimizer = trainer.lr_scheduler = None
        del trainer, optimizer
    return list(timer.seconds)  # type: ignore[attr-defined]


@contextlib.contextmanager
def sampled(probe: Probe | None) -> Iterator[PeakSampler | None]:
    """Run the block with the probe's memory figure sampled (the sampler's `peak`, kept when the block fails, as
    on running out of memory), the GPU's leftovers freed and its allocator peaks reset first."""
    on_cuda = isinstance(probe, DeviceMemory)
    free_memory(on_cuda)
    if on_cuda:
        import torch

        torch.cuda.reset_peak_memory_stats()
    sampler = PeakSampler(probe.now, probe.interval_s) if probe is not None else None
    with sampler or contextlib.nullcontext():
        yield sampler


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# --- the figures ----------------------------------------------------------------------------------------------
def measured_speed(settings: Settings, seconds: list[float]) -> dict[str, Any]:
    """tokens/s over the timed steps (those after the warm-up)."""
    timed = seconds[WARMUP_STEPS:]
    tokens = settings.micro_batch * settings.seq_len * settings.grad_accum
    return {
        "tokens_per_s": round(tokens * len(timed) / sum(timed), 1) if timed and sum(timed) > 0 else None,
        "step_seconds": [round(value, 4) for value in seconds],
    }


def measured_memory(probe: Probe | None, device_peak: int | None) -> dict[str, Any]:
    """The allocator's peaks since the reset and the probe's sampled peak, in GiB; None for what this device has
    not (the CPU has no CUDA allocator; without a probe, no device figure either)."""
    if not isinstance(probe, DeviceMemory):
        return {
            "allocated_gib": None,
            "reserved_gib": None,
            "device_gib": round(gib(device_peak), 4) if probe is not None and device_peak is not None else None,
            "device_source": probe.source if probe is not None else None,
            "note": "allocated and reserved not measured: the run is on the CPU, which has no CUDA allocator"
            + ("" if probe is not None else " (nor device memory to read)"),
        }
    import torch

    torch.cuda.synchronize()
    return {
        "allocated_gib": round(gib(torch.cuda.max_memory_allocated()), 4),
        "reserved_gib": round(gib(torch.cuda.max_memory_reserved()), 4),
        "device_gib": round(gib(device_peak), 4) if device_peak is not None else None,
        "device_source": probe.source,
    }
