"""The planner's search: every combination of the settings a request leaves free, each with its memory
estimate (`memory.estimate`) and its speed (`timing.tokens_per_second`, worked out only for those that fit), and
the ranking that picks the fastest that fits. lorafit.plan explains the choice, times and costs the run."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, lru_cache, partial
from typing import Any

from lorafit import memory, options, rules, stacks
from lorafit.hardware import GpuSpec
from lorafit.memory import estimate
from lorafit.models import ModelSpec
from lorafit.schema import Estimate, PlanRequest, Settings
from lorafit.timing import tokens_per_second


# --- search -------------------------------------------------------------------------------------------------
@dataclass
class Candidate:
    """One searched configuration. Its speed is worked out when first asked for: the search only compares the
    speeds of the candidates that fit."""

    settings: Settings
    estimate: Estimate
    speed: Callable[[], float] = field(repr=False, compare=False)

    @cached_property
    def tokens_per_s(self) -> float:
        return self.speed()


OPTIMIZERS = {
    "full": ["adamw", "adamw_8bit", "paged_adamw_8bit"],
    "lora": ["adamw", "paged_adamw_8bit"],
    "qlora": ["adamw", "paged_adamw_8bit"],
}


def _micro_batches(batch_size: int, n_gpus: int) -> list[int]:
    """Micro-batches that divide the per-GPU share of the effective batch, largest first."""
    per_gpu = max(batch_size // n_gpus, 1)
    return [b for b in range(per_gpu, 0, -1) if per_gpu % b == 0 and (b & (b - 1) == 0 or b == per_gpu)]


SAVERS = tuple(options.SAVER_ON)
SAVER_ON = options.SAVER_ON


def savers_on(settings: Settings) -> list[str]:
    """The memory savers these settings turn on, in SAVERS order."""
    return [name for name in SAVERS if getattr(settings, name) == SAVER_ON[name]]


@dataclass(frozen=True)
class Search:
    """What the values tried for a searched setting depend on: the request, the GPU, and the settings fixed for
    this search (the method, the length, the GPUs, the shard and the offload, what the user pinned and the
    defaults that follow from them)."""

    request: PlanRequest
    gpu: GpuSpec | None
    fixed: dict[str, Any]


def micro_batch_values(search: Search, step: dict[str, Any]) -> list[int]:
    """The micro-batches that divide each GPU's share of the effective batch, largest first."""
    return _micro_batches(search.request.effective_batch, search.fixed["n_gpus"])


