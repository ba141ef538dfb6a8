"""The values that flow through lorafit: Settings -> Estimate -> Plan. Frozen, and JSON/YAML round-trip exactly.

`lorafit plan --json` prints a Plan, `lorafit train plan.yaml` reads one, and every run saves the Plan it used.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    ConfigDict,
    Field,
    SkipValidation,
    ValidationError,
    computed_field,
    field_serializer,
    field_validator,
)

from lorafit import options, safeload
from lorafit.errors import InvalidConfig
from lorafit.hardware import GpuSpec
from lorafit.models import ModelSpec
from lorafit.options import (  # noqa: F401 (the step's settings and their choices are part of the schema)
    Attention,
    Batching,
    Frozen,
    Method,
    Optimizer,
    Precision,
    Quant,
    Settings,
    Shard,
    default_quant,
    one_line,
)
from lorafit.serving import Serving

SCHEMA_VERSION = 2  # 2: `batch_size` (was `target_batch`), `batching` and `device` recorded


Device = Literal["cuda", "cpu"]


class TokenProfile(Frozen):
    """What a dataset looks like in tokens: the longest sequence sets the peak, the total sets the time."""

    source: str
    rows: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    mean: float = Field(ge=0)
    p50: float = Field(ge=0)
    p95: float = Field(ge=0)
    p99: float = Field(ge=0)
    max: int = Field(ge=0)
    tokenizer: str | None = Field(default=None, description="None: estimated from characters")
    estimate_error: float | None = Field(default=None, description="relative error of a character estimate")
    answer_token_share: float | None = None
    basis: str | None = Field(default=None, description="where the counts come from, in words")


class Estimate(Frozen):
    """Peak memory of one training step, in the three figures people measure."""

    peak_allocated_gib: float = Field(description="torch.cuda.max_memory_allocated")
    peak_reserved_gib: float = Field(description="torch.cuda.max_memory_reserved")
    peak_device_gib: float = Field(description="what nvidia-smi shows: reserved + CUDA context")
    breakdown_gib: dict[str, float]
    peak_phase: str
    gpu_memory_gib: float | None = None
    headroom: float = options.DEFAULT_HEADROOM
    fits: bool | None = None
    trainable_params: int
    total_params: int
    world_size: int = Field(default=1, description="GPUs of the run, n_gpus x nodes; every figure above is per GPU")
    per_gpu_gib: dict[str, float] = Field(
        default_factory=dict,
        description="one GPU's sharded weights, gradients, optimizer states, gathered layers, activations and "
        "communication buffers",
    )
    host_ram_gib: float | None = Field(
        default=None, description="host RAM one machine needs: the larger of its loading and training peaks"
    )
    host_ram_breakdown_gib: dict[str, float] = Field(default_factory=dict)
    loading_peak_gib: float | None = Field(
        default=None,
        description="one GPU while a 4/8-bit base is loaded whole before ZeRO-3/FSDP shard it (with the CUDA "
        "context); None where loading needs no more than the step; `fits` counts it",
    )


class TrainerFit(Frozen):
    """The plan's step under another trainer: what the same settings need there (the savers it lacks off)."""

    stack: options.Stack
    peak_device_gib: float
    fits: bool | None


# A fit is tight when even the leanest step the planner knows for the job (micro-batch 1, checkpointing, every
# saver the trainer has) leaves less free than the memory model's median error on the published runs it was never
# fitted to (5.1 %: `make bench-memory`, its check rows, 2026-12): an error of that size runs out of memory, and
# there is nothing leaner to fall back to. A fast step that fills the card is not tight: the headroom covers it.
TIGHT_SHARE = 0.051


def is_tight(fits: bool | None, leanest_peak_gib: float, gpu: GpuSpec, headroom: float) -> bool:
    usable = gpu.usable_gib(headroom)
    return bool(fits) and usable - leanest_peak_gib < TIGHT_SHARE * usable


