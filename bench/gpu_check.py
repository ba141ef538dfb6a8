"""`make gpu-check`: lorafit's memory and time model against real training steps on this machine's CUDA GPU.

1. Llama-2-7B, Llama-3.1-8B and Qwen2.5-7B at their real shapes with random weights; QLoRA and LoRA, gradient
   checkpointing on and off, micro-batch 1 and 2 at 2048 tokens. Each base is built once on the GPU
   (`from_config`), saved to a temporary folder and deleted after its rows; it is loaded (and quantised) once per
   method by `lorafit.train.build.load_model`, as `lorafit train` loads it, and each row prepares it with
   `build.checked_prepare` (peft's unload takes the adapters off again after the row), builds the optimizer with
   `build.build_optimizer` and runs transformers' Trainer under the arguments of `train/hf_args.py` for a warm-up
   step and three timed steps on random tokens, all by `lorafit.measure.engine`, the code `lorafit measure` runs.
   Measured: torch.cuda.max_memory_allocated, max_memory_reserved, the device figure (what nvidia-smi shows for
   the process) and tokens/s over the timed steps; printed beside
   `lorafit.memory.estimate` and the plan's time model (`timing.tokens_per_second` for the detected GPU), with the
   relative error (predicted - measured) / measured of each.
2. "Fits" really fits: `lorafit.plan.make_plan`'s choice for Llama-3.1-8B QLoRA at 2048 tokens on a 24, a 16 and
   an 8 GB card, run with the process capped at that card's memory (`torch.cuda.set_per_process_memory_fraction`):
   the plan's micro-batch must run; twice that micro-batch is expected to run out of memory where the estimate
   says it needs more than the card. Where no plan fits the card, its smallest configuration is run, and
   should run out of memory.
3. A time budget (default 7.5 minutes): a row starts only if the longest row so far still fits in what is left;
   the rows not started are listed as skipped. The JSON file is rewritten after every row.

    python bench/gpu_check.py [--out FILE] [--time-budget MINUTES]   # make gpu-check
    python bench/gpu_check.py --smoke     # the same code path on the CPU with tiny models (tests run it)
    python bench/gpu_check.py --tiny      # tiny models on the GPU: checks the CUDA measurements in seconds

Nothing is downloaded: the models are built here and the Hugging Face libraries run offline.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
for _variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_variable] = "1"  # a look-up on the hub fails at once instead of downloading or waiting
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from lorafit import hardware, memory, models  # noqa: E402
from lorafit.errors import LorafitError  # noqa: E402
from lorafit.files import write_atomic  # noqa: E402
from lorafit.hardware import GpuSpec  # noqa: E402
from lorafit.measure import engine  # noqa: E402
from lorafit.measure.engine import (  # noqa: E402
    WARMUP_STEPS,
    DeviceMemory,
    build_random_model,
    free_memory,
    load_base,
    measured_memory,
    measured_speed,
    nvml_handle,
    package_version,
    prepare,
    process_settings,
    train_steps,
    unprepare,
)
from lorafit.models import ModelSpec  # noqa: E402
from lorafit.plan import make_plan  # noqa: E402
from lorafit.schema import PlanRequest, Settings, default_quant  # noqa: E402
from lorafit.timing import tokens_per_second  # noqa: E402
from lorafit.train import build, guard  # noqa: E402
from lorafit.units import BYTES_PER_GIB, gib  # noqa: E402

MODELS = ("llama-2-7b", "llama-3.1-8b", "qwen2.5-7b")
FITS_MODEL = "llama-3.1-8b"
FITS_CARDS = ("RTX 4090", "RTX 4060 Ti 16GB", "RTX 4060")  # 24, 16 and 8 GB
SEQ_LEN = 2048
TINY_SEQ_LEN = 32
MICRO_BATCHES = (1, 2)
TIMED_STEPS = 3
TINY_TIMED_STEPS = 1  # tiny models check the code path, not the speed
# A fits row runs the plan's accumulation capped at 2: from the second micro-batch on, a step holds the same
# memory (the gradients are alive during the forward), so 16 micro-batches would only take longer.
FITS_GRAD_ACCUM = 2
DEFAULT_BUDGET_MINUTES = 7.5
RESULTS = ROOT / "bench" / "results"
SCRATCH = ROOT / "bench" / "out"

Check = Literal["measure", "fits"]


# --- the rows -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One run: a model, the Settings it trains with, and what it checks. Fits rows name the card whose memory
    caps the process, the settings the plan reasons about for it (full size, its own accumulation) and, on the
    plan's own row, the plan's verdict."""

    name: str
    model: str
    settings: Settings
    check: Check = "measure"
    card: str | None = None
    card_settings: Settings | None = None
    plan_fits: bool | None = None


