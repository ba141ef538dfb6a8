"""The `lorafit train` config: a YAML file in the spirit of Axolotl / LLaMA-Factory, and the same keys as flags.

Every key of `lorafit.schema.Settings` can be set here under its own name; a key left out (None) is filled
from `lorafit plan` for the detected device. Everything else (data, schedule, checkpoints) has a default.
A config may also be a plan (`lorafit plan --json > plan.json`): its settings are then all taken as given.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lorafit.data.formats import Format
from lorafit.errors import InvalidConfig
from lorafit.models import LoraTargets
from lorafit.schema import Attention, Method, Optimizer, Precision, Quant, Settings

Scheduler = Literal["cosine", "linear", "constant", "constant_with_warmup"]
Batching = Literal["auto", "length_grouped", "padding_free", "random"]

# Settings fields a single-process trainer does not take from a config: it runs on one device.
NOT_CONFIGURABLE = ("n_gpus", "shard", "method")
SETTINGS_KEYS = tuple(name for name in Settings.model_fields if name not in NOT_CONFIGURABLE)


class TrainConfig(BaseModel):
    """What `lorafit train` runs. Field names are the YAML keys and, with dashes, the flags."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # --- what to train on ---------------------------------------------------------------------------------
    model: str | None = Field(default=None, description="local Hugging Face model directory (safetensors)")
    data: str | None = Field(default=None, description="dataset file or directory: JSONL, JSON, CSV, Parquet, text")
    data_format: Format | None = Field(default=None, description="None: detected from the first records")
    data_mapping: dict[str, str] = Field(default_factory=dict, description="field -> column renames")
    eval_data: str | None = Field(default=None, description="held-out dataset; None: split off eval_split")
    eval_split: float = Field(default=0.05, ge=0, description="share of rows held out (<1) or a row count (>=1)")
    output_dir: str = "runs/lorafit"

    # --- method and Settings (None: from `lorafit plan` for the detected device) -------------------------
    method: Method = "qlora"
    precision: Precision | None = None
    quant: Quant | None = None
    double_quant: bool | None = None
    lora_r: int | None = Field(default=None, gt=0)
    lora_alpha: int | None = Field(default=None, gt=0)
    lora_dropout: float | None = Field(default=None, ge=0, lt=1)
    lora_targets: LoraTargets | None = None
    optimizer: Optimizer | None = None
    micro_batch: int | None = Field(default=None, gt=0)
    grad_accum: int | None = Field(default=None, gt=0)
    seq_len: int | None = Field(default=None, gt=0)
    grad_ckpt: bool | None = None
    attn: Attention | None = None
    batch_size: int = Field(default=16, gt=0, description="effective batch in sequences (micro_batch x grad_accum)")

    # --- schedule -----------------------------------------------------------------------------------------
    epochs: float = Field(default=1.0, gt=0)
    max_steps: int | None = Field(default=None, gt=0, description="optimizer steps; overrides epochs")
    learning_rate: float = Field(default=2e-4, gt=0)
    lr_scheduler: Scheduler = "cosine"
    warmup_ratio: float = Field(default=0.03, ge=0, lt=1)
    weight_decay: float = Field(default=0.0, ge=0)
    max_grad_norm: float = Field(default=1.0, ge=0)
    seed: int = 42

    # --- loss and batching --------------------------------------------------------------------------------
    train_on_prompt: bool = Field(default=False, description="False: loss on the answer tokens only")
    batching: Batching = "auto"

    # --- logging, evaluation, checkpoints -----------------------------------------------------------------
    logging_steps: int = Field(default=1, gt=0)
    eval_steps: int | None = Field(default=None, gt=0, description="None: at every checkpoint")
    save_steps: int = Field(default=50, gt=0)
    save_total_limit: int = Field(default=2, gt=0)

    # --- safety -------------------------------------------------------------------------------------------
    allow_pickle: bool = False
    trust_remote_code: bool = False
    headroom: float = Field(default=0.1, ge=0, lt=1, description="share of GPU memory kept free")

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.method == "qlora" and self.quant == "none":
            raise ValueError("qlora needs a quantised base (quant: nf4 or int8); for 16-bit weights use lora")
        if self.method != "qlora" and self.quant not in (None, "none"):
            raise ValueError(f"method {self.method} trains on 16-bit weights; quant must be none")
        if self.eval_data and self.eval_split:
            raise ValueError("give eval_data or eval_split, not both (set eval_split: 0)")
        if self.eval_split >= 1 and self.eval_split != int(self.eval_split):
            raise ValueError("eval_split is a share below 1 or a whole number of rows")
        return self

    def pinned_settings(self) -> dict[str, Any]:
        """The Settings fields this config fixes; the plan fills the others."""
        return {key: getattr(self, key) for key in SETTINGS_KEYS if getattr(self, key) is not None}

    def fingerprint(self) -> dict[str, Any]:
        """What makes two runs the same run: everything but where it writes and how often it reports."""
        ignored = {
            "output_dir",
            "logging_steps",
            "eval_steps",
            "save_steps",
            "save_total_limit",
            "allow_pickle",
            "trust_remote_code",
            "headroom",
        }
        return {key: value for key, value in self.model_dump(mode="json").items() if key not in ignored}


def load_config(path: Path | None, overrides: dict[str, Any]) -> TrainConfig:
    """A TrainConfig from a YAML/JSON file (a train config or a plan) with flag overrides on top."""
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_mapping(Path(path))
        if _is_plan(data):
            data = _plan_as_config(Path(path))
    merged = data | {key: value for key, value in overrides.items() if value is not None}
    return validate(merged, str(path) if path else "flags")