class PlanRequest(Frozen):
    """What the user asked `lorafit plan` (or `lorafit train`, for the settings it leaves out): the step settings
    the user fixed, as one Settings whose `model_fields_set` names them (the planner chooses the others), and the
    settings of the whole job, each taking its type, bounds and default from the declaration (`lorafit.options`)."""

    model: ModelSpec
    gpu: GpuSpec | None = None
    tokens: TokenProfile | None = None
    device: Device | None = Field(default=None, description="where `train` runs; None: planning")
    # each fixed value is checked by Settings.given; the rules between them are the plan's, which completes the step
    fixed: SkipValidation[Settings] = Field(
        default_factory=lambda: Settings.given({}), description="the step settings the user fixed (a mapping is read)"
    )
    host_ram_gib: float | None = Field(
        default=None, description="host RAM free for the offloading savers (train); None: not checked"
    )
    batch_size: int | None = options.declared("batch_size")
    tokens_per_epoch: int | None = options.declared("tokens_per_epoch")
    epochs: float = options.declared("epochs")
    headroom: float = options.declared("headroom")
    kwh_price: float = options.declared("kwh_price")
    rent_price: float | None = options.declared("rent_price")
    batching: Batching = options.declared("batching")
    serve_context: int = options.declared("serve_context")

    @field_validator("fixed", mode="before")
    @classmethod
    def _given(cls, value: Any) -> Settings:
        if isinstance(value, Settings):
            return value
        if isinstance(value, Mapping):
            return Settings.given(value)
        raise ValueError("fixed: the step settings, as Settings or a mapping of their names to values")

    @field_serializer("fixed")
    def _only_the_fixed(self, fixed: Settings) -> dict[str, Any]:
        return fixed.model_dump(mode="json", exclude_unset=True)

    @property
    def given(self) -> dict[str, Any]:
        """The fixed step settings by name."""
        return {
            name: getattr(self.fixed, name) for name in Settings.model_fields if name in self.fixed.model_fields_set
        }

    def fixing(self, **values: Any) -> PlanRequest:
        """This request with `values` fixed too."""
        return self.model_copy(update={"fixed": Settings.given(self.given | values)})

    # The planner's view: the method, length and GPU count it plans at, and the other fixed settings
    @property
    def method(self) -> Method:
        return self.fixed.method

    @property
    def seq_len(self) -> int | None:
        return self.fixed.seq_len if "seq_len" in self.fixed.model_fields_set else None

    @property
    def n_gpus(self) -> int:
        return self.fixed.n_gpus

    @property
    def pinned(self) -> dict[str, Any]:
        return {name: value for name, value in self.given.items() if name not in ("method", "seq_len", "n_gpus")}

    @property
    def effective_batch(self) -> int:
        return options.batch_size_of(self.pinned | {"batch_size": self.batch_size, "n_gpus": self.n_gpus})


# The settings of the whole job a request holds as its own fields (the step's are in `fixed`).
PLAN_REQUEST_KEYS = tuple(
    name for name in PlanRequest.model_fields if name in options.BY_NAME.keys() - {"model", "gpu"}
)


class Suggestion(Frozen):
    """The smallest change that makes a plan that did not fit, fit."""

    change: str
    settings: Settings
    gpu: str | None = None
    estimate: Estimate
    # where the change is more or other GPUs: how many of them, how they share the model, and the time it takes
    n_gpus: int = 1
    nodes: int = 1
    shard: str = "none"
    offload: str = "none"
    tokens_per_s: float | None = None
    hours: float | None = None


