"""Output for people (rich tables) and for programs (JSON). No computation here."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console, JustifyMethod
from rich.markup import escape
from rich.table import Table

from lorafit import costs, options
from lorafit.configs import KIND_TITLES
from lorafit.hardware import GpuSpec, LocalMachine
from lorafit.models import ModelSpec, variants
from lorafit.plan import DEFAULT_TOKENS_PER_EPOCH, StackRow
from lorafit.schema import TIGHT_SHARE, Estimate, Plan, Settings, TokenProfile
from lorafit.serving import Serving

if TYPE_CHECKING:
    from lorafit.answers import FromConfig
    from lorafit.stacks import StackSpec

console = Console(highlight=False)


def print_json(data: Any) -> None:
    """Plain JSON on stdout, nothing else, so that `| jq` always works."""
    print(json.dumps(data, indent=2))


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} GiB"


def _usd(value: float | None) -> str:
    return "-" if value is None else f"${value:,.2f}"


def _hours(hours: float) -> str:
    return f"{hours * 60:.0f} min" if hours < 1 else f"{hours:.1f} h"


def _hours_between(low: float, high: float) -> str:
    return f"{low:.1f}-{high:.1f} h" if low >= 1 else f"{_hours(low)} to {_hours(high)}"


def settings_line(settings: Settings) -> str:
    quant = f" {settings.quant}" if settings.quant != "none" else ""
    lora = f", LoRA r={settings.lora_r} on {settings.lora_targets}" if settings.method != "full" else ""
    lora += " + embeddings and LM head" if settings.train_embeddings and settings.method != "full" else ""
    gpus = f", {settings.n_gpus} GPUs {settings.shard}" if settings.n_gpus > 1 else ""
    if settings.nodes > 1:
        gpus = f", {settings.n_gpus} GPUs x {settings.nodes} nodes {settings.shard}"
    if settings.offload != "none":
        gpus += f"{'' if gpus else ', ' + settings.shard}, offload {settings.offload}"
    savers = saver_names(settings)
    return (
        stack_words(settings)
        + f"{settings.method}{quant} {settings.precision}{lora}, micro-batch {settings.micro_batch} x accumulation "
        f"{settings.grad_accum}, seq {settings.seq_len}, checkpointing {'on' if settings.grad_ckpt else 'off'}, "
        f"{settings.optimizer}, attention {settings.attn}{gpus}" + (f", savers: {', '.join(savers)}" if savers else "")
    )


def stack_words(settings: Settings) -> str:
    """ "stack trl (no autocast): " where the step is not lorafit's own as it comes."""
    facets = [
        f"{'' if on else 'no '}{name}"
        for name, on in (
            ("autocast", settings.autocast),
            ("kbit preparation", settings.kbit_prep),
            ("fp32 adapters", settings.fp32_adapters),
            ("fused AdamW", settings.fused_optimizer),
            ("torch.compile", settings.torch_compile),
            ("Liger kernels", settings.liger),
        )
        if on is not None
    ]
    if settings.stack == "lorafit" and not facets:
        return ""
    return f"stack {settings.stack}" + (f" ({', '.join(facets)})" if facets else "") + ": "


def warn_about(source: FromConfig | None) -> None:
    """What a config file (`--from`) sets that the answer does not model, one line each, on stderr."""
    if source is None:
        return
    err = Console(stderr=True, highlight=False)
    err.print(
        f"{source.path}: read as a config of {KIND_TITLES[source.kind]}; answered for stack {source.stack}",
        soft_wrap=True,
    )
    for warning in source.warnings:
        err.print(escape(f"warning: {warning}"), soft_wrap=True)


def saver_names(settings: Settings) -> list[str]:
    """The memory savers on, by the names of their options (`loss chunked` for the loss)."""
    names = ["loss chunked"] if settings.loss == "chunked" else []
    return names + [
        name for name in ("offload_embeddings", "offload_activations", "expandable_segments") if getattr(settings, name)
    ]


# Parts of the estimate that only a CUDA device has: its caching allocator and its context.
CUDA_ONLY_PARTS = ("allocator_reserve", "cuda_context", "paged_optimizer_states")


