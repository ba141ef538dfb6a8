"""What `lorafit estimate` and `lorafit plan` answer, as values and as the JSON their `--json` prints.

One place for the command line and the web API (`lorafit serve`): both hand in the settings that were set (as
text, as a flag or a query string gives them) and get the same answer, so the page cannot drift from the CLI.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from lorafit import configs, hardware, memory, models, options, stacks, trace
from lorafit import plan as planner
from lorafit.errors import LorafitError
from lorafit.hardware import GpuSpec
from lorafit.messages import say
from lorafit.models import ModelSpec
from lorafit.schema import PLAN_REQUEST_KEYS, Device, Estimate, Plan, PlanRequest, Settings

DEFAULT_MODEL = "llama-2-7b"
# `lorafit plan` with no model and no GPU: a comfortable and a tight card
EMBEDDED_GPUS = ("RTX 4090", "RTX 4060 Ti 16GB")


def target_gpu(gpu: str | None, vram: float | None) -> GpuSpec | None:
    """--gpu, else --vram, else the detected GPU (torch is not imported for this: NVML only)."""
    if gpu and vram:
        raise LorafitError(say("error.gpu_and_vram", setting_gpu="--gpu", setting_vram="--vram"))
    if gpu:
        return hardware.resolve(gpu)
    if vram is not None:
        return hardware.custom(vram)
    return hardware.detected_gpu(use_torch=False)


# --- --from: another trainer's config file ---------------------------------------------------------------------
@dataclass(frozen=True)
class FromConfig:
    """The config file an answer is for: its kind, the stack that answers for it, and what it sets that
    lorafit does not model (said on stderr, and in the JSON)."""

    path: str
    kind: str
    stack: str
    warnings: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "kind": self.kind, "stack": self.stack, "warnings": self.warnings}


def with_config(
    command: options.Command, path: str | None, given: Mapping[str, Any]
) -> tuple[dict[str, Any], FromConfig | None]:
    """The settings of `command` that the config file at `path` states, with the flags in `given` over them.
    Keys the command has no use for (an epoch count for `estimate`) are left out quietly."""
    if path is None:
        return dict(given), None
    imported = configs.read(Path(path))
    stack, stack_warning = stacks.for_config_of(imported.values["stack"])
    known = options.config_keys(command)
    values = {key: value for key, value in (imported.values | {"stack": stack}).items() if key in known}
    warnings = ([stack_warning] if stack_warning else []) + imported.unmodelled
    return values | dict(given), FromConfig(path, imported.kind, stack, warnings)


def _validated(
    command: options.Command, values: Mapping[str, Any], given: Mapping[str, Any], source: FromConfig | None
) -> Any:
    """`options.validate`, naming the config file for a value that came from it rather than from a flag."""
    return options.validate(command, values, source=source.path if source else "", from_flags=given)


# --- estimate -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EstimateAnswer:
    spec: ModelSpec
    settings: Settings
    result: Estimate
    gpu: GpuSpec | None
    exact: bool
    source: FromConfig | None = None

    def to_json(self) -> dict[str, Any]:
        return self.result.model_dump(mode="json") | {
            "exact": self.exact,
            "model": self.spec.model_dump(mode="json"),
            "settings": self.settings.model_dump(mode="json"),
            "gpu": self.gpu.model_dump(mode="json") if self.gpu else None,
            **({"from": self.source.to_json()} if self.source else {}),
        }


def estimate(given: Mapping[str, Any], *, exact: bool = False, from_config: str | None = None) -> EstimateAnswer:
    """`lorafit estimate` for the settings that were set (over those of the config file `from_config`)."""
    values, source = with_config("estimate", from_config, given)
    request = _validated("estimate", values, given, source)
    spec = models.resolve(request.model or DEFAULT_MODEL)
    target = target_gpu(request.gpu, request.vram)
    settings = options.settings_from(request.model_dump(exclude_unset=True), spec, target)
    if exact:
        if settings.stack != "lorafit":
            raise LorafitError(
                f"--exact traces lorafit's own training step; stack {settings.stack} is estimated from its traced "
                "facts (`lorafit stacks`): drop --exact, or use --stack lorafit"
            )
        if settings.liger:
            raise LorafitError(
                "--exact traces lorafit's own training step, which does not run Liger's Triton kernels; drop --exact "
                "or --liger"
            )
        result = trace.exact_estimate(spec, settings, target, request.headroom)
    else:
        result = memory.estimate(spec, settings, target, request.headroom)
    return EstimateAnswer(spec, settings, result, target, exact, source)


# --- plan ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanAnswer:
    """One plan; the embedded default's two; or (compare) one per catalog GPU, with the cheapest named."""

    kind: Literal["one", "embedded", "compare"]
    plans: list[Plan]
    note: str | None = None  # said before the plan when lorafit chose the GPU (none detected)
    max_price_hour: float | None = None
    source: FromConfig | None = None
    stacks: list[list[planner.StackRow]] | None = None  # with --stack all: each plan's job under every stack

    @property
    def cheapest(self) -> Plan | None:
        return planner.cheapest(self.plans)

    @property
    def cheapest_under_price(self) -> Plan | None:
        return planner.cheapest(self.plans, self.max_price_hour)

    def to_json(self) -> Any:
        source = {"from": self.source.to_json()} if self.source else {}
        dumped = [p.model_dump(mode="json") for p in self.plans]
        for plan, rows in zip(dumped, self.stacks or [], strict=False):
            plan["stacks"] = [row.to_json() for row in rows]
        if self.kind == "one":
            return dumped[0] | source
        if self.kind == "embedded":
            return dumped
        best_any, best_under = self.cheapest, self.cheapest_under_price
        return {
            "plans": dumped,
            "cheapest": best_any.gpu.name if best_any and best_any.gpu else None,
            "cheapest_under_price": best_under.gpu.name if best_under and best_under.gpu else None,
            "max_price_hour": self.max_price_hour,
            **source,
        }


