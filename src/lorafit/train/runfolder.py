"""The run folder: one run at a time in it, what the run writes there before step 1, and the files it leaves.

`checkpoints` decides which run a folder holds (`checkpoints.begin`) and writes its checkpoints; this module is
the rest of the folder's life: the identity of a run (`fingerprint`), the files that let it
resume or be reproduced (plan.json, plan.yaml, config.yaml, lorafit-run.json) and the adapter's pointer to its
base. Pure Python: no torch here.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import yaml

from lorafit.files import write_atomic
from lorafit.schema import Plan
from lorafit.train import checkpoints
from lorafit.train.config import SETTINGS_KEYS, TrainConfig
from lorafit.train.distributed import LAUNCH_KEYS

METRICS = "metrics.jsonl"


# --- which run: what makes two runs the same ------------------------------------------------------------------
def fingerprint(config: TrainConfig, model_dir: Path, data_path: Path, eval_path: Path | None) -> dict[str, Any]:
    """What the same run has the same of: its config (but where it was launched from), model and data."""
    data_files = [data_path] + ([eval_path] if eval_path else [])
    same_run = {key: value for key, value in config.fingerprint().items() if key not in LAUNCH_KEYS}
    return same_run | {"model": str(model_dir), "data_sha256": checkpoints.data_digest(data_files)}


def reads(model_dir: Path, data_path: Path, eval_path: Path | None, *, built: bool) -> tuple[Path, ...]:
    """What the run reads, which --overwrite must never delete (the demo's base is rebuilt, so not that)."""
    return tuple(path for path in (data_path, eval_path, None if built else model_dir) if path is not None)


# --- before step 1 ----------------------------------------------------------------------------------------------
def start_fresh(output_dir: Path, fingerprint: dict[str, Any]) -> None:
    """The folder of a fresh run: made, no metrics of an earlier start, and the run file that claims it."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / METRICS).unlink(missing_ok=True)
    checkpoints.write_run_file(output_dir, {"fingerprint": fingerprint, "status": "started"})


def record_base(output_dir: Path, model_dir: Path) -> None:
    """What the adapter is trained against: `lorafit export` refuses another base."""
    saved = checkpoints.read_run_file(output_dir) or {}
    checkpoints.write_run_file(output_dir, saved | {"base_digest": checkpoints.model_digest(model_dir)})


def record_eval_before(output_dir: Path, eval_before: float) -> None:
    """The eval loss before step 1, which a resumed run reports as its own "before"."""
    saved = checkpoints.read_run_file(output_dir) or {}
    checkpoints.write_run_file(output_dir, saved | {"eval_before": eval_before})


def saved_plan(output_dir: Path) -> Plan | None:
    path = output_dir / "plan.json"
    return Plan.load(path) if path.is_file() else None


def save_plan(output_dir: Path, plan: Plan) -> None:
    write_atomic(output_dir / "plan.json", plan.to_json())
    write_atomic(output_dir / "plan.yaml", plan.to_yaml())


def resolved_config(config: TrainConfig, plan: Plan) -> TrainConfig:
    """The config with every setting filled in from the plan: rerunning it needs no planning."""
    settings = plan.settings.model_dump()
    return config.model_copy(update={key: settings[key] for key in SETTINGS_KEYS} | {"batch_size": plan.batch_size})


def save_run(
    output_dir: Path,
    config: TrainConfig,
    plan: Plan,
    fingerprint: dict[str, Any],
    saved: dict[str, Any] | None,
    status: str,
    **extra: Any,
) -> None:
    """plan.json, plan.yaml, the resolved config.yaml and the run file with `status`: what resumes or reproduces
    the run. The eval loss before training and the base's digest, once recorded, are kept."""
    save_plan(output_dir, plan)
    resolved = resolved_config(config, plan).model_dump(mode="json")
    write_atomic(output_dir / "config.yaml", yaml.safe_dump(resolved, sort_keys=False))
    current = checkpoints.read_run_file(output_dir) or saved or {}
    kept = {key: value for key, value in current.items() if key in ("eval_before", "base_digest")}
    checkpoints.write_run_file(output_dir, kept | {"fingerprint": fingerprint, "status": status} | extra)


# --- after the last step ------------------------------------------------------------------------------------------
def drop_empty_staging(output_dir: Path) -> None:
    with contextlib.suppress(OSError):
        checkpoints.staging_root(output_dir).rmdir()  # empty once every checkpoint is published


def point_adapter_at(output_dir: Path, model_dir: Path) -> None:
    """adapter_config.json names the base by absolute path, so PeftModel.from_pretrained finds it anywhere."""
    path = output_dir / "adapter_config.json"
    data = json.loads(path.read_text())
    data["base_model_name_or_path"] = str(model_dir)
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True))