def estimate_table(result: Estimate, title: str, on_cuda: bool = True) -> Table:
    """The breakdown and the three peaks; on the CPU only the tensors themselves (no allocator reserve, no CUDA
    context, no nvidia-smi figure)."""
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("part")
    table.add_column("GiB", justify="right")
    for name, gib in result.breakdown_gib.items():
        if on_cuda or name not in CUDA_ONLY_PARTS:
            table.add_row(name.replace("_", " "), f"{gib:.2f}")
    table.add_section()
    if not on_cuda:
        table.add_row(
            "[bold]live tensors at the peak (CPU RAM)[/bold]", f"[bold]{result.peak_allocated_gib:.2f}[/bold]"
        )
        return table
    table.add_row("allocated (max_memory_allocated)", f"{result.peak_allocated_gib:.2f}")
    table.add_row("reserved (max_memory_reserved)", f"{result.peak_reserved_gib:.2f}")
    table.add_row("[bold]device (nvidia-smi)[/bold]", f"[bold]{result.peak_device_gib:.2f}[/bold]")
    return table


def verdict(fits: bool | None, gpu_name: str | None, on_cpu: bool = False, tight: bool = False) -> str:
    if on_cpu:
        return "training on the CPU (no GPU): no memory verdict"
    if fits is None:
        return "no GPU given: no verdict"
    if tight:
        return f"[yellow]fits, tightly,[/yellow] on {gpu_name}"
    return f"[green]fits[/green] on {gpu_name}" if fits else f"[red]does not fit[/red] on {gpu_name}"


def stack_title(stack: str) -> str:
    return "lorafit's own trainer" if stack == "lorafit" else stack


def trainers_line(plan: Plan) -> str | None:
    """One line when the trainer changes the verdict: the plan's trainer, those the job fits with, those it does not."""
    if plan.gpu is None or not plan.trainers or all(bool(t.fits) == plan.fits for t in plan.trainers):
        return None
    usable = plan.gpu.usable_gib(plan.estimate.headroom)
    ranked = sorted(plan.trainers, key=lambda t: t.peak_device_gib)
    line = (
        f"trainers: {'fits' if plan.fits else 'does not fit'} with {stack_title(plan.settings.stack)} "
        f"({plan.estimate.peak_device_gib:.2f} of {usable:.2f} GiB)"
    )
    if fitting := [f"{stack_title(t.stack)} ({t.peak_device_gib:.2f} GiB)" for t in ranked if t.fits]:
        line += "; fits with " + ", ".join(fitting)
    if missing := [f"{stack_title(t.stack)} ({t.peak_device_gib:.2f} GiB)" for t in ranked if not t.fits]:
        line += "; not with " + ", ".join(missing)
    return line


def tight_line(plan: Plan) -> str:
    usable = plan.gpu.usable_gib(plan.estimate.headroom) if plan.gpu else 0.0
    leanest = plan.leanest_peak_gib or plan.estimate.peak_device_gib
    line = (
        f"tight: even the leanest step needs {leanest:.2f} of {usable:.2f} GiB, less room than the memory model's "
        f"median error on published runs ({TIGHT_SHARE:.1%}, make bench-memory); a small error runs out of memory"
    )
    if sys.platform == "win32":
        line += (
            "; on Windows NVIDIA's driver then spills into shared system memory instead of failing (its Sysmem "
            "Fallback Policy, on by default) and steps run about 10x slower"
        )
    return line


def show_estimate(spec: ModelSpec, settings: Settings, result: Estimate, gpu: GpuSpec | None) -> None:
    console.print(
        f"[bold]{spec.name}[/bold]  {spec.num_params / 1e9:.2f}B parameters, "
        f"{result.trainable_params / 1e6:,.1f}M trainable"
    )
    console.print(settings_line(settings))
    console.print(estimate_table(result, f"peak memory per GPU, at the {result.peak_phase}"))
    show_gpus_and_host(settings, result)
    console.print(verdict(result.fits, gpu.name if gpu else None))