class Plan(Frozen):
    """The whole answer: will it fit, with which settings, how long, at what cost. Only concrete values."""

    model_config = ConfigDict(frozen=True, extra="ignore")  # ignore the flattened copies written by to_json

    schema_version: int = SCHEMA_VERSION
    model: ModelSpec
    gpu: GpuSpec | None
    settings: Settings
    estimate: Estimate
    batch_size: int
    epochs: float
    batching: Batching | None = Field(default=None, description="how `train` batches rows; None: not resolved")
    device: Device | None = Field(default=None, description="where `train` ran; None: planning")
    tokens: TokenProfile | None = None
    truncated_rows: int | None = None
    tokens_per_s: float
    hours: float
    hours_range: tuple[float, float] | None = Field(
        default=None,
        description="the likely hours, low to high: the time model's error on the published runs of this kind of "
        "GPU (check rows of `make bench-throughput`), or the spread of the measured steps",
    )
    time_basis: Literal["model", "measured"] = Field(
        default="model", description="model: the time model's tokens/s; measured: steps timed on the device"
    )
    tokens_per_epoch: int = Field(default=0, description="the tokens one epoch trains, what the hours are for")
    cost_cloud_usd: float | None
    cost_local_usd: float | None
    kwh_price: float
    break_even_runs: float | None = None
    reasons: list[str] = []
    suggestions: list[Suggestion] = []
    serving: Serving | None = Field(default=None, description="memory to run the merged model in each format")
    leanest_peak_gib: float | None = Field(
        default=None, description="device peak of the leanest step the planner tried for the job (a tight fit)"
    )
    trainers: list[TrainerFit] = Field(
        default_factory=list, description="the same step under each other offered trainer that runs it"
    )

    @property
    def run_tokens(self) -> float:
        """The tokens the whole run trains: epochs x tokens per epoch, or for a plan saved before
        tokens_per_epoch was recorded, what its hours at its speed come to."""
        if self.tokens_per_epoch:
            return self.tokens_per_epoch * self.epochs
        return self.hours * 3600 * self.tokens_per_s

    # The flat view `lorafit plan --json` promises; derived from `settings`, ignored when read back.
    @computed_field
    @property
    def fits(self) -> bool:
        return bool(self.estimate.fits) if self.estimate.fits is not None else True

    @computed_field
    @property
    def verdict(self) -> Literal["fits", "tight", "no"] | None:
        """fits; tight (even the leanest step leaves less than TIGHT_SHARE of the usable memory); no; None without
        a GPU."""
        if self.gpu is None or self.estimate.fits is None:
            return None
        if not self.estimate.fits:
            return "no"
        leanest = self.leanest_peak_gib if self.leanest_peak_gib is not None else self.estimate.peak_device_gib
        return "tight" if is_tight(True, leanest, self.gpu, self.estimate.headroom) else "fits"

    @computed_field
    @property
    def method(self) -> Method:
        return self.settings.method

    @computed_field
    @property
    def quant(self) -> Quant:
        return self.settings.quant or default_quant(self.settings.method)  # (always set once validated)

    @computed_field
    @property
    def micro_batch(self) -> int:
        return self.settings.micro_batch

    @computed_field
    @property
    def grad_accum(self) -> int:
        return self.settings.grad_accum

    @computed_field
    @property
    def grad_ckpt(self) -> bool:
        return self.settings.grad_ckpt

    @computed_field
    @property
    def seq_len(self) -> int:
        return self.settings.seq_len

    @computed_field
    @property
    def optimizer(self) -> Optimizer:
        return self.settings.optimizer

    # --- files ----------------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def save(self, folder: Path) -> None:
        """Write plan.json and plan.yaml into a run folder."""
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "plan.json").write_text(self.to_json())
        (folder / "plan.yaml").write_text(self.to_yaml())

    @classmethod
    def load(cls, path: Path) -> Plan:
        try:
            text = Path(path).read_text()
            data = safeload.load_json(text) if str(path).endswith(".json") else safeload.load_yaml(text)
        except (OSError, ValueError, yaml.YAMLError) as error:
            raise InvalidConfig(f"cannot read plan {path}: {error}") from None
        if not isinstance(data, dict):
            raise InvalidConfig(f"{path} does not hold a plan (expected a mapping)")
        if data.get("schema_version") == 1:  # a run saved before batch_size was one setting
            data = data | {"schema_version": SCHEMA_VERSION, "batch_size": data.pop("target_batch", 16)}
        if data.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
            raise InvalidConfig(f"{path} has plan schema {data['schema_version']}; this lorafit reads {SCHEMA_VERSION}")
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            raise InvalidConfig(f"{path}: {one_line(error)}") from None
