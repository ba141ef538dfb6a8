"""One `lorafit measure`: the plan's configuration trained for a warm-up and a few timed steps on this machine's GPU
(or CPU), at the model's real shapes with random weights, measured beside the plan's estimate; the whole run's
time and cost from the measured speed. What this machine cannot run is refused, in one line, before anything is
built or written.
"""

from __future__ import annotations

import datetime
import platform
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lorafit import __version__, hardware, hostcard, memory
from lorafit.costs import time_and_cost
from lorafit.errors import InvalidConfig, LorafitError
from lorafit.hardware import GpuSpec
from lorafit.measure import engine
from lorafit.schema import Device, Plan
from lorafit.train import guard, savers
from lorafit.units import gib

DEFAULT_STEPS = 5  # timed steps after the warm-up: the "a few"; make gpu-check times 3 per row
BYTES_PER_BUILT_WEIGHT = 2  # the random model is built and saved in bf16, as checkpoints are published
LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate")


# --- what this machine can measure ----------------------------------------------------------------------------
def check_steps(steps: int) -> None:
    if steps < 1:
        raise InvalidConfig(f"--steps {steps}: measure at least 1 timed step (after the warm-up step)")


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def open_device(cpu: bool) -> tuple[Device, engine.Probe | None]:
    """The device to measure on and its memory probe, made first: the device figure's baseline is taken before
    this process starts CUDA, the CPU's before the model is built."""
    if cpu:
        engine.load_libraries()  # their code in memory is not the measurement's: the baseline comes after it
        return "cpu", engine.HostMemory() if engine.HostMemory.available() else None
    if not cuda_available():
        raise InvalidConfig(
            "no CUDA GPU found: `lorafit measure` runs the plan on this machine's GPU; add --cpu to measure on the "
            "CPU (small models)"
        )
    return "cuda", engine.DeviceMemory()


def local_card(device: Device, given: Mapping[str, Any]) -> GpuSpec | None:
    """The card the estimate is for: on the CPU the host CPU's measured rates (`hostcard.cpu_card`); on a GPU
    --gpu / --vram where given (None: the plan reads them), else the detected GPU."""
    if device == "cpu":
        named = [flag for flag, key in (("--gpu", "gpu"), ("--vram", "vram")) if key in given]
        if named:
            raise InvalidConfig(f"--cpu measures against this CPU's own rates; drop {' and '.join(named)}")
        return hostcard.cpu_card()
    if "gpu" in given or "vram" in given:
        return None
    return hardware.detected_gpu()


def built_gib(plan: Plan) -> float:
    """The random bf16 model's size: on disk, and in host memory wherever it is built or loaded there."""
    return gib(plan.model.num_params * BYTES_PER_BUILT_WEIGHT)


def free_gpu_gib() -> float:
    import torch

    return gib(torch.cuda.mem_get_info()[0])


def build_device(plan: Plan, device: Device) -> Device:
    """Where the random model is built: on the GPU where its bf16 weights fit in the free memory (8B parameters
    take minutes to initialise on the CPU), else on the CPU."""
    return "cuda" if device == "cuda" and built_gib(plan) < free_gpu_gib() else "cpu"


def host_gib_needed(plan: Plan, device: Device) -> float:
    """Host memory the measurement takes: on the CPU the whole step (the estimate's peak) or the built model,
    whichever is more; on a GPU the bf16 model where it is built on the CPU or loaded there (a 16-bit base goes
    through host memory, as in `lorafit train`), else nothing to speak of."""
    if device == "cpu":
        return max(plan.estimate.peak_device_gib, built_gib(plan))
    through_host = plan.settings.quant == "none" or build_device(plan, device) == "cpu"
    return built_gib(plan) if through_host else 0.0


def check_plan(plan: Plan, device: Device, workdir: Path) -> None:
    """Refuse what this machine cannot measure: a plan that does not fit its card, several processes, a model
    too big for the GPU's free memory, the host's available RAM, or the disk the random model is saved to."""
    settings = plan.settings
    card = plan.gpu.name if plan.gpu else "the device"
    if settings.n_gpus * settings.nodes > 1 or settings.offload != "none":
        raise InvalidConfig(
            f"`lorafit measure` runs one process on one device; the plan uses {settings.n_gpus * settings.nodes} "
            f"GPU(s) with shard {settings.shard} and offload {settings.offload}: pass --n-gpus 1 --offload none"
        )
    if settings.stack != "lorafit":
        raise InvalidConfig(
            f"`lorafit measure` runs lorafit's own training step; the plan is for {settings.stack}'s: add "
            "--stack lorafit to measure lorafit's step at these settings"
        )
    if not plan.fits:
        room = f" and {card} has {plan.gpu.usable_gib(plan.estimate.headroom):.1f} GiB" if plan.gpu else ""
        raise InvalidConfig(
            f"the plan does not fit {card}: its smallest configuration needs {plan.estimate.peak_device_gib:.1f} "
            f"GiB{room}; measure only what fits (`lorafit plan` lists the smallest changes that do)"
        )
    if device == "cuda":
        free = free_gpu_gib()
        if plan.estimate.peak_device_gib > free:
            raise InvalidConfig(
                f"{plan.model.name} is too big for this GPU: the plan's step needs {plan.estimate.peak_device_gib:.1f}"
                f" GiB on the device and it has {free:.1f} GiB free"
            )
    host_need, host_free = host_gib_needed(plan, device), hardware.available_ram_gib()
    if host_free is not None and host_need > host_free:
        raise InvalidConfig(
            f"{plan.model.name} is too big for this machine's RAM: measuring it takes {host_need:.1f} GiB of host "
            f"memory and {host_free:.1f} GiB is available"
        )
    disk_free = gib(shutil.disk_usage(workdir).free)
    if built_gib(plan) > disk_free:
        raise InvalidConfig(
            f"the random {plan.model.name} takes {built_gib(plan):.1f} GiB on disk and {workdir} has "
            f"{disk_free:.1f} GiB free; set TMPDIR to a folder with room"
        )