def show_gpus_and_host(settings: Settings, result: Estimate, out: Console | None = None) -> None:
    """Several GPUs or an offload: one GPU's share, and the host RAM each machine needs."""
    if result.world_size == 1 and settings.offload == "none":
        return
    out = out or console
    shares = ", ".join(f"{name.replace('_', ' ')} {gib:.2f}" for name, gib in result.per_gpu_gib.items())
    out.print(f"per GPU of {result.world_size} (GiB): {shares}")
    if result.host_ram_gib is not None:
        parts = ", ".join(f"{name.replace('_', ' ')} {gib:.1f}" for name, gib in result.host_ram_breakdown_gib.items())
        out.print(f"host RAM per machine: {result.host_ram_gib:.1f} GiB ({parts})")


def time_line(plan: Plan) -> str:
    """'2,184 tokens/s -> 5.7 h (4.1-6.7 h) for 3 epoch(s) of 15,000,000 tokens (an Alpaca-sized default
    dataset)': the speed, the hours with their likely range, and the tokens they are for and where those came
    from."""
    likely = f" ({_hours_between(*plan.hours_range)})" if plan.hours_range else ""
    if plan.tokens:
        source = plan.tokens.source
    elif plan.tokens_per_epoch == DEFAULT_TOKENS_PER_EPOCH:
        source = "an Alpaca-sized default dataset; --data or --tokens-per-epoch for yours"
    else:
        source = "--tokens-per-epoch"
    return (
        f"{plan.tokens_per_s:,.0f} tokens/s -> {_hours(plan.hours)}{likely} for {plan.epochs:g} epoch(s) of "
        f"{plan.tokens_per_epoch:,} tokens ({source})"
    )


def data_line(tokens: TokenProfile) -> str:
    """'72 rows, 4,420 tokens, longest row 66 (counted as lorafit train tokenizes them: ...)'."""
    basis = tokens.basis or (f"counted with the tokenizer of {tokens.tokenizer}" if tokens.tokenizer else "estimated")
    return f"{tokens.rows:,} rows, {tokens.total_tokens:,} tokens, longest row {tokens.max:,} ({basis})"


def time_basis_line(plan: Plan) -> str:
    """Where the speed comes from and what the range means."""
    if plan.time_basis == "measured":
        return "speed measured on this device (lorafit measure); range: the spread of the timed steps"
    runs = "runs"
    if plan.gpu:
        name, entry = costs.accuracy_of(plan.gpu, plan.estimate.world_size)
        runs = f"{entry['rows']} published runs ({name})"
    return (
        f"speed from the time model (every token counted, no padding); range: its error on {runs}, "
        "make bench-throughput; `lorafit measure` times it on your GPU"
    )


def show_plan(plan: Plan, out: Console | None = None) -> None:
    out = out or console
    on_cpu = plan.device == "cpu"
    gpu = plan.gpu.name if plan.gpu else "the CPU" if on_cpu else "no GPU"
    out.rule(f"[bold]{plan.model.name}[/bold] on {gpu}")
    out.print(
        verdict(plan.estimate.fits, plan.gpu.name if plan.gpu else None, on_cpu, plan.verdict == "tight")
        + f": {settings_line(plan.settings)}"
    )
    if plan.verdict == "tight":
        out.print(f"  - {tight_line(plan)}")
    if line := trainers_line(plan):
        out.print(f"  - {line}")
    for reason in plan.reasons:
        out.print(f"  - {reason}")
    if plan.tokens:
        out.print(f"  data: {data_line(plan.tokens)}")
    if plan.gpu and plan.fits:
        out.print(f"  time: {time_line(plan)}")
        out.print(f"        {time_basis_line(plan)}")
        out.print(
            f"  cost: rented {_usd(plan.cost_cloud_usd)}, own card {_usd(plan.cost_local_usd)} of "
            f"electricity at ${plan.kwh_price}/kWh"
            + (f"; buying pays off after {plan.break_even_runs:,.0f} runs" if plan.break_even_runs else "")
        )
    if plan.suggestions:
        title = "changes that leave more room" if plan.fits else "smallest changes that fit"
        table = Table(title=title, header_style="bold")
        for column in ("change", "settings", "device peak"):
            table.add_column(column)
        for suggestion in plan.suggestions:
            table.add_row(
                suggestion.change, settings_line(suggestion.settings), _gib(suggestion.estimate.peak_device_gib)
            )
        out.print(table)
    where = "in CPU RAM" if on_cpu else "per GPU"
    out.print(estimate_table(plan.estimate, f"peak memory {where}, at the {plan.estimate.peak_phase}", not on_cpu))
    show_gpus_and_host(plan.settings, plan.estimate, out)
    if plan.serving is not None:
        out.print(serving_table(plan.serving))