def validate(data: dict[str, Any], source: str) -> TrainConfig:
    """TrainConfig.model_validate with one line per problem, naming the key and guessing a misspelt one."""
    for key in data:
        if key not in TrainConfig.model_fields:
            close = difflib.get_close_matches(key, list(TrainConfig.model_fields), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else "; see `lorafit init` for every key"
            raise InvalidConfig(f"{source}: unknown key {key!r}{hint}")
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as error:
        problem = error.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        message = problem["msg"].removeprefix("Value error, ")
        raise InvalidConfig(f"{source}: {where + ': ' if where else ''}{message}") from None


def _read_mapping(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise InvalidConfig(f"no config file {path}; `lorafit init {path}` writes a starter config")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        reason = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise InvalidConfig(f"{path}{where}: not valid YAML ({reason})") from None
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidConfig(f"cannot read {path}: {error}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InvalidConfig(f"{path} must hold a mapping of keys to values (see `lorafit init`)")
    return data


def _is_plan(data: dict[str, Any]) -> bool:
    return "schema_version" in data and "settings" in data and "estimate" in data


def _plan_as_config(path: Path) -> dict[str, Any]:
    """A saved Plan as config keys: every setting pinned, the effective batch and epochs it planned for."""
    from lorafit.schema import Plan

    plan = Plan.load(path)
    settings = plan.settings.model_dump()
    return {"method": plan.settings.method, "batch_size": plan.target_batch, "epochs": plan.epochs} | {
        key: settings[key] for key in SETTINGS_KEYS
    }


# --- `lorafit init` -------------------------------------------------------------------------------------------
STARTER = """\
# lorafit train config. Run it with:  lorafit train {name}
# Every key can also be given as a flag (--output-dir, --lora-r, ...), which wins over the file.
# Settings left empty (~) are filled by `lorafit plan` for the GPU this machine has; the run prints them.

# --- what to train on -----------------------------------------------------------------------------------
model: ~                    # local Hugging Face model directory (config.json + *.safetensors)
data: ~                     # JSONL / JSON / CSV / Parquet / text: alpaca, sharegpt, messages, prompt-completion
data_format: ~              # ~ = detected; or alpaca | sharegpt | messages | prompt_completion | text
data_mapping: {{}}            # rename columns, e.g. {{instruction: question, output: answer}}
eval_data: ~                # a held-out file; ~ = split eval_split off the data
eval_split: 0.05            # share of rows held out for eval loss (a whole number = that many rows)
output_dir: runs/lorafit    # adapter, tokenizer, metrics.jsonl, loss.png, plan, checkpoints

# --- method and memory settings (~ = from the plan) -----------------------------------------------------
method: qlora               # qlora (4-bit base + LoRA) | lora (16-bit base + LoRA) | full
precision: ~                # bf16 | fp16 | fp32 (on the CPU lorafit trains in fp32 unless set)
quant: ~                    # nf4 | int8 for qlora; none otherwise
double_quant: ~             # quantise the 4-bit scales too (saves ~0.4 bit per weight)
lora_r: ~                   # adapter rank
lora_alpha: ~               # adapter scale (alpha / r multiplies the update)
lora_dropout: ~
lora_targets: ~             # all | attn | qv: which projections get adapters
optimizer: ~                # adamw | adamw_8bit | paged_adamw_8bit | paged_adamw_32bit | sgd
micro_batch: ~              # sequences per forward pass
grad_accum: ~               # micro-batches per optimizer step
seq_len: ~                  # longer rows are truncated; ~ = the longest row of the data
grad_ckpt: ~                # recompute activations in backward: less memory, ~30% more compute
attn: ~                     # sdpa | flash | eager
batch_size: 16              # effective batch in sequences; the plan splits it into micro_batch x grad_accum

# --- schedule -------------------------------------------------------------------------------------------
epochs: 1.0
max_steps: ~                # optimizer steps; overrides epochs
learning_rate: 0.0002
lr_scheduler: cosine        # cosine | linear | constant | constant_with_warmup
warmup_ratio: 0.03
weight_decay: 0.0
max_grad_norm: 1.0
seed: 42

# --- loss and batching ----------------------------------------------------------------------------------
train_on_prompt: false      # false = loss on the answer tokens only
batching: auto              # auto | length_grouped | padding_free | random (auto: padding_free with flash
                            # attention, else batches of similar length so padding wastes little compute)

# --- logging, evaluation, checkpoints -------------------------------------------------------------------
logging_steps: 1            # one line of metrics.jsonl per this many steps
eval_steps: ~               # ~ = evaluate at every checkpoint
save_steps: 50              # checkpoint every this many steps (atomic; rerun the command to resume)
save_total_limit: 2         # keep the newest this many checkpoints

# --- safety ---------------------------------------------------------------------------------------------
allow_pickle: false         # load .bin (pickle) weights, which can run code
trust_remote_code: false    # run a model's own Python code
headroom: 0.1               # share of GPU memory the plan keeps free
"""


def starter_config(name: str) -> str:
    return STARTER.format(name=name)


def write_starter(path: Path, force: bool = False) -> None:
    """Write a commented starter config; never over an existing file unless `force`."""
    if path.exists() and not force:
        raise InvalidConfig(f"{path} already exists; pass --force to replace it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(starter_config(path.name))
    except OSError as error:
        raise InvalidConfig(f"cannot write {path}: {error.strerror or error}") from None