def measure_rows(seq_len: int, precision: str) -> list[Row]:
    rows = []
    for model in MODELS:
        for method in ("qlora", "lora"):
            for grad_ckpt in (False, True):
                for micro_batch in MICRO_BATCHES:
                    settings = Settings(
                        method=method,
                        quant=default_quant(method),
                        precision=precision,
                        grad_ckpt=grad_ckpt,
                        micro_batch=micro_batch,
                        grad_accum=1,
                        seq_len=seq_len,
                    )
                    ckpt = "ckpt" if grad_ckpt else "no-ckpt"
                    rows.append(Row(f"{model} {method} {ckpt} mb{micro_batch}", model, settings))
    return rows


def fits_rows(seq_len: int, precision: str) -> list[Row]:
    """The plan for the real Llama-3.1-8B on each card; the row runs its settings at `seq_len` and `precision`
    (the tiny check shortens both). When no plan fits, make_plan's choice is its smallest configuration."""
    spec = models.resolve(FITS_MODEL)
    rows = []
    for card_name in FITS_CARDS:
        card = hardware.resolve(card_name)
        plan = make_plan(PlanRequest(model=spec, gpu=card, fixed={"method": "qlora", "seq_len": SEQ_LEN}))
        run = plan.settings.model_copy(
            update={
                "seq_len": seq_len,
                "precision": precision,
                "grad_accum": min(plan.settings.grad_accum, FITS_GRAD_ACCUM),
            }
        )
        micro = run.micro_batch
        label = f"plan mb{micro}" if plan.fits else f"no plan fits; smallest mb{micro}"
        rows.append(Row(f"{card.name}: {label}", FITS_MODEL, run, "fits", card.name, plan.settings, plan.fits))
        if plan.fits:  # the next bigger micro-batch at the same effective batch
            accum = max(plan.settings.grad_accum // 2, 1)
            planned = plan.settings.model_copy(update={"micro_batch": 2 * micro, "grad_accum": accum})
            bigger = run.model_copy(update={"micro_batch": 2 * micro, "grad_accum": min(accum, FITS_GRAD_ACCUM)})
            rows.append(Row(f"{card.name}: 2x mb{2 * micro}", FITS_MODEL, bigger, "fits", card.name, planned))
    return rows


def all_rows(tiny: bool, device: str) -> list[Row]:
    seq_len = TINY_SEQ_LEN if tiny else SEQ_LEN
    precision = "fp32" if device == "cpu" else "bf16"  # as `lorafit train` on the CPU: bf16 there is ~20x slower
    return measure_rows(seq_len, precision) + fits_rows(seq_len, precision)


def tiny_spec(spec: ModelSpec) -> ModelSpec:
    """The architecture at a few thousand parameters per layer (`spec.scaled`, as the tests shrink models)."""
    return spec.scaled(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
    )


def model_spec(name: str, tiny: bool) -> ModelSpec:
    spec = models.resolve(name)
    return tiny_spec(spec) if tiny else spec


def base_key(settings: Settings) -> tuple:
    """What the loaded base depends on: rows that agree on it share one load."""
    return (settings.method, settings.quant, settings.double_quant, settings.precision, settings.attn)


# --- time budget ----------------------------------------------------------------------------------------------
class Budget:
    """New work starts only while the longest work of its kind so far still fits in what is left."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self.clock = clock
        self.started = clock()
        self.longest: dict[str, float] = {}

    def elapsed(self) -> float:
        return self.clock() - self.started

    def allows(self, *kinds: str) -> bool:
        expected = sum(self.longest.get(kind, 0.0) for kind in kinds)
        return self.elapsed() + expected < self.seconds

    @contextlib.contextmanager
    def timing(self, kind: str) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            self.longest[kind] = max(self.longest.get(kind, 0.0), self.clock() - start)


# --- measurements -------------------------------------------------------------------------------------------
@dataclass
class Context:
    """What every row needs: the device, the GPU the time model is for, and the device-memory probe."""

    device: str
    tiny: bool
    gpu: GpuSpec
    probe: DeviceMemory | None
    workdir: Path
    timed_steps: int = TIMED_STEPS


def memory_cap(card: GpuSpec, probe: DeviceMemory) -> dict[str, Any]:
    """The allocator's share of this GPU that leaves as much as `card` has: the card's memory less what this process
    holds outside the allocator (on the real card the CUDA context takes its share too). Where the device figure
    leaves the context out (mem_get_info), the context is the estimator's figure."""
    card_bytes = card.memory_gib * card.usable_fraction * BYTES_PER_GIB
    if probe.includes_context:
        outside, source = probe.outside_allocator(), "measured"
    else:
        outside, source = memory.Runtime().cuda_context_gib * BYTES_PER_GIB, "the estimator's CUDA context"
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(max(card_bytes - outside, 0) / total, 1.0)
    return {
        "card_gib": round(gib(card_bytes), 3),
        "outside_allocator_gib": round(gib(outside), 3),
        "outside_allocator_source": source,
        "allocator_limit_gib": round(gib(fraction * total), 3),
        "fraction": round(fraction, 6),
    }


def fsdp_host_loading(context: Context) -> dict[str, Any]:
    """What `lorafit train` does with a 4-bit base under FSDP (recipe.load_device_map): load it in host memory,
    let FSDP2's fully_shard move it to the GPU a decoder layer at a time, and train. On one GPU (a process group
    of one) every shard is the whole weight, so the check is that the GPU held nothing after loading, that the
    peak while sharding stayed within the model plus one layer, and that a forward and backward run there
    (bitsandbytes' quantisation state went with the weights)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lorafit.train import recipe

    on_cuda = context.device == "cuda"
    spec = model_spec(MODELS[0], tiny=True)  # the code path, not the figures: the small model in either mode
    settings = Settings(method="qlora", quant="nf4", precision="bf16", n_gpus=2, shard="fsdp", lora_dropout=0.0)
    folder = context.workdir / "fsdp-base"
    build_random_model(spec, settings, folder, context.device)
    free_memory(on_cuda)
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if on_cuda else 0
    device_map = recipe.load_device_map(settings, gpu=torch.cuda.current_device() if on_cuda else 0)
    model = prepare(build.load_model(folder, settings, device_map=device_map), spec, settings)
    after_load = (torch.cuda.memory_allocated() if on_cuda else 0) - before
    layers = model.base_model.model.model.layers
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    layer_bytes = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers)
    dist.init_process_group(
        "nccl" if on_cuda else "gloo", init_method=f"file://{context.workdir / 'fsdp-group'}", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh(context.device, (1,))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        peak = (torch.cuda.max_memory_allocated() - before) if on_cuda else None
        tokens = torch.randint(0, spec.vocab_size, (1, 64), device=context.device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        graded = sum(1 for p in model.parameters() if p.requires_grad and p.grad is not None)
    finally:
        dist.destroy_process_group()
    del model
    free_memory(on_cuda)
    within = None if peak is None else peak <= model_bytes + 2 * layer_bytes
    return {
        "settings": "qlora nf4 (bf16 storage), loaded in host memory, fully_shard per decoder layer",
        "model": spec.name,
        "gpu_bytes_after_load": after_load,
        "peak_bytes_while_sharding": peak,
        "model_bytes": model_bytes,
        "largest_layer_bytes": layer_bytes,
        "loss": float(loss.detach()),
        "adapters_with_gradients": graded,
        "ok": after_load < layer_bytes and within is not False and math.isfinite(float(loss.detach())) and graded > 0,
    }


def predicted(spec: ModelSpec, settings: Settings, card: GpuSpec | None, context: Context) -> dict[str, Any]:
    """lorafit.memory.estimate (for `card`, the verdict; else the GPU the check runs on) and the plan's time model
    for the GPU the check runs on."""
    estimate = memory.estimate(spec, settings, card or context.gpu, runtime=memory.Runtime(device=context.device))
    return {
        "allocated_gib": estimate.peak_allocated_gib,
        "reserved_gib": estimate.peak_reserved_gib,
        "device_gib": estimate.peak_device_gib,
        "peak_phase": estimate.peak_phase,
        "fits": estimate.fits,
        "tokens_per_s": round(tokens_per_second(spec, settings, context.gpu), 1),
        "time_model_gpu": context.gpu.name,
    }


def relative_errors(measured: dict[str, Any], predicted: dict[str, Any], speed: bool) -> dict[str, float | None]:
    """(predicted - measured) / measured for each figure both have; tokens/s only where the time model is for the
    device that ran (not on the CPU)."""
    errors = {}
    for key in ("allocated_gib", "reserved_gib", "device_gib", "tokens_per_s"):
        have, want = measured.get(key), predicted.get(key)
        comparable = have and want is not None and (speed or key != "tokens_per_s")
        errors[key.removesuffix("_gib")] = round((want - have) / have, 4) if comparable else None
    return errors


def run_row(model: Any, spec: ModelSpec, row: Row, context: Context) -> dict[str, Any]:
    """Train the row's steps and measure it (lorafit.measure.engine, as `lorafit measure` does); a fits row runs
    under its card's memory cap."""
    on_cuda = context.device == "cuda"
    cap = None
    free_memory(on_cuda)
    if on_cuda:
        if row.card is not None:
            cap = memory_cap(hardware.resolve(row.card), context.probe)
            torch.cuda.set_per_process_memory_fraction(cap["fraction"])
        outside_before = context.probe.outside_allocator()
    seconds: list[float] = []
    sampler = None
    status = "ran"
    try:
        with engine.sampled(context.probe) as sampler:
            seconds = train_steps(
                model, spec, row.settings, WARMUP_STEPS + context.timed_steps, context.device, context.workdir
            )
    except Exception as error:
        if not guard.is_out_of_memory(error):
            raise
        status = "out of memory"
    finally:
        if cap is not None:
            torch.cuda.set_per_process_memory_fraction(1.0)
    measured = measured_memory(context.probe, sampler.peak if sampler else None)
    if on_cuda:  # the CUDA context and anything an earlier row left outside the allocator
        measured["outside_allocator_gib_before"] = round(gib(outside_before), 4)
    if status == "ran":
        measured |= measured_speed(row.settings, seconds)
    result: dict[str, Any] = {"status": status, "measured": measured}
    if row.check == "fits":
        result["fits"] = fits_verdict(row, status, cap, context)
    return result


def fits_verdict(row: Row, status: str, cap: dict[str, Any] | None, context: Context) -> dict[str, Any]:
    """What the plan expected on this card and whether the run agrees. Expected to run out of memory: a
    configuration whose estimated device figure is above the card's memory (the plan keeps its headroom below
    it). Tiny models or the CPU check the code path only: no expectation."""
    card = hardware.resolve(row.card)
    real = memory.estimate(models.resolve(row.model), row.card_settings, card)
    card_gib = card.memory_gib * card.usable_fraction
    expected = None
    if not context.tiny and context.device == "cuda":
        expected = "out of memory" if real.peak_device_gib > card_gib else "ran"
    return {
        "card": card.name,
        "card_gib": round(card_gib, 3),
        "plan_fits": row.plan_fits,  # make_plan's verdict, on the plan's own row
        "card_settings": row.card_settings.model_dump(mode="json"),
        "estimated_device_gib": real.peak_device_gib,
        "estimate_fits_with_headroom": real.fits,
        "cap": cap or "none: a CPU process has no memory cap to set",
        "expected": expected,
        "agrees": None if expected is None else expected == status,
    }


# --- the whole check ----------------------------------------------------------------------------------------
def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def driver_version() -> str | None:
    handle = nvml_handle()
    if handle is not None:
        import pynvml

        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        try:
            done = subprocess.run(query, capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None
    return None


def environment(context: Context) -> dict[str, Any]:
    on_cuda = context.device == "cuda"
    props = torch.cuda.get_device_properties(0) if on_cuda else None
    return {
        "device": context.device,
        "gpu": props.name if props else None,
        "gpu_memory_gib": round(gib(props.total_memory), 3) if props else None,
        "compute_capability": f"{props.major}.{props.minor}" if props else None,
        "driver": driver_version() if on_cuda else None,
        "cuda": torch.version.cuda,
        "device_memory_source": context.probe.source if context.probe else None,
        "cuda_context_gib": round(gib(context.probe.outside_allocator()), 3) if context.probe else None,
        "time_model_gpu": context.gpu.name,
        "cpu": platform.processor() or platform.machine(),
        "cpu_cores": os.cpu_count(),
        "python": platform.python_version(),
        "versions": {
            name: package_version(name) for name in ("torch", "transformers", "peft", "bitsandbytes", "accelerate")
        },
    }


def run_order(rows: list[Row]) -> list[tuple[str, list[list[Row]]]]:
    """Rows by model, and within a model by the base they load, so that each base is built once and loaded once
    per kind (QLoRA, LoRA). The model of the fits rows goes first, so that a run short of time skips measurement
    rows rather than the fits check; within it the fits rows come last, the paged optimizer's row at the very end
    (bitsandbytes never gives its managed memory back: the rows after it see up to its states, a few hundred MB
    for an 8B model's adapters, in `outside_allocator_gib`)."""

    def has_fits(group: list[Row]) -> bool:
        return any(row.check == "fits" for row in group)

    names = dict.fromkeys(row.model for row in rows)
    order = []
    for model in sorted(names, key=lambda name: not has_fits([row for row in rows if row.model == name])):
        of_model = [row for row in rows if row.model == model]
        keys = dict.fromkeys(base_key(row.settings) for row in of_model)
        groups = [[row for row in of_model if base_key(row.settings) == key] for key in keys]
        ordered = sorted(groups, key=has_fits)
        order.append((model, [sorted(group, key=lambda row: paged(row.settings)) for group in ordered]))
    return order


def paged(settings: Settings) -> bool:
    return settings.optimizer.startswith("paged")


def run_all(rows: list[Row], context: Context, budget: Budget, save: Callable[[dict[str, dict]], object]) -> dict:
    """Every row in `run_order`, each result under its row's name; a row the budget leaves no time for is skipped,
    and an error ends only the rows that need what failed (the row, its loaded base or its built model)."""
    results: dict[str, dict] = {}
    on_cuda = context.device == "cuda"

    def skip(pending: list[Row]) -> None:
        for row in pending:
            results[row.name] = {"status": "skipped", "reason": "time budget"}

    def fail(pending: list[Row], error: BaseException) -> None:
        line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        for row in pending:
            if row.name not in results:
                results[row.name] = {"status": "failed", "error": line, "traceback": traceback.format_exc()[-3000:]}

    for model_name, groups in run_order(rows):
        model_rows = [row for group in groups for row in group]
        if not budget.allows("build", "load", "row"):
            skip(model_rows)
            continue
        spec = model_spec(model_name, context.tiny)
        folder = context.workdir / slug(model_name)
        try:
            with budget.timing("build"):
                build_random_model(spec, model_rows[0].settings, folder, context.device)
            for group in groups:
                if not budget.allows("load", "row"):
                    skip(group)
                    continue
                base = None
                try:
                    with budget.timing("load"):
                        base = load_base(folder, group[0].settings, context.device)
                    for row in group:
                        if not budget.allows("row"):
                            skip([row])
                            continue
                        started = time.perf_counter()
                        with budget.timing("row"):
                            model = prepare(base, spec, row.settings)
                            try:
                                results[row.name] = run_row(model, spec, row, context)
                            except Exception as error:
                                fail([row], error)
                            finally:
                                base = unprepare(model)
                                del model
                        results[row.name]["seconds"] = round(time.perf_counter() - started, 1)
                        report_row(row, results[row.name], len(results), len(rows))
                        save(results)
                except Exception as error:
                    fail(group, error)
                finally:
                    base = None  # the next base is loaded into the memory this one gives back
                    free_memory(on_cuda)
        except Exception as error:
            fail(model_rows, error)
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # one base on disk at a time: three would fill the disk
            free_memory(on_cuda)
        save(results)
    return results


def row_record(row: Row, result: dict[str, Any], spec: ModelSpec, context: Context) -> dict[str, Any]:
    record = {
        "name": row.name,
        "model": row.model,
        "check": row.check,
        "settings": row.settings.model_dump(mode="json"),
    }
    record |= result
    record["predicted"] = predicted(spec, row.settings, None, context)
    if "measured" in result:
        record["error"] = relative_errors(result["measured"], record["predicted"], speed=context.device == "cuda")
    return record


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst |error| of each figure over the measure rows that ran."""
    out: dict[str, Any] = {}
    measured = [r for r in records if r["check"] == "measure" and r.get("error")]
    for key in ("allocated", "reserved", "device", "tokens_per_s"):
        values = [abs(r["error"][key]) for r in measured if r["error"].get(key) is not None]
        out[key] = {"rows": len(values), "median": statistics.median(values), "worst": max(values)} if values else None
    fits = [r["fits"] for r in records if "fits" in r and r["fits"]["agrees"] is not None]
    out["fits_agree"] = f"{sum(f['agrees'] for f in fits)} of {len(fits)}" if fits else None
    return out


# --- printing ---------------------------------------------------------------------------------------------------
def report_row(row: Row, result: dict[str, Any], done: int, total: int) -> None:
    extra = f": {result['error']}" if result["status"] == "failed" else ""
    print(f"[{done:2d}/{total}] {row.name}: {result['status']} in {result.get('seconds', 0):.1f} s{extra}", flush=True)


def cell(measured: float | None, predicted: float | None, error: float | None, digits: int) -> str:
    """measured, lorafit's figure and the relative error, in 24 characters ("-" for what is missing)."""
    have = f"{measured:,.{digits}f}" if measured is not None else "-"
    want = f"{predicted:,.{digits}f}" if predicted is not None else "-"
    err = f"{100 * error:+.1f}%" if error is not None else "-"
    return f"{have:>8} {want:>8} {err:>6}"


def print_table(records: list[dict[str, Any]], env: dict[str, Any]) -> None:
    print()
    print(
        f"{env['gpu'] or 'CPU'}, torch {env['versions']['torch']}; device figure: {env['device_memory_source'] or '-'}"
    )
    print(f"each figure: measured, lorafit, (lorafit - measured) / measured; time model: {env['time_model_gpu']}")
    titles = ("allocated GiB", "reserved GiB", "device GiB", "tokens/s")
    print(f"{'row':36} {'status':13} " + " ".join(f"{title:>24}" for title in titles))
    for r in records:
        m, p, e = r.get("measured", {}), r["predicted"], r.get("error", {})
        cells = [cell(m.get(f"{k}_gib"), p[f"{k}_gib"], e.get(k), 2) for k in ("allocated", "reserved", "device")]
        cells.append(cell(m.get("tokens_per_s"), p["tokens_per_s"], e.get("tokens_per_s"), 0))
        print(f"{r['name'][:36]:36} {r['status'][:13]:13} " + " ".join(cells))
    fits = [r for r in records if "fits" in r]
    if not fits:
        return
    print()
    print(f"{FITS_MODEL} QLoRA under each card's memory (lorafit's device estimate at the plan's settings):")
    print(f"{'row':40} {'card GiB':>8} {'limit GiB':>9} {'estimate':>8}  {'expected':14} {'result':14} agrees")
    for r in fits:
        f = r["fits"]
        limit = f"{f['cap']['allocator_limit_gib']:9.2f}" if isinstance(f["cap"], dict) else f"{'-':>9}"
        agrees = "-" if f["agrees"] is None else "yes" if f["agrees"] else "NO"
        print(
            f"{r['name'][:40]:40} {f['card_gib']:8.2f} {limit} {f['estimated_device_gib']:8.2f}  "
            f"{f['expected'] or '-':14} {r['status']:14} {agrees}"
        )


# --- main -----------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the CPU with tiny models (same as --device cpu --tiny)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shrunken models instead of the real shapes")
    parser.add_argument("--out", type=Path, help="JSON file (default bench/results/gpu-check-<gpu>.json)")
    parser.add_argument("--time-budget", type=float, default=DEFAULT_BUDGET_MINUTES, help="minutes (default 7.5)")
    parser.add_argument("--gpu", help="catalog GPU for the time model (default: the detected one)")
    parser.add_argument("--workdir", type=Path, help="where the random models are saved (default: a temp folder)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.tiny = "cpu", True
    return args


def check_device(args: argparse.Namespace) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise LorafitError("needs a CUDA GPU; use --smoke for the same code path on the CPU with tiny models")
    if args.device == "cpu" and not args.tiny:
        raise LorafitError("full-size models on the CPU would take hours; add --tiny (or use --smoke)")


def time_model_gpu(args: argparse.Namespace) -> GpuSpec:
    """The catalog entry of the GPU the check runs on (--gpu, else the detected one); on the CPU, which has no
    entry, the H200's, and the table says so."""
    if args.gpu:
        return hardware.resolve(args.gpu)
    if args.device == "cpu":
        return hardware.resolve("H200")
    found = hardware.detect().gpus
    if found and found[0].catalog_name:
        return hardware.resolve(found[0].catalog_name)
    name = found[0].name if found else torch.cuda.get_device_name(0)
    raise LorafitError(
        f"{name} is not in lorafit's GPU catalog; pass --gpu NAME (see `lorafit gpus`) for the time model"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    budget = Budget(args.time_budget * 60)
    on_cuda = args.device == "cuda"
    try:
        check_device(args)
        probe = DeviceMemory() if on_cuda else None  # before anything else touches the GPU: its baseline
        gpu = time_model_gpu(args)
    except LorafitError as error:
        print(f"gpu_check: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    name = torch.cuda.get_device_name(0) if on_cuda else "cpu"
    out = args.out or (
        SCRATCH / f"gpu-check-{slug(name)}-tiny.json" if args.tiny else RESULTS / f"gpu-check-{slug(name)}.json"
    )
    rows = all_rows(args.tiny, args.device)
    tiny = " (tiny models)" if args.tiny else ""
    print(f"gpu-check: {len(rows)} rows on {name}{tiny}, time budget {args.time_budget:g} min", flush=True)
    with (
        process_settings(on_cuda, one_thread=True),
        tempfile.TemporaryDirectory(prefix="gpu-check-", dir=args.workdir) as workdir,
    ):
        timed = TINY_TIMED_STEPS if args.tiny else TIMED_STEPS
        context = Context(args.device, args.tiny, gpu, probe, Path(workdir), timed)
        env = environment(context)
        specs = {model: model_spec(model, args.tiny) for model in dict.fromkeys(row.model for row in rows)}

        def document(results: dict[str, dict]) -> dict[str, Any]:
            records = [
                row_record(row, results.get(row.name, {"status": "not run"}), specs[row.model], context) for row in rows
            ]
            return {
                "check": "bench/gpu_check.py",
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "mode": "tiny" if args.tiny else "full",
                "environment": env,
                "steps": {"warmup": WARMUP_STEPS, "timed": context.timed_steps},
                "time_budget_s": budget.seconds,
                "elapsed_s": round(budget.elapsed(), 1),
                "skipped": [r["name"] for r in records if r["status"] == "skipped"],
                "summary": summary(records),
                "rows": records,
            }

        def save(results: dict[str, dict]) -> dict[str, Any]:
            written = document(results)
            write_atomic(out, json.dumps(written, indent=2) + "\n")
            return written

        final = save(run_all(rows, context, budget, save))
        try:
            final["fsdp_host_loading"] = fsdp_host_loading(context)
        except Exception:
            final["fsdp_host_loading"] = {"ok": False, "traceback": traceback.format_exc()}
        write_atomic(out, json.dumps(final, indent=2) + "\n")
    print_table(final["rows"], env)
    if final["skipped"]:
        print(f"\nskipped (time budget of {args.time_budget:g} min): {', '.join(final['skipped'])}")
    failed = [r["name"] for r in final["rows"] if r["status"] == "failed"]
    loading = final["fsdp_host_loading"]
    print(f"\nFSDP with the 4-bit base loaded in host memory: {'ok' if loading['ok'] else 'FAILED'} {loading}")
    if not loading["ok"]:
        failed.append("fsdp_host_loading")
    if failed:
        print(f"\nfailed: {', '.join(failed)} (the JSON file has each traceback)")
    print(f"\nwrote {out} in {final['elapsed_s']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