def serving_table(serving: Serving) -> Table:
    """Each export format of the merged model: bits per weight, weights, KV cache and the total to run it at the
    plan's context, whether that fits the plan's GPU and the smallest catalog card it fits."""
    where = f"on the {serving.gpu} with {serving.headroom:.0%} kept free" if serving.gpu else "(no GPU given)"
    table = Table(
        title=f"serving the merged model at {serving.context:,} tokens (GiB)",
        caption=f"total = weights + KV cache + compute buffer + CUDA context; fits: {where}; "
        "smallest card: the NVIDIA catalog GPU with the least memory that holds the total",
        header_style="bold",
    )
    for column in ("format", "runs on", "bits/weight", "weights", "KV cache", "total", "fits"):
        table.add_column(column, justify="left" if column in ("format", "runs on", "fits") else "right")
    table.add_column("smallest card", no_wrap=True)
    for row in serving.formats:
        table.add_row(
            row.format,
            row.runtime,
            f"{row.bits_per_weight:.2f}",
            f"{row.weights_gib:.2f}",
            f"{row.kv_cache_gib:.2f}",
            f"{row.total_gib:.2f}",
            "-" if row.fits_gpu is None else "yes" if row.fits_gpu else "no",
            row.smallest_gpu or "none in the catalog",
        )
    return table


def show_compare(plans: list[Plan], cheapest: Plan | None, cheapest_under: Plan | None, cap: float | None) -> None:
    table = Table(title=f"{plans[0].model.name}: GPUs ranked for this job", header_style="bold")
    for column in ("GPU", "memory", "fits", "settings", "tokens/s", "time", "rented", "own card"):
        table.add_column(column)
    for plan in plans:
        count = plan.settings.n_gpus * plan.settings.nodes
        offload = f", offload {plan.settings.offload}" if plan.settings.offload != "none" else ""
        table.add_row(
            (f"{count}x {plan.gpu.name}" if plan.gpu else "-")
            + (f" ({plan.settings.shard}{offload})" if count > 1 or offload else ""),
            f"{plan.gpu.memory_gib:.0f} GiB" if plan.gpu else "-",
            "yes" if plan.fits else "no",
            f"mb {plan.settings.micro_batch}, ckpt {'on' if plan.settings.grad_ckpt else 'off'}"
            + "".join(f", {name}" for name in saver_names(plan.settings)),
            f"{plan.tokens_per_s:,.0f}" if plan.fits else "-",
            _hours(plan.hours) if plan.fits else "-",
            _usd(plan.cost_cloud_usd) if plan.fits else "-",
            _usd(plan.cost_local_usd) if plan.fits else "-",
        )
    console.print(table)
    named = [("cheapest rented GPU that fits", cheapest)]
    if cap is not None:
        named.append((f"cheapest at most ${cap:g}/GPU-hour", cheapest_under))
    for label, chosen in named:
        if chosen is not None and chosen.gpu is not None:
            console.print(
                f"{label}: {chosen.gpu.name} at {_usd(chosen.gpu.rent_usd_per_hour)}/hour, "
                f"{_usd(chosen.cost_cloud_usd)} for the whole run ({_hours(chosen.hours)})"
            )


VERDICT_WORDS = {"fits": "fits", "tight": "tight", "no": "no", None: "-"}