def plan_request(
    given: Mapping[str, Any],
    *,
    compare: bool = False,
    data_path: Callable[[str], Path] = Path,
    from_config: str | None = None,
    device: Device | None = None,
    skip_bad_rows: bool = False,
) -> tuple[PlanRequest, Any, FromConfig | None, int | None]:
    """The validated request of `lorafit plan` (see `plan`), with the validated flags, the config file it read
    and the rows the length truncates: what a comparison is cached by (`lorafit serve`). `skip_bad_rows`: plan
    the dataset's sound rows where some have errors (the page's uploads)."""
    flags = given
    given, source = with_config("plan", from_config, flags)
    asked = _validated("plan", given, flags, source)
    if compare and (asked.gpu is not None or asked.vram is not None):
        raise LorafitError(
            f"--compare plans on every catalog GPU; drop {'--gpu' if asked.gpu is not None else '--vram'} to "
            "compare them all, or drop --compare to plan for that one"
        )
    spec = models.resolve(asked.model or DEFAULT_MODEL)
    profile, truncated = None, None
    if asked.data is not None:
        from lorafit.data import counter_for, length_profile  # loads only for data: `plan` starts faster

        options.check_against({"seq_len": asked.seq_len, "stack": asked.stack}, spec)
        lengths = length_profile(
            data_path(asked.data),
            tokenizer=counter_for(asked.model, asked.tokenizer, spec),
            skip_bad_rows=skip_bad_rows,
        )
        profile = lengths.profile
        truncated = lengths.truncated_rows(asked.seq_len or min(profile.max, spec.max_position_embeddings))
    request = PlanRequest(
        model=spec,
        tokens=profile,
        fixed=Settings.given({key: getattr(asked, key) for key in options.STEP_KEYS if key in given}),
        device=device,
        **{key: getattr(asked, key) for key in PLAN_REQUEST_KEYS if key in asked.model_fields_set},
    )
    return request, asked, source, truncated


