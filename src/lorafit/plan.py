"""The planner: search the settings for the fastest step that fits, then time and cost the whole run.

The candidates and their ranking are lorafit.search's (each priced by `memory.estimate` and
`timing.tokens_per_second`); the plan explains each choice with the numbers that forced it. When nothing fits,
it says so and finds the smallest changes that do.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from lorafit import gemma4, hardware, memory, options, rules, serving, stacks
from lorafit.costs import time_and_cost
from lorafit.errors import LorafitError
from lorafit.hardware import GpuSpec
from lorafit.memory import estimate
from lorafit.messages import say
from lorafit.models import ModelSpec, is_unsloth_dynamic_quant
from lorafit.schema import TIGHT_SHARE, Plan, PlanRequest, Settings, Suggestion, TrainerFit, is_tight
from lorafit.search import SAVERS, Candidate, best, candidates, savers_on, smallest
from lorafit.timing import step_seconds, step_time, tokens_per_second
from lorafit.transfers import DEFAULT_HOST_LINK_GBS, collective_bytes_per_second, communication_bytes
from lorafit.units import gib

# A run when the user gives no data: Alpaca-sized (52k rows of ~300 tokens), three epochs.
DEFAULT_TOKENS_PER_EPOCH = 15_000_000
DEFAULT_SEQ_LEN = options.DEFAULT_SEQ_LEN


# --- explanations -------------------------------------------------------------------------------------------
def explain(chosen: Candidate, found: list[Candidate], gpu: GpuSpec, headroom: float, spec: ModelSpec) -> list[str]:
    """Plain words for each choice, with the number that forced it."""
    s, card = chosen.settings, gpu.usable_gib(headroom)
    peak = chosen.estimate.peak_device_gib
    reasons = [say("plan.peak", peak=peak, memory=gpu.memory_gib, headroom=headroom, usable=card)]
    if s.grad_ckpt:
        without = [c for c in found if not c.settings.grad_ckpt]
        if without:
            least = smallest(without)
            least_peak = least.estimate.peak_device_gib
            reasons.append(say("plan.ckpt_on", micro_batch=least.settings.micro_batch, peak=least_peak, usable=card))
    else:
        reasons.append(say("plan.ckpt_off"))
    bigger = [
        c
        for c in found
        if c.settings.micro_batch == 2 * s.micro_batch
        and c.settings.grad_ckpt == s.grad_ckpt
        and c.settings.optimizer == s.optimizer
        and savers_on(c.settings) == savers_on(s)
    ]
    accum = say(
        "plan.accum_gpus" if s.n_gpus > 1 else "plan.accum",
        micro_batch=s.micro_batch,
        grad_accum=s.grad_accum,
        n_gpus=s.n_gpus,
    )
    if bigger:
        need = smallest(bigger).estimate
        said = "plan.larger_fits" if need.fits else "plan.larger_needs"
        larger = say(said, micro_batch=2 * s.micro_batch, peak=need.peak_device_gib)
        reasons.append(say("plan.batch_larger", accum=accum, batch=s.effective_batch, larger=larger))
    else:
        reasons.append(say("plan.batch", accum=accum, batch=s.effective_batch))
    if s.optimizer != "adamw":
        full = [
            c
            for c in found
            if c.settings.optimizer == "adamw"
            and c.settings.micro_batch == s.micro_batch
            and c.settings.grad_ckpt == s.grad_ckpt
        ]
        if full:
            adamw = smallest(full).estimate.peak_device_gib
            reasons.append(say("plan.optimizer_adamw", optimizer=s.optimizer, peak=adamw))
        else:
            reasons.append(say("plan.optimizer", optimizer=s.optimizer))
    reasons += explain_savers(chosen, found, gpu, spec)
    if s.method == "qlora":
        said = "plan.qlora_double" if s.double_quant else "plan.qlora"
        reasons.append(say(said, lora_r=s.lora_r, lora_targets=s.lora_targets))
    if s.train_embeddings:
        frozen = estimate(spec, s.model_copy(update={"train_embeddings": False}), gpu, headroom)
        more = chosen.estimate.peak_device_gib - frozen.peak_device_gib
        reasons.append(say("plan.train_embeddings", params=memory.saved_module_params(spec, s), more=more))
    if spec.is_moe:
        reasons.append(moe_reason(spec, s))
    return reasons


def moe_reason(spec: ModelSpec, s: Settings) -> str:
    """What an MoE's experts are in this plan: 16-bit (bitsandbytes quantises nn.Linear layers only; gpt-oss's
    MXFP4 experts train dequantised to bf16), adapted or not."""
    adapted = spec.expert_target_names(s.lora_targets) and s.method != "full"
    experts = {"experts": spec.num_local_experts, "per_token": spec.num_experts_per_tok}
    if s.method == "full":
        return say("plan.moe_full", **experts)
    if adapted:
        return say("plan.moe_experts", **experts)
    # Gemma 4 26B-A4B: "all" also adapts the dense MLP beside its experts (gemma4.dense_mlp_rows)
    dense = any(name.startswith("mlp.") for name in spec.lora_target_names(s.lora_targets))
    said = "plan.moe_dense_mlp" if dense else "plan.moe_attention"
    return say(said, **experts, setting_targets="--lora-targets", setting_dropout="--lora-dropout")


def explain_savers(chosen: Candidate, found: list[Candidate], gpu: GpuSpec, spec: ModelSpec) -> list[str]:
    """One line per memory saver the plan turned on: what it moves or shrinks, what it costs, and what the same
    plan needs without it."""
    s = chosen.settings
    runtime = memory.stack_runtime(s)
    n = s.tokens_per_micro_batch
    lines = []
    for name in savers_on(s):
        off = s.model_copy(update={name: options.BY_NAME[name].default})
        twin = next((c for c in found if c.settings == off), None)

        def without(line: str, twin: Candidate | None = twin) -> str:
            return say("plan.without", line=line, peak=twin.estimate.peak_device_gib) if twin else line

        if name == "loss":
            full = memory.logits_bytes(spec, off, runtime)
            chunked = memory.chunked_loss_bytes(spec, s)
            extra = memory_cost_share(spec, s, off, gpu)
            tokens = memory.loss_chunk_tokens(s)
            line = say("plan.loss", tokens=tokens, chunked=gib(chunked), full=gib(full), extra=extra)
            lines.append(without(line))
        elif name == "offload_embeddings":
            moved = memory.offloaded_embedding_bytes(spec, s, runtime)
            lines.append(without(say("plan.offload_embeddings", moved=gib(moved), rows=n)))
        elif name == "offload_activations":
            host = memory.offloaded_activation_bytes(spec, s, runtime)
            extra = memory_cost_share(spec, s, off, gpu)
            line = say(
                "plan.offload_activations",
                layers=spec.num_hidden_layers,
                host=gib(host),
                moved=2 * host / 1e9,
                link=gpu.host_link_gbs or DEFAULT_HOST_LINK_GBS,
                extra=extra,
            )
            lines.append(without(line))
        elif name == "expandable_segments":
            plain = twin.estimate if twin else memory.estimate(spec, off)
            kept = chosen.estimate.peak_reserved_gib - chosen.estimate.peak_allocated_gib
            line = say("plan.expandable_segments", kept=kept, plain=plain.peak_reserved_gib - plain.peak_allocated_gib)
            lines.append(without(line))
    return lines


def explain_gpus(chosen: Candidate, gpu: GpuSpec, spec: ModelSpec) -> list[str]:
    """For several GPUs or an offload: what each GPU holds, what crosses which link, what the host needs."""
    s, e = chosen.settings, chosen.estimate
    if e.world_size == 1 and s.offload == "none":
        return []
    lines = []
    per_gpu = e.per_gpu_gib
    lines.append(
        say(
            "plan.gpus_hold",
            world=e.world_size,
            shard=SHARD_TITLES.get(s.shard, s.shard),
            weights=per_gpu["sharded_weights"],
            gradients=per_gpu["gradients"],
            states=per_gpu["optimizer_states"],
            gathered=per_gpu["gathered_layers"],
        )
    )
    if e.world_size > 1:
        within, between = hardware.links_of(gpu)
        link = within.title if s.nodes == 1 else f"{within.title} and {between.title}"
        per_micro, per_step = communication_bytes(spec, s)
        step = step_time(spec, s, gpu)
        moved = per_micro * step.micro_batches + per_step
        speed = collective_bytes_per_second(s, gpu) / 1e9
        share = step.communication / step.total
        lines.append(say("plan.communication", moved=moved / 1e9, link=link, speed=speed, share=share))
    if s.offload != "none":
        step = step_time(spec, s, gpu)
        host = sum(e.host_ram_breakdown_gib.get(part, 0.0) for part in ("offloaded_weights", "offloaded_optimizer"))
        lines.append(say("plan.offload", offload=s.offload, host=host, share=step.offload / step.total))
    if e.host_ram_gib is not None:
        lines.append(say("plan.host_ram", host=e.host_ram_gib))
    return lines


def memory_cost_share(spec: ModelSpec, on: Settings, off: Settings, gpu: GpuSpec) -> float:
    """How much longer a micro-batch takes with a saver on than off."""
    return step_seconds(spec, on, gpu) / step_seconds(spec, off, gpu) - 1


# --- suggestions when nothing fits -------------------------------------------------------------------------
MIN_SUGGESTED_SEQ_LEN = 128


def shorter_lengths(seq_len: int) -> list[int]:
    """Lengths below `seq_len`, longest first: the powers of two and the halfway steps between them (1536,
    768, ...), down to 128."""
    lengths = set()
    power = MIN_SUGGESTED_SEQ_LEN
    while power < seq_len:
        lengths |= {power, power * 3 // 2}
        power *= 2
    return sorted((n for n in lengths if n < seq_len), reverse=True)


def suggestions(request: PlanRequest, gpu: GpuSpec, seq_len: int, other_cards: bool = True) -> list[Suggestion]:
    """The smallest changes that fit: a shorter sequence, QLoRA, a bigger GPU (not without `other_cards`), or
    several GPUs sharded."""
    found: list[Suggestion] = []
    total_tokens = tokens_per_epoch(request) * request.epochs

    def suggest(change: str, fit: Candidate | None, on: GpuSpec = gpu) -> bool:
        if fit:
            found.append(suggestion(change, fit, on, total_tokens))
        return fit is not None

    for length in shorter_lengths(seq_len):
        if suggest(say("change.seq_len", seq_len=length, was=seq_len), best(candidates(request, gpu, length))):
            break
    if request.method != "qlora" and "quant" not in request.pinned:
        suggest(say("change.qlora", method=request.method), best(candidates(request, gpu, seq_len, method="qlora")))
    if request.method == "full":
        suggest(say("change.lora"), best(candidates(request, gpu, seq_len, method="lora")))

    def size_then_price(g: GpuSpec) -> tuple[int, float, float]:
        return round(g.memory_gib / 8), g.rent_usd_per_hour or 1e9, g.price_usd or 1e9

    for bigger in sorted(hardware.catalog().values(), key=size_then_price) if other_cards else []:
        if bigger.kind == "apple" or bigger.memory_gib <= gpu.memory_gib:
            continue
        change = say("change.bigger_gpu", gpu=bigger.name, memory=bigger.memory_gib)
        if suggest(change, best(candidates(request, bigger, seq_len)), bigger):
            break
    found += on_more_gpus(request, gpu, seq_len)
    return found


def suggestion(change: str, fit: Candidate, on: GpuSpec, total_tokens: float) -> Suggestion:
    s = fit.settings
    return Suggestion(
        change=change,
        settings=s,
        gpu=on.name,
        estimate=fit.estimate,
        n_gpus=s.n_gpus,
        nodes=s.nodes,
        shard=s.shard,
        offload=s.offload,
        tokens_per_s=round(fit.tokens_per_s, 1),
        hours=round(total_tokens / fit.tokens_per_s / 3600, 3),
    )


def on_more_gpus(request: PlanRequest, gpu: GpuSpec, seq_len: int) -> list[Suggestion]:
    """The suggestions of fewest_gpus: the fewest of this card that fit, without and with an offload."""
    total_tokens = tokens_per_epoch(request) * request.epochs
    return [
        suggestion(gpus_change(fit.settings, gpu, total_tokens / fit.tokens_per_s / 3600), fit, gpu, total_tokens)
        for fit in fewest_gpus(request, gpu, seq_len)
    ]


# GPUs of one machine the suggestions try. One GPU with an offload (DeepSpeed's ZeRO-Offload) is estimated when
# asked for (--shard zero3 --offload ...) but not suggested: `lorafit train` launches DeepSpeed and FSDP only
# for several processes.
GPU_COUNTS = (2, 4, 8)
OFFLOADS = ("none", "optimizer", "params")  # fastest first
SHARD_TITLES = {"ddp": "DDP", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp": "FSDP"}


def several_gpus_shard(request: PlanRequest) -> str:
    """The shard several GPUs run when none is pinned: ZeRO-3, or FSDP for a 4-bit base where the stack loads
    it whole onto every GPU under ZeRO-3 but in host memory under FSDP (lorafit's trainer), so that no GPU has
    to hold the whole base while it is loaded."""
    if "shard" in request.pinned:
        return request.pinned["shard"]
    stack = stacks.resolve(request.fixed.stack)
    if stack.shards:
        return stack.shards[0]  # the one way its step runs on several GPUs (Unsloth's: DDP)
    if request.model.prequantized is not None:
        return "zero2"  # its stored uint8 4-bit weights cannot be sharded (options.PREQUANTIZED_UNSHARDABLE)
    quant = request.pinned.get("quant", options.default_quant(request.method))
    if quant != "nf4":
        return "zero3"
    probe = Settings(method=request.method, quant=quant, stack=request.pinned.get("stack", "lorafit"))
    whole_on_gpu = memory.stack_runtime(probe).quantized_whole_on_gpu
    return "fsdp" if "zero3" in whole_on_gpu and "fsdp" not in whole_on_gpu else "zero3"


def fewest_gpus(request: PlanRequest, gpu: GpuSpec, seq_len: int) -> list[Candidate]:
    """The fewest GPUs of this kind that fit, sharded with several_gpus_shard: the fewest without an offload
    and, where an offload to host memory fits on fewer, that one too (the first offload that fits at the
    smallest count: optimizer states before parameters, which cost more copies; FSDP offloads only both)."""
    pinned_offload = request.pinned.get("offload")
    shard = several_gpus_shard(request)
    # an offloaded optimizer steps 32-bit AdamW on the CPU: not tried for a pinned optimizer without a CPU step
    offloads: tuple[str, ...] = (
        OFFLOADS if request.pinned.get("optimizer", "adamw") in rules.OFFLOAD_OPTIMIZERS else ("none",)
    )
    if shard == "fsdp":
        offloads = tuple(offload for offload in offloads if offload != "optimizer")
    if shard == "zero2":  # (a pre-quantised base) ZeRO-2 keeps every weight on every GPU: nothing to offload
        offloads = tuple(offload for offload in offloads if offload != "params")
    if shard == "ddp":  # every GPU holds the whole step: nothing is sharded to offload
        offloads = ("none",)
    found: list[Candidate] = []
    for n_gpus in (n for n in GPU_COUNTS if n >= request.n_gpus and request.effective_batch % n == 0):
        tried = [pinned_offload] if pinned_offload else list(offloads) if not found else ["none"]
        for offload in tried:
            if (n_gpus, offload) == (request.n_gpus, pinned_offload or "none"):
                continue  # the plan itself
            fit = best(candidates(request, gpu, seq_len, n_gpus=n_gpus, shard=shard, offload=offload))
            if fit:
                found.append(fit)
                break
        if found and found[-1].settings.offload == "none":
            break
    return found


def gpus_change(settings: Settings, gpu: GpuSpec, hours: float) -> str:
    """'2x RTX 4090 with FSDP and CPU offload of the parameters, 31.2 h'."""
    key = "change.gpus" + ("_nodes" if settings.nodes > 1 else "") + ("_offload" if settings.offload != "none" else "")
    offload = say(f"offload.{settings.offload}") if settings.offload != "none" else ""
    shard = SHARD_TITLES.get(settings.shard, settings.shard)
    return say(
        key, n_gpus=settings.n_gpus, gpu=gpu.name, nodes=settings.nodes, shard=shard, offload=offload, hours=hours
    )


# --- the plan -----------------------------------------------------------------------------------------------
def resolve_seq_len(request: PlanRequest) -> int:
    """The user's length, else the data's longest row, else 2048; never past the model's maximum."""
    seq_len = request.seq_len or (request.tokens.max if request.tokens and request.tokens.max else DEFAULT_SEQ_LEN)
    spec = request.model
    if stacks.past_positions(request.fixed.stack, request.seq_len, spec.name, spec.max_position_embeddings):
        return seq_len  # the stack scales RoPE to reach it (automatic_choices says by what factor)
    return min(seq_len, spec.max_position_embeddings)


def on_the_cpu(
    found: list[Candidate], chosen: Candidate, reasons: list[str], headroom: float
) -> tuple[Candidate, list[str]]:
    """Training on the CPU, the step's memory is host RAM: checkpointing off when the step without it fits in
    the RAM free now, since recomputing the forward costs about a third more time (as a plain Trainer runs
    by default); on when it does not."""
    free = hardware.available_ram_gib()
    without = [c for c in found if not c.settings.grad_ckpt and c.settings.micro_batch == chosen.settings.micro_batch]
    if not chosen.settings.grad_ckpt or not without or free is None:
        return chosen, reasons
    lighter = max(without, key=lambda c: c.settings.optimizer == "adamw")
    usable = free * (1 - headroom)
    if lighter.estimate.peak_allocated_gib > usable:
        return chosen, reasons + [say("plan.cpu_ckpt_on", need=lighter.estimate.peak_allocated_gib, free=usable)]
    return lighter, [
        say("plan.cpu_defaults"),
        say("plan.cpu_ckpt_off", need=lighter.estimate.peak_allocated_gib, free=usable),
    ]


def tokens_per_epoch(request: PlanRequest) -> int:
    if request.tokens_per_epoch:
        return request.tokens_per_epoch
    if request.tokens:
        return request.tokens.total_tokens
    return DEFAULT_TOKENS_PER_EPOCH


def unsloth_loads(model: ModelSpec, settings: Settings) -> str:
    """What Unsloth loads for a 16-bit name in 4-bit: its dynamic copy, whose 16-bit layers the estimate counts
    where the catalog has them (memory.as_loaded), and says so; otherwise that the estimate may be low."""
    copy = memory.as_loaded(model, settings)
    if copy.prequantized is None or not copy.prequantized.kept_16bit_params:
        return say("plan.unsloth_dynamic_4bit", model=model.hf_id or model.name)
    runtime = memory.stack_runtime(settings)
    more = memory.weights_bytes(copy, settings, runtime) - memory.weights_bytes(model, settings, runtime)
    said = {"params": copy.prequantized.kept_16bit_params / 1e9, "gib": gib(more)}
    return say("plan.unsloth_dynamic_known", model=model.hf_id or model.name, repo=copy.hf_id, **said)


def automatic_choices(request: PlanRequest, settings: Settings) -> list[str]:
    """Plain words for the settings nobody set that follow from the model, the GPU or the device."""
    reasons = []
    if (stored := request.model.prequantized) is not None:
        base = say("plan.base_named", base=stored.base) if stored.base else say("plan.base_unnamed")
        said = "plan.prequantized_double" if stored.double_quant else "plan.prequantized"
        reasons.append(
            say(said, model=request.model.hf_id or request.model.name, quant=stored.quant.upper(), base=base)
        )
        # stacks (issue 28): which modules a dynamic 4-bit repo keeps 16-bit is its own config.json's choice,
        # published nowhere else; without that file the estimate packs every linear, so it says so
        if stored.kept_16bit_params is None and is_unsloth_dynamic_quant(request.model.hf_id or request.model.name):
            reasons.append(say("plan.dynamic_4bit", model=request.model.hf_id or request.model.name))
    elif settings.stack == "unsloth" and settings.quant == "nf4":
        # with load_in_4bit Unsloth swaps a 16-bit name for its mapper's dynamic 4-bit key where it has one
        # (unsloth/models/loader_utils.py @ 015bdef0 __get_model_name l. 163-174, mapper.py)
        reasons.append(unsloth_loads(request.model, settings))
    if "attn" not in request.pinned and settings.attn != options.BY_NAME["attn"].default:
        reasons.append(say("plan.attn", attn=settings.attn, model=request.model.name))
    if "precision" not in request.pinned and settings.precision == "fp32" and request.device == "cpu":
        reasons.append(say("plan.cpu_fp32"))
    elif "precision" not in request.pinned and settings.precision == "fp16" and request.gpu:
        reasons.append(say("plan.no_bf16", gpu=request.gpu.name))
    spec = request.model
    if rope := stacks.past_positions(settings.stack, settings.seq_len, spec.name, spec.max_position_embeddings):
        reasons.append(rope)
    return reasons


def serve_context(request: PlanRequest) -> int:
    """The context to size serving at: as set (past the model's maximum is an error), else the default capped at
    the model's maximum."""
    if "serve_context" in request.model_fields_set:
        return request.serve_context
    return min(request.serve_context, request.model.max_position_embeddings)


def under_other_trainers(request: PlanRequest, chosen: Settings, gpu: GpuSpec) -> list[TrainerFit]:
    """Whether the job fits with each other offered trainer: the planner's search with that stack pinned (the
    savers it lacks left out), its fastest fitting step or, when none fits, its smallest; a trainer that cannot
    run the job at all (its base, a multi-GPU engine) is left out."""
    found = []
    for stack in stacks.offered():
        if stack.name == chosen.stack or (
            chosen.seq_len > request.model.max_position_embeddings and not stack.rope_scaling
        ):
            continue  # (a trainer that does not scale RoPE cannot run past the model's positions)
        lacks = {saver for saver in SAVERS if saver not in stack.savers} | {"kbit_prep", "fp32_adapters"}
        lacks |= set() if stack.liger_runtime else {"liger"}
        given = {name: value for name, value in request.given.items() if name not in lacks}
        try:
            # the stack's own refusals (its bases, methods, shards, model families)
            stacks.check(given | {"stack": stack.name, "method": request.method}, request.model.architecture)
            there = request.model_copy(update={"fixed": Settings.given(given | {"stack": stack.name})})
            tried = candidates(there, gpu, chosen.seq_len, n_gpus=chosen.n_gpus, shard=chosen.shard)
        except LorafitError:
            continue
        pick = best(tried) or smallest(tried)
        found.append(
            TrainerFit(stack=stack.name, peak_device_gib=pick.estimate.peak_device_gib, fits=pick.estimate.fits)
        )
    return found


# The settings that say how one stack's step runs (`--autocast`, `--liger`, ...): a facet of one stack, not a job's.
STACK_FACETS = tuple(o.name for o in options.OPTIONS if o.group == "stack" and o.name != "stack")


@dataclass(frozen=True)
class StackRow:
    """The job under one offered stack (`plan --stack all`): the plan `plan --stack NAME` makes, and the
    settings its search chose differently from the plan it is compared with; or the line that refuses the job."""

    stack: stacks.StackSpec
    plan: Plan | None
    changes: dict[str, Any]
    refused: str | None = None
    lacks: tuple[str, ...] = ()  # the savers the compared plan turned on that this stack has no switch for

    def to_json(self) -> dict[str, Any]:
        """As `plan --stack all --json` lists it: the speed and hours only where the job fits, the plan's first
        change that fits where it does not."""
        plan = self.plan
        if plan is None:  # the same keys, for programs
            unsaid = dict.fromkeys(("peak_device_gib", "fits", "tokens_per_s", "hours", "settings"))
            return (
                {"stack": self.stack.name, "pinned": self.stack.pinned, "verdict": "refused", "refused": self.refused}
                | unsaid
                | {"changes": {}, "lacks_savers": [], "smallest_change": None}
            )
        fits = plan.fits and plan.gpu is not None
        first = plan.suggestions[0] if plan.suggestions and not plan.fits else None
        return {
            "stack": self.stack.name,
            "pinned": self.stack.pinned,
            "verdict": plan.verdict,
            "refused": None,
            "peak_device_gib": plan.estimate.peak_device_gib,
            "fits": plan.estimate.fits,
            "tokens_per_s": plan.tokens_per_s if fits else None,
            "hours": plan.hours if fits else None,
            "settings": plan.settings.model_dump(mode="json"),
            "changes": self.changes,
            "lacks_savers": list(self.lacks),
            "smallest_change": None
            if first is None
            else {"change": first.change, "gpu": first.gpu, "peak_device_gib": first.estimate.peak_device_gib},
        }


def under_every_stack(request: PlanRequest, chosen: Plan, truncated_rows: int | None = None) -> list[StackRow]:
    """The job planned with each offered stack pinned, as `plan --stack NAME` plans it (without the other
    trainers' line), beside `chosen`, the plan of the stack the request names; a stack whose refusals (its bases,
    methods, model families, positions) rule the job out gets its one-line reason instead of a plan. A row's
    `changes`: the settings its search chose otherwise than `chosen`'s, the savers the stack lacks left out."""
    rows = []
    for stack in stacks.offered():
        if stack.name == chosen.settings.stack:
            rows.append(StackRow(stack, chosen, {}))
            continue
        try:
            there = make_plan(request.fixing(stack=stack.name), truncated_rows, details=False)
        except LorafitError as error:
            rows.append(StackRow(stack, None, {}, str(error).splitlines()[0]))
            continue
        mine, theirs = chosen.settings.model_dump(mode="json"), there.settings.model_dump(mode="json")
        lacks = {saver for saver in SAVERS if saver not in stack.savers}  # off by necessity, not by choice
        changes = {
            name: value
            for name, value in theirs.items()
            if name not in (*STACK_FACETS, "stack", *lacks) and value != mine.get(name)
        }
        rows.append(StackRow(stack, there, changes, lacks=tuple(s for s in savers_on(chosen.settings) if s in lacks)))
    return rows


def searched(request: PlanRequest) -> tuple[int, GpuSpec | None, list[Candidate]]:
    """(the length, the card at the user's price, every candidate) of the request's own search."""
    seq_len = resolve_seq_len(request)
    gpu = request.gpu
    if gpu is not None and request.rent_price is not None:  # the user's own price for this card
        gpu = gpu.model_copy(update={"rent_usd_per_hour": request.rent_price})
    options.check_against(
        request.pinned | {"method": request.method}, request.model, gpu, on_cpu=request.device == "cpu"
    )
    shard = several_gpus_shard(request) if request.n_gpus * request.pinned.get("nodes", 1) > 1 else "none"
    return seq_len, gpu, candidates(request, gpu, seq_len, n_gpus=request.n_gpus, shard=shard)


def make_plan(request: PlanRequest, truncated_rows: int | None = None, details: bool = True) -> Plan:
    """The fastest settings that fit `request.gpu`, with time and cost, or the smallest changes that fit; with
    `details` (not in --compare's table) also the other trainers' verdicts and what gives a tight fit more room."""
    seq_len, gpu, found = searched(request)
    chosen = best(found) if gpu else None
    reasons: list[str] = []
    extra: list[Suggestion] = []
    leanest: float | None = None
    if chosen and gpu:
        reasons = explain(chosen, found, gpu, request.headroom, request.model)
        reasons += explain_gpus(chosen, gpu, request.model)
        leanest = smallest(found).estimate.peak_device_gib
        if details and is_tight(True, leanest, gpu, request.headroom):  # what gives the job more room
            roomier = request.model_copy(update={"headroom": request.headroom + TIGHT_SHARE})
            extra = suggestions(roomier, gpu, seq_len)
    elif gpu:
        chosen = smallest(found)
        savers = ", ".join(savers_on(chosen.settings))
        reasons = [
            say(
                "plan.no_fit_savers" if savers else "plan.no_fit",
                peak=chosen.estimate.peak_device_gib,
                setting_savers=savers,
                gpu=gpu.name,
                usable=gpu.usable_gib(request.headroom),
                headroom=request.headroom,
            )
        ]
        sharded = chosen.settings.model_copy(update={"n_gpus": 2, "shard": several_gpus_shard(request)})
        runtime = memory.stack_runtime(sharded)
        loading = gib(memory.gpu_loading_bytes(request.model, sharded, runtime))
        if loading and loading + runtime.cuda_context_gib > gpu.usable_gib(request.headroom):
            fsdp_loads_on_host = "fsdp" not in runtime.quantized_whole_on_gpu
            instead = "--shard fsdp" if fsdp_loads_on_host else "--stack lorafit (FSDP)"
            shards = SHARD_TITLES[sharded.shard] if fsdp_loads_on_host else "FSDP or ZeRO-3"
            stack, quant = chosen.settings.stack, chosen.settings.quant
            reasons.append(
                say(
                    "plan.loads_whole",
                    gpu=gpu.name,
                    stack=stack,
                    shards=shards,
                    quant=quant,
                    loading=loading,
                    instead=instead,
                )
            )
        extra = suggestions(request, gpu, seq_len)
    else:
        modest = [c for c in found if c.settings.micro_batch <= 4] or found
        chosen = max(
            modest, key=lambda c: (c.settings.grad_ckpt, c.settings.optimizer == "adamw", c.settings.micro_batch)
        )
        reasons = [say("plan.no_gpu")]
        if request.device == "cpu":
            chosen, reasons = on_the_cpu(modest, chosen, reasons, request.headroom)
    reasons += automatic_choices(request, chosen.settings)
    batching = options.resolve_batching(request.batching, chosen.settings.attn)
    if request.device is not None and request.batching == "auto":
        reasons.append(say("plan.packed" if batching == "padding_free" else "plan.grouped", batching=batching))
    if truncated_rows:
        reasons.append(say("plan.truncates", seq_len=seq_len, rows=truncated_rows))
    if request.model.vision is not None:
        reasons.append(say("plan.vision"))
    if (layout := request.model.global_layers) and layout.per_layer_input:  # Gemma 4 E2B / E4B (gemma4.py)
        table = gemma4.per_layer_table_params(request.model) / 1e9
        reasons.append(say("plan.per_layer_inputs", params=table, shared=layout.kv_shared_layers))
    if request.model.cross_attention is not None:  # Llama 3.2 Vision (mllama.py)
        reasons.append(say("plan.mllama", layers=len(request.model.cross_attention.layers)))
    speed = chosen.tokens_per_s if gpu else 0.0
    epoch_tokens = tokens_per_epoch(request)
    timing = time_and_cost(
        gpu, memory.world_size(chosen.settings), speed, epoch_tokens * request.epochs, request.kwh_price
    )
    return Plan(
        model=request.model,
        gpu=gpu,
        settings=chosen.settings,
        estimate=chosen.estimate,
        batch_size=request.effective_batch,
        epochs=request.epochs,
        batching=batching if request.device is not None else None,
        device=request.device,
        tokens=request.tokens,
        truncated_rows=truncated_rows,
        tokens_per_epoch=epoch_tokens,
        kwh_price=request.kwh_price,
        reasons=reasons,
        suggestions=extra,
        serving=serving.serving(request.model, serve_context(request), gpu, request.headroom),
        leanest_peak_gib=leanest,
        trainers=under_other_trainers(request, chosen.settings, gpu) if gpu and details else [],
        **timing,  # type: ignore[arg-type]  # hours and the costs, each typed in Plan
    )


def with_settings(plan: Plan, settings: Settings) -> Plan:
    """The same plan run with other settings (a setting the user overrides, the pre-flight's or the
    out-of-memory guard's smaller micro-batch): the memory estimated again, the time and cost with it."""
    if settings == plan.settings:
        return plan
    update: dict = {"settings": settings, "estimate": estimate(plan.model, settings, plan.gpu, plan.estimate.headroom)}
    if plan.gpu is not None and plan.tokens_per_s:
        speed = tokens_per_second(plan.model, settings, plan.gpu)
        # the same run: the tokens it trains stay
        update |= time_and_cost(plan.gpu, memory.world_size(settings), speed, plan.run_tokens, plan.kwh_price)
    return plan.model_copy(update=update)


def compare(request: PlanRequest, max_price_hour: float | None = None) -> list[Plan]:
    """Plan the job on every rentable catalog GPU (or under a price cap); fitting ones first, fastest first."""
    return in_compare_order(list(compare_rows(request, max_price_hour)))


def compare_rows(request: PlanRequest, max_price_hour: float | None = None) -> Iterator[Plan]:
    """compare's plans one card at a time, in catalog order, for a table filled as they come."""
    if request.rent_price is not None:
        raise LorafitError("--rent-price is what one GPU costs you; --compare prices each card from the catalog")
    for gpu in hardware.gpus(max_price_hour=max_price_hour):
        if gpu.kind != "apple":
            yield compared(request, gpu)


def in_compare_order(plans: list[Plan]) -> list[Plan]:
    """Fitting ones first, fastest first; then the others, smallest peak first."""
    return sorted(plans, key=lambda p: (not p.fits, p.hours if p.fits else p.estimate.peak_device_gib))


def compared(request: PlanRequest, gpu: GpuSpec) -> Plan:
    """The comparison's row for one card: the plan on it or, where it does not fit, several_of. several_of picks
    among the suggestions on this card only: those are worked out first (only the fewest-GPU ones when the
    request pins one machine and no offload, as the others then run on one GPU), the rest of the suggestions
    only for a card that does not fit even on several."""
    one = request.model_copy(update={"gpu": gpu})
    seq_len, _, found = searched(one)
    if best(found) is None:
        one_machine = request.pinned.get("nodes", 1) == 1 and request.pinned.get("offload", "none") == "none"
        on_this_card = (
            on_more_gpus(one, gpu, seq_len) if one_machine else suggestions(one, gpu, seq_len, other_cards=False)
        )
        several = on_several(request, on_this_card, gpu)
        if several is not None:
            return several
    plan = make_plan(one, details=False)
    return plan if plan.fits else several_of(request, plan, gpu)


def several_of(request: PlanRequest, plan: Plan, gpu: GpuSpec) -> Plan:
    """Where one card does not fit: the plan on the fewest of it that do (sharded, or offloaded), the one of
    the plan's suggestions with the fewest GPU-hours; the plan itself when none does."""
    return on_several(request, plan.suggestions, gpu) or plan


def on_several(request: PlanRequest, suggested: list[Suggestion], gpu: GpuSpec) -> Plan | None:
    """The plan of the suggestion for several of `gpu` (offloaded or not) with the fewest GPU-hours; None without
    one. One card is never suggested with an offload (fewest_gpus starts at two), so a one-card suggestion with
    one - a shorter sequence or QLoRA under an offload the user pinned - is not of this kind."""
    several = [s for s in suggested if s.gpu == gpu.name and s.n_gpus * s.nodes > 1]
    if not several:
        return None
    chosen = min(several, key=lambda s: ((s.hours or 0.0) * s.n_gpus * s.nodes, s.n_gpus))
    fixed = request.fixing(n_gpus=chosen.n_gpus, shard=chosen.shard, offload=chosen.offload, nodes=chosen.nodes)
    return make_plan(fixed.model_copy(update={"gpu": gpu}), details=False)


def cheapest(plans: list[Plan], max_usd_per_hour: float | None = None) -> Plan | None:
    rentable = [
        p
        for p in plans
        if p.fits
        and p.cost_cloud_usd is not None
        and p.gpu
        and (max_usd_per_hour is None or (p.gpu.rent_usd_per_hour or 0) <= max_usd_per_hour)
    ]
    return min(rentable, key=lambda p: p.cost_cloud_usd or 0.0) if rentable else None