def show_stacks_for(plan: Plan, rows: list[StackRow]) -> None:
    """`plan --stack all`: the job under each offered stack, one row each, as `plan --stack NAME` plans it; then
    one line per other stack: the settings its search chose otherwise than the plan above, or why it cannot run
    the job."""
    headers = ("stack", "version", "device GiB", "fits", "tokens/s", "time")
    cells = []
    for row in rows:
        version = row.stack.pinned.split(" (")[0].split(",")[0]
        if row.plan is None:
            cells.append((row.stack.name, version, "-", "cannot", "-", "-"))
            continue
        fits = row.plan.fits and row.plan.gpu is not None
        cells.append(
            (
                row.stack.name,
                version,
                f"{row.plan.estimate.peak_device_gib:.2f}",
                VERDICT_WORDS[row.plan.verdict],
                f"{row.plan.tokens_per_s:,.0f}" if fits else "-",
                _hours(row.plan.hours) if fits else "-",
            )
        )
    gpu = plan.gpu.name if plan.gpu else "no GPU"
    title = f"{plan.model.name} on {gpu}: the same job under each stack"
    table, dropped = fitted_table(title, headers, cells, ("version",), right=("device GiB", "tokens/s", "time"))
    console.print(table)
    if dropped:
        console.print(f"left out to fit {console.width} columns: {', '.join(dropped)} (all of them: --json)")
    for row in rows:
        if row.plan is not plan:
            said = stack_choices(row, plan) if row.plan else f"cannot run this job: {row.refused}"
            console.print(escape(f"  - {row.stack.name}: {said}"))


def stack_choices(row: StackRow, plan: Plan) -> str:
    """What a row's plan sets differently from `plan`, as the flags that set it, and the savers of `plan` the
    stack has no switch for; for a stack the job does not fit, its leanest step and the plan's first change
    that fits."""
    parts = [", ".join(flag_words(name, value) for name, value in row.changes.items())] if row.changes else []
    if row.lacks:
        lacking = ", ".join("loss chunked" if name == "loss" else name for name in row.lacks)
        parts.append(f"without {lacking} ({row.stack.name} has none)")
    changed = "; ".join(parts) or "the same settings"
    if row.plan is None or row.plan.fits or row.plan.gpu is None:
        return changed
    line = f"does not fit at these settings; its leanest: {changed}"
    if row.plan.suggestions:
        first = row.plan.suggestions[0]
        line += f"; fits with {first.change}, {first.estimate.peak_device_gib:.2f} GiB"
    return line


def flag_words(name: str, value: Any) -> str:
    """A setting as the flag that sets it: `--micro-batch 2`, `--no-grad-ckpt`."""
    option = options.BY_NAME[name]
    if isinstance(value, bool):
        return option.flag if value else option.off_flag or "--no-" + option.flag.removeprefix("--")
    return f"{option.flag} {value}"


def show_gpus(gpus: list[GpuSpec]) -> None:
    """The catalog; on a narrow terminal the columns a choice needs least (kind, nvidia-smi's figure, power,
    bandwidth, price) are left out, one at a time, so that each card stays on one line."""
    headers = ("GPU", "kind", "sold as", "device", "bf16 TFLOP/s", "GB/s", "W", "price", "rent/h")
    rows = [
        (
            gpu.name,
            gpu.kind,
            f"{gpu.memory_gb:g} GB",
            f"{gpu.memory_gib:.2f} GiB",
            f"{gpu.bf16_tflops:g}",
            f"{gpu.bandwidth_gbs:g}",
            f"{gpu.board_power_w:g}",
            _usd(gpu.price_usd),
            _usd(gpu.rent_usd_per_hour),
        )
        for gpu in gpus
    ]
    table, dropped = fitted_table("GPU catalog", headers, rows, drop_order=("kind", "device", "W", "GB/s", "price"))
    console.print(table)
    if dropped:
        console.print(f"left out to fit {console.width} columns: {', '.join(dropped)} (all of them: --json)")