def grad_accum_values(search: Search, step: dict[str, Any]) -> list[int]:
    """One value, not a choice: the accumulation that makes up the effective batch with the step's micro-batch
    on every GPU."""
    micro_batch = step.get("micro_batch", options.BY_NAME["micro_batch"].default)
    return [max(search.request.effective_batch // (micro_batch * search.fixed["n_gpus"]), 1)]


def grad_ckpt_values(search: Search, step: dict[str, Any]) -> list[bool]:
    """Without checkpointing first: it costs a recomputed forward, so it is on only where it is needed to fit."""
    return [False, True]


def optimizer_values(search: Search, step: dict[str, Any]) -> list[str]:
    """The method's OPTIMIZERS; an offloaded optimizer steps on the CPU with 32-bit AdamW (options:
    _offload_steps_adamw)."""
    return OPTIMIZERS[search.fixed["method"]] if search.fixed["offload"] == "none" else ["adamw"]


def saver_applies(name: str, search: Search) -> bool:
    """Whether a memory saver can help this step: only the stack's own switches; without a GPU the savers stay
    off; the host-memory and allocator savers need a CUDA card (Apple's memory is the host's); the embedding
    can stay on the CPU only when it is frozen (not full fine-tuning, not train_embeddings) and not tied to the
    head."""
    gpu, spec = search.gpu, search.request.model
    cuda = gpu is not None and gpu.kind != "apple" and search.request.device != "cpu"
    applies = {
        "loss": gpu is not None and not search.fixed.get("liger"),  # Liger's fused loss replaces it
        "offload_embeddings": cuda
        and search.fixed["method"] != "full"
        and not search.fixed.get("train_embeddings")
        and not spec.tie_word_embeddings,
        "offload_activations": cuda,
        "expandable_segments": cuda,
    }
    stack = stacks.resolve(search.fixed.get("stack") or options.BY_NAME["stack"].default)
    return applies[name] and name in stack.savers


def saver_values(name: str, search: Search, step: dict[str, Any]) -> list[Any]:
    """Off, and on where the saver applies (saver_applies)."""
    off = options.BY_NAME[name].default
    return [off, SAVER_ON[name]] if saver_applies(name, search) else [off]


# The values the search tries for each setting the planner chooses (options.SEARCHED) when the request does not
# pin it, given the search and the values chosen so far for the settings before it in SEARCHED.
SEARCH_SPACE: dict[str, Callable[[Search, dict[str, Any]], list[Any]]] = {
    "micro_batch": micro_batch_values,
    "grad_accum": grad_accum_values,
    "grad_ckpt": grad_ckpt_values,
    "optimizer": optimizer_values,
} | {name: partial(saver_values, name) for name in SAVERS}


# An estimate depends on the card only through its verdict (memory.assemble), so a search over many cards (the
# comparison, the bigger-GPU suggestions, the fewest-GPU counts) estimates each step once, without a card.
# Each entry is a few kB: 8192 hold the steps of a 70B comparison (about 3,000) with room to spare.
@lru_cache(maxsize=8192)
def _estimate_anywhere(spec: ModelSpec, settings: Settings, headroom: float) -> Estimate:
    return estimate(spec, settings, None, headroom)


@lru_cache(maxsize=8192)
def _settings(values: tuple[tuple[str, Any], ...]) -> Settings:
    return Settings(**dict(values))


def settings_of(values: dict[str, Any]) -> Settings:
    """Settings(**values), validated once per combination: the searches of a comparison meet the same ones on
    every card."""
    try:
        return _settings(tuple(values.items()))
    except TypeError:  # a value that is not hashable: validate it afresh
        return Settings(**values)


# Estimate rounds its GiB figures to 4 decimals (memory.assemble): a rounded peak is within 5e-5 GiB of the
# exact one, so a verdict further than this from the line is the same from either.
ROUNDED_GIB = 1e-4


def estimate_on(spec: ModelSpec, settings: Settings, gpu: GpuSpec | None, headroom: float) -> Estimate:
    """memory.estimate(spec, settings, gpu, headroom) from the card-free estimate of the step, with the card's
    verdict; estimated on the card itself where the rounded peak is too close to the line to decide it."""
    anywhere = _estimate_anywhere(spec, settings, headroom)
    if gpu is None:
        return anywhere
    peak = max(anywhere.peak_device_gib, anywhere.loading_peak_gib or 0.0)
    usable = gpu.usable_gib(headroom)
    if abs(peak - usable) <= ROUNDED_GIB:
        return estimate(spec, settings, gpu, headroom)
    return anywhere.model_copy(update={"gpu_memory_gib": gpu.memory_gib * gpu.usable_fraction, "fits": peak <= usable})


def candidates(
    request: PlanRequest,
    gpu: GpuSpec | None,
    seq_len: int,
    n_gpus: int = 1,
    shard: str = "none",
    method: str | None = None,
    offload: str = "none",
) -> list[Candidate]:
    """Every combination of the settings options.SEARCHED declares (a pinned one takes its value), the memory
    savers among them tried fewest first, each with its estimate and speed. A pinned shard or offload wins
    over the one asked for; an offload without a shard that has one runs ZeRO-3 (ZeRO-Offload on one GPU)."""
    method = method or request.method
    pinned = dict(request.pinned)
    pinned.pop("method", None)
    if method != request.method:
        pinned.pop("quant", None)  # a suggested method brings its own base
        if method == "full":
            pinned.pop("offload_embeddings", None)  # full fine-tuning trains the embeddings
    offload = pinned.pop("offload", offload)
    shard = pinned.pop("shard", "zero3" if offload != "none" and shard not in rules.SHARDED_SHARDS else shard)
    if n_gpus * pinned.get("nodes", 1) == 1 and offload == "none":
        shard = "none"  # one bigger card for a run pinned to several: nothing to split
    fixed: dict[str, Any] = {"method": method, "seq_len": seq_len, "n_gpus": n_gpus, "shard": shard, "offload": offload}
    fixed |= pinned
    fixed |= options.step_defaults(fixed, request.model, gpu, on_cpu=request.device == "cpu")
    set_by_request = {name: fixed.pop(name) for name in options.SEARCHED if name in fixed}
    search = Search(request, gpu, fixed)

    def tried(name: str, step: dict[str, Any]) -> list[Any]:
        return [set_by_request[name]] if name in set_by_request else SEARCH_SPACE[name](search, step)

    steps: list[dict[str, Any]] = [{}]  # every combination of the settings that are not savers, in SEARCHED order
    for name in (name for name in options.SEARCHED if name not in SAVER_ON):
        steps = [step | {name: value} for step in steps for value in tried(name, step)]
    savers = [name for name in options.SEARCHED if name in SAVER_ON]
    saver_sets = sorted(
        (dict(zip(savers, values, strict=True)) for values in itertools.product(*(tried(n, {}) for n in savers))),
        key=lambda chosen: sum(chosen[name] == SAVER_ON[name] for name in savers),
    )
    ckpt_default = options.BY_NAME["grad_ckpt"].default
    found = []
    for step in steps:
        fitting: list[set[str]] = []
        for chosen in saver_sets:
            values = fixed | chosen | step
            on = {name for name in savers if chosen[name] == SAVER_ON[name]}
            if values.get("offload_activations") and not values.get("grad_ckpt", ckpt_default):
                continue  # nothing checkpointed to offload
            if any(subset <= on for subset in fitting):
                continue  # fewer savers fit already: more only cost time
            settings = settings_of(values)
            if on - set(pinned) and memory.host_saver_problem(request.model, settings, request.host_ram_gib):
                continue  # the planner does not choose an offload the host RAM cannot hold
            peak = estimate_on(request.model, settings, gpu, request.headroom)
            speed = partial(tokens_per_second, request.model, settings, gpu) if gpu else float
            found.append(Candidate(settings, peak, speed))
            if peak.fits:
                fitting.append(on)
    return found


# Speeds closer than this are equal for the time model: 8-bit optimizer states stream less memory, but that
# makes a LoRA step faster by well under 0.1%, which must not outweigh the preference for 32-bit AdamW.
SPEED_TIE = 0.01


def best(found: list[Candidate]) -> Candidate | None:
    """The fastest candidate that fits; among equals (within SPEED_TIE), the first optimizer of OPTIMIZERS (a
    pinned one outside that list after them), then the fewest memory savers (a saver is turned on only where it
    makes the step fit or faster), then the smallest peak."""
    fitting = [c for c in found if c.estimate.fits]
    if not fitting:
        return None
    preference = OPTIMIZERS[fitting[0].settings.method]
    fastest = max(c.tokens_per_s for c in fitting)
    equal = [c for c in fitting if c.tokens_per_s >= fastest * (1 - SPEED_TIE)]

    def rank(c: Candidate) -> tuple[int, int, float]:
        optimizer = c.settings.optimizer
        order = preference.index(optimizer) if optimizer in preference else len(preference)
        return (order, len(savers_on(c.settings)), c.estimate.peak_device_gib)

    return min(equal, key=rank)


def smallest(found: list[Candidate]) -> Candidate:
    return min(found, key=lambda c: c.estimate.peak_device_gib)