# --- the measurement ----------------------------------------------------------------------------------------
def device_name(device: Device) -> str:
    if device == "cuda":
        import torch

        return str(torch.cuda.get_device_name(0))
    return f"CPU {cpu_model()}"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure(
    plan: Plan, device: Device, probe: engine.Probe | None, steps: int, workdir: Path | None = None
) -> dict[str, Any]:
    """The plan's step run for a warm-up and `steps` timed steps on `device` (`open_device`); the record
    `lorafit measure` prints and stores. Running out of memory ends it in one line (nothing is recorded)."""
    workdir = workdir or Path(tempfile.gettempdir())
    check_plan(plan, device, workdir)
    savers.use_allocator_settings(plan.settings, device == "cuda")  # before the model takes any CUDA memory
    try:
        seconds, figures = steps_measured(plan, device, probe, steps, workdir)
    except Exception as error:
        if not guard.is_out_of_memory(error):
            raise
        raise LorafitError(
            f"{plan.model.name} ran out of memory on {device_name(device)}, where the estimate is "
            f"{plan.estimate.peak_device_gib:.2f} GiB on the device; nothing recorded"
        ) from None
    return record(plan, device, steps, figures, engine.measured_speed(plan.settings, seconds))


def steps_measured(
    plan: Plan, device: Device, probe: engine.Probe | None, steps: int, workdir: Path
) -> tuple[list[float], dict[str, Any]]:
    """Build the random model in a temporary folder, load and prepare it as `lorafit train` does, and run the
    steps with the memory sampled: (seconds of each step, the memory figures)."""
    spec, settings, on_cuda = plan.model, plan.settings, device == "cuda"
    where = build_device(plan, device)
    with engine.process_settings(on_cuda), tempfile.TemporaryDirectory(prefix="lorafit-measure-", dir=workdir) as tmp:
        folder = Path(tmp) / "model"
        engine.build_random_model(spec, settings, folder, where)
        model = engine.prepare(engine.load_base(folder, settings, device), spec, settings)
        with engine.sampled(probe) as sampler:
            seconds = engine.train_steps(model, spec, settings, engine.WARMUP_STEPS + steps, device, Path(tmp))
        figures = engine.measured_memory(probe, sampler.peak if sampler else None)
        del model
        engine.free_memory(on_cuda)
    return seconds, figures


def record(plan: Plan, device: Device, steps: int, figures: dict[str, Any], speed: dict[str, Any]) -> dict[str, Any]:
    """Measured and estimated figures side by side, each with the whole run's hours and costs at its speed (the
    run's tokens are the plan's: its hours at its own speed)."""
    estimate, world = plan.estimate, memory.world_size(plan.settings)
    run_tokens = plan.run_tokens
    at_measured = time_and_cost(plan.gpu, world, speed["tokens_per_s"] or 0.0, run_tokens, plan.kwh_price)
    return {
        "lorafit": __version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device_name(device),
        "card": plan.gpu.name if plan.gpu else None,
        "steps": steps,
        "warmup_steps": engine.WARMUP_STEPS,
        "model": plan.model.name,
        "params_b": round(plan.model.num_params / 1e9, 4),
        "settings": plan.settings.model_dump(mode="json"),
        "run_tokens": round(run_tokens),
        "measured": {
            "tokens_per_s": speed["tokens_per_s"],
            "peak_allocated_gib": figures["allocated_gib"],
            "peak_reserved_gib": figures["reserved_gib"],
            "peak_device_gib": figures["device_gib"],
            "peak_device_source": figures["device_source"],
            "step_seconds": speed["step_seconds"],
            "hours": at_measured["hours"],
            "cost_cloud_usd": at_measured["cost_cloud_usd"],
            "cost_local_usd": at_measured["cost_local_usd"],
        },
        "estimate": {
            "tokens_per_s": plan.tokens_per_s,
            "peak_allocated_gib": estimate.peak_allocated_gib,
            "peak_reserved_gib": estimate.peak_reserved_gib,
            "peak_device_gib": estimate.peak_device_gib,
            "hours": plan.hours,
            "cost_cloud_usd": plan.cost_cloud_usd,
            "cost_local_usd": plan.cost_local_usd,
        },
        "versions": {name: engine.package_version(name) for name in LIBRARIES},
    }