def show_stacks(listed: list[StackSpec]) -> None:
    """One block per stack: its version and what its step keeps differently from lorafit's trainer."""
    for stack in listed:
        state = "" if stack.offered else escape(f"  [not offered: {stack.not_offered_because}]")
        console.print(f"[bold]{stack.name}[/bold]  {stack.title}{state}", highlight=False)
        console.print(f"  pinned: {stack.pinned}", highlight=False)
        quant = ", ".join(stack.quant) or "none"
        console.print(f"  trains over: quant {quant}; savers: {', '.join(stack.savers) or 'none'}", highlight=False)
        console.print(
            f"  --liger: {liger_words(stack)}; past the trained context: {rope_words(stack)}", highlight=False
        )
        for line in stack.keeps:
            console.print(f"  - {line}", highlight=False)
        console.print(f"  traced: {stack.traced}", highlight=False)
        if stack.nearest:
            console.print(f"  its config files (--from) are answered for stack {stack.nearest}", highlight=False)
    console.print("to compare the offered stacks for one job: lorafit plan --model MODEL --gpu GPU --stack all")


def liger_words(stack: StackSpec) -> str:
    if not stack.liger_runtime:
        return "no use_liger_kernel switch"
    kernels = "RMSNorm, SwiGLU, rotary"
    return kernels + (" and the fused linear cross-entropy" if stack.liger_fuses_loss else " (its own loss kept)")


def rope_words(stack: StackSpec) -> str:
    return "scales RoPE (rope_scaling)" if stack.rope_scaling else "refused (no RoPE scaling)"


def show_models(specs: list[ModelSpec]) -> None:
    """One row per preset; its variants (instruct/chat checkpoints, distills with the same shapes) are counted,
    not listed, so the table stays one screen. On a narrow terminal the hub id (then the count) is left out, so
    that each preset stays on one line."""
    headers = ("name", "hub id", "+variants", "parameters", "layers", "hidden", "vocab", "max seq")
    rows = [
        (
            spec.name,
            spec.hf_id or "-",
            str(len(variants(spec.name))) if variants(spec.name) else "",
            f"{spec.num_params / 1e9:.2f}B" if spec.num_params >= 1e9 else f"{spec.num_params / 1e6:.0f}M",
            str(spec.num_hidden_layers),
            str(spec.hidden_size),
            f"{spec.vocab_size:,}",
            f"{spec.max_position_embeddings:,}",
        )
        for spec in specs
    ]
    table, dropped = fitted_table("model presets", headers, rows, ("hub id", "+variants"), right=("+variants",))
    console.print(table)
    if dropped:
        console.print(f"left out to fit {console.width} columns: {', '.join(dropped)} (all of them: --json)")
    if "+variants" not in dropped:
        console.print(
            "+variants: hub ids with the preset's shapes (e.g. Qwen/Qwen2.5-7B-Instruct for qwen2.5-7b); pass one as "
            "--model, with or without its owner."
        )


def fitted_table(
    title: str,
    headers: tuple[str, ...],
    rows: Sequence[Sequence[str]],
    drop_order: tuple[str, ...],
    right: tuple[str, ...] = (),
) -> tuple[Table, list[str]]:
    """A table as wide as the console allows: while it would wrap, the next column of `drop_order` is left out.
    Returns the table and the headers left out. A cell never wraps: past the last column to drop, a long cell
    ends in an ellipsis."""
    dropped: list[str] = []
    while True:
        kept = [index for index, header in enumerate(headers) if header not in dropped]
        table = Table(title=title, header_style="bold")
        for index in kept:
            justify: JustifyMethod = "right" if headers[index] in right else "left"
            table.add_column(headers[index], justify=justify, no_wrap=True, overflow="ellipsis")
        for row in rows:
            table.add_row(*(row[index] for index in kept))
        natural = console.measure(table, options=console.options.update_width(1 << 16)).maximum
        if natural <= console.width or len(dropped) == len(drop_order):
            return table, dropped
        dropped.append(drop_order[len(dropped)])


def show_machine(machine: LocalMachine) -> None:
    if machine.gpus:
        for gpu in machine.gpus:
            known = f" (catalog: {gpu.catalog_name})" if gpu.catalog_name else " (not in the catalog)"
            console.print(f"GPU: {gpu.name}, {gpu.memory_gib:.1f} GiB{known}")
    else:
        console.print(f"GPU: none found ({machine.how})")
    ram = f"{machine.ram_gib:.1f} GiB" if machine.ram_gib else "unknown"
    console.print(f"CPU: {machine.cpu}, {machine.cpu_cores} cores; RAM: {ram}")
