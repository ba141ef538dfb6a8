"""The values that flow through lorafit: Settings -> Estimate -> Plan. Frozen, and JSON/YAML round-trip exactly.

`lorafit plan --json` prints a Plan, `lorafit train plan.yaml` reads one, and every run saves the Plan it used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, computed_field, model_validator

from lorafit.errors import InvalidConfig
from lorafit.hardware import GpuSpec
from lorafit.models import LoraTargets, ModelSpec

SCHEMA_VERSION = 1

Method = Literal["full", "lora", "qlora"]
Precision = Literal["bf16", "fp16", "fp32"]
Quant = Literal["none", "int8", "nf4"]
Optimizer = Literal["adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "sgd"]
Attention = Literal["sdpa", "flash", "eager"]
Shard = Literal["none", "ddp", "zero2", "zero3", "fsdp"]


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Settings(Frozen):
    """Every knob of one training step. memory.estimate() and the trainer read the same object."""

    method: Method = "qlora"
    precision: Precision = "bf16"
    quant: Quant = Field(default="nf4", description="base-weight quantisation; qlora needs int8 or nf4")
    double_quant: bool = True
    lora_r: int = Field(default=16, gt=0)
    lora_alpha: int = Field(default=32, gt=0)
    lora_dropout: float = Field(default=0.05, ge=0, lt=1)
    lora_targets: LoraTargets = "all"
    optimizer: Optimizer = "adamw"
    micro_batch: int = Field(default=1, gt=0)
    grad_accum: int = Field(default=1, gt=0)
    seq_len: int = Field(default=2048, gt=0)
    grad_ckpt: bool = True
    attn: Attention = "sdpa"
    n_gpus: int = Field(default=1, gt=0)
    shard: Shard = "none"

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.method == "qlora" and self.quant == "none":
            raise ValueError("qlora needs a quantised base (--quant nf4 or int8); for 16-bit weights use lora")
        if self.method == "full" and self.quant != "none":
            raise ValueError("full fine-tuning trains every weight and cannot use a quantised base (--quant none)")
        if self.n_gpus == 1 and self.shard != "none":
            raise ValueError(f"--shard {self.shard} needs --n-gpus > 1")
        return self

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.n_gpus

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch * self.seq_len


def default_quant(method: Method) -> Quant:
    return "nf4" if method == "qlora" else "none"


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


class Estimate(Frozen):
    """Peak memory of one training step, in the three figures people measure."""

    peak_allocated_gib: float = Field(description="torch.cuda.max_memory_allocated")
    peak_reserved_gib: float = Field(description="torch.cuda.max_memory_reserved")
    peak_device_gib: float = Field(description="what nvidia-smi shows: reserved + CUDA context")
    breakdown_gib: dict[str, float]
    peak_phase: str
    gpu_memory_gib: float | None = None
    headroom: float = 0.1
    fits: bool | None = None
    trainable_params: int
    total_params: int


class PlanRequest(Frozen):
    """What the user asked `lorafit plan` (or `lorafit train`, for the settings it leaves out)."""

    model: ModelSpec
    gpu: GpuSpec | None = None
    n_gpus: int = Field(default=1, gt=0)
    method: Method = "qlora"
    seq_len: int | None = Field(default=None, gt=0, description="None: the data's longest row, else 2048")
    target_batch: int = Field(default=16, gt=0, description="effective batch in sequences")
    tokens: TokenProfile | None = None
    tokens_per_epoch: int | None = Field(default=None, gt=0)
    epochs: float = Field(default=3.0, gt=0)
    headroom: float = Field(default=0.1, ge=0, lt=1)
    kwh_price: float = Field(default=0.30, ge=0, description="local electricity, USD per kWh")
    pinned: dict[str, Any] = Field(default_factory=dict, description="Settings fields the user fixed")


class Suggestion(Frozen):
    """The smallest change that makes a plan that did not fit, fit."""

    change: str
    settings: Settings
    gpu: str | None = None
    estimate: Estimate


class Plan(Frozen):
    """The whole answer: will it fit, with which settings, how long, at what cost. Only concrete values."""

    model_config = ConfigDict(frozen=True, extra="ignore")  # ignore the flattened copies written by to_json

    schema_version: int = SCHEMA_VERSION
    model: ModelSpec
    gpu: GpuSpec | None
    settings: Settings
    estimate: Estimate
    target_batch: int
    epochs: float
    tokens: TokenProfile | None = None
    truncated_rows: int | None = None
    tokens_per_s: float
    hours: float
    cost_cloud_usd: float | None
    cost_local_usd: float | None
    kwh_price: float
    break_even_runs: float | None = None
    reasons: list[str] = []
    suggestions: list[Suggestion] = []

    # The flat view `lorafit plan --json` promises; derived from `settings`, ignored when read back.
    @computed_field
    @property
    def fits(self) -> bool:
        return bool(self.estimate.fits) if self.estimate.fits is not None else True

    @computed_field
    @property
    def method(self) -> Method:
        return self.settings.method

    @computed_field
    @property
    def quant(self) -> Quant:
        return self.settings.quant

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
            data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
        except (OSError, ValueError, yaml.YAMLError) as error:
            raise InvalidConfig(f"cannot read plan {path}: {error}") from None
        if not isinstance(data, dict):
            raise InvalidConfig(f"{path} does not hold a plan (expected a mapping)")
        if data.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
            raise InvalidConfig(f"{path} has plan schema {data['schema_version']}; this lorafit reads {SCHEMA_VERSION}")
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            raise InvalidConfig(f"{path}: {one_line(error)}") from None


def one_line(error: ValidationError) -> str:
    """The first problem of a pydantic error, as 'field.path: message'."""
    problem = error.errors()[0]
    where = ".".join(str(part) for part in problem["loc"]) or "value"
    return f"{where}: {problem['msg']}"