def plan(
    given: Mapping[str, Any],
    *,
    compare: bool = False,
    data_path: Callable[[str], Path] = Path,
    from_config: str | None = None,
    card: GpuSpec | None = None,
    device: Device | None = None,
    skip_bad_rows: bool = False,
    every_stack: bool = False,
) -> PlanAnswer:
    """`lorafit plan` for the settings that were set (over those of the config file `from_config`: the run it
    describes, its step settings pinned). `data_path` turns the `data` setting into the file to profile (the
    web server maps it into its upload folder). `card` and `device`: the card to plan for in place of --gpu,
    --vram or the detected one, and where the run happens (`lorafit measure`: this machine's GPU or CPU).
    `skip_bad_rows`: plan the dataset's sound rows where some have errors (the page's uploads). `every_stack`
    (`--stack all`): each plan for the default stack, with the job under every offered stack beside it."""
    if every_stack and (compare or from_config):
        flag = "--compare" if compare else "--from"
        why = "compares the GPUs for one stack" if compare else "reads one trainer's config, run by one stack"
        raise LorafitError(f"--stack all compares the stacks on one GPU; {flag} {why}: drop one of them")
    if every_stack and (facets := [name for name in planner.STACK_FACETS if name in given]):
        raise LorafitError(
            f"--stack all compares the stacks as each runs; {options.BY_NAME[facets[0]].flag} is a switch of one "
            "stack's step: drop it, or name the stack (--stack NAME)"
        )
    request, asked, source, truncated = plan_request(
        given,
        compare=compare,
        data_path=data_path,
        from_config=from_config,
        device=device,
        skip_bad_rows=skip_bad_rows,
    )
    if compare:
        return PlanAnswer("compare", planner.compare(request), max_price_hour=asked.max_price_hour, source=source)
    target = card or target_gpu(asked.gpu, asked.vram)
    note = None
    kind: Literal["one", "embedded"] = "one"
    if target is None and asked.model is None and source is None:
        kind, cards = "embedded", [hardware.resolve(name) for name in EMBEDDED_GPUS]
    else:
        if target is None:
            target = hardware.resolve(EMBEDDED_GPUS[0])
            note = f"no GPU detected: planning for {target.name} (pass --gpu or --vram)"
        cards = [target]
    requests = [request.model_copy(update={"gpu": gpu}) for gpu in cards]
    plans = [planner.make_plan(one, truncated) for one in requests]
    if not every_stack:
        return PlanAnswer(kind, plans, note, source=source)
    rows = [planner.under_every_stack(*pair, truncated) for pair in zip(requests, plans, strict=True)]
    return PlanAnswer(kind, plans, note, source=source, stacks=rows)


# --- the run that carries a plan out --------------------------------------------------------------------------
def train_settings(plan: Plan) -> dict[str, Any]:
    """The settings `lorafit train` needs to run exactly this plan, in the order of the declaration: each one
    that `train` would otherwise choose itself (the planner's) and each that differs from its default."""
    chosen = plan.settings.model_dump(mode="json") | {"batch_size": plan.batch_size, "epochs": plan.epochs}
    return {
        o.name: chosen[o.name]
        for o in options.for_command("train")
        if o.name in chosen and (o.auto or chosen[o.name] != o.default)
    }


def train_command(plan: Plan, model_dir: str = "MODEL_DIR", data: str = "DATA.jsonl") -> str:
    """The `lorafit train` line that runs this plan (flags from the declaration; the model as a local folder)."""
    parts = ["lorafit", "train", "--model", model_dir, "--data", data]
    for name, value in train_settings(plan).items():
        option = options.BY_NAME[name]
        if option.is_bool:
            parts.append(option.flag if value else option.off_flag or "--no-" + option.flag.removeprefix("--"))
        else:
            parts += [option.flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return " ".join(parts)


def train_yaml(plan: Plan, model_dir: str = "MODEL_DIR", data: str = "DATA.jsonl") -> str:
    """The same run as a `lorafit train` config file."""
    return yaml.safe_dump({"model": model_dir, "data": data} | train_settings(plan), sort_keys=False)
