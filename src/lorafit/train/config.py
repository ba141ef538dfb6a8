"""The `lorafit train` config: a YAML file in the spirit of Axolotl / LLaMA-Factory, and the same keys as flags.

Its keys, types, defaults and rules are the train options of `lorafit.options` (`TrainConfig`); this module reads
the file, lays flags over it and writes the starter. A step setting left out (None) is filled from `lorafit plan`
for the detected device. A config may also be a plan (`lorafit plan --json > plan.json`): its settings are then
all taken as given.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from lorafit import options, safeload
from lorafit.errors import InvalidConfig
from lorafit.files import target_problem, write_atomic
from lorafit.options import TrainConfig
from lorafit.schema import Plan

# The Settings fields a train config can fix (the single-device trainer has no n_gpus or shard).
SETTINGS_KEYS = tuple(key for key in options.STEP_KEYS if key in TrainConfig.model_fields)
# The keys that name files or folders.
PATH_KEYS = ("model", "data", "eval_data", "output_dir")
# The first line of the config.yaml a run folder keeps: its paths are relative to that folder, so that a shared
# run folder names no absolute path of the machine it was trained on and still reruns from anywhere.
RUN_FOLDER_CONFIG = "# lorafit run config: paths are relative to this folder"


def portable_yaml(config: TrainConfig, folder: Path) -> str:
    """The config as the run folder keeps it: every path relative to `folder` (see RUN_FOLDER_CONFIG)."""
    data = config.model_dump(mode="json")
    for key in PATH_KEYS:
        if data.get(key) is not None:
            data[key] = os.path.relpath(Path(data[key]).absolute(), Path(folder).absolute())
    return f"{RUN_FOLDER_CONFIG}\n" + yaml.safe_dump(data, sort_keys=False)


def run_config(folder: Path) -> dict[str, Any]:
    """The config.yaml a run folder keeps, its paths made paths from here (for export, which reads its data)."""
    return _read_mapping(Path(folder) / "config.yaml")


def _anchored(data: dict[str, Any], path: Path, text: str) -> dict[str, Any]:
    """A run folder's config names its paths relative to its folder: make them paths from here."""
    if not text.startswith(RUN_FOLDER_CONFIG):
        return data
    folder = path.parent
    return data | {
        key: os.path.normpath(folder / value)
        for key in PATH_KEYS
        if isinstance(value := data.get(key), str) and not os.path.isabs(value)
    }


def load_config(path: Path | None, overrides: dict[str, Any]) -> TrainConfig:
    """A TrainConfig from a YAML/JSON file (a train config or a plan) with flag overrides on top."""
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_mapping(Path(path))
        if _is_plan(data):
            data = _plan_as_config(Path(path))
    flags = {key: value for key, value in overrides.items() if value is not None}
    return validate(data | flags, str(path) if path else "", from_flags=flags)


def validate(data: dict[str, Any], source: str = "", from_flags: Iterable[str] = ()) -> TrainConfig:
    """TrainConfig from a mapping, with one line per problem naming the key (and the file it came from).
    An eval file alone replaces the held-out share, whose default (0.05) is not a choice of the user's:
    only eval_data and eval_split both given are two sources of eval rows."""
    if data.get("eval_data") is not None and data.get("eval_split") is None:
        data = data | {"eval_split": 0}
    return options.validate("train", data, source, from_flags)


def check_batch_fits(config: TrainConfig, rows: int) -> None:
    """Refuse an effective batch the user set larger than the training rows: each epoch would be one step over
    a partial batch. The largest batch that works keeps micro_batch (when set) and the GPUs' shares whole."""
    if config.batch_size is None and (config.micro_batch is None or config.grad_accum is None):
        return  # the planner's batch: not the user's choice
    batch = config.effective_batch_size
    if batch <= rows:
        return
    unit = (config.micro_batch or 1) * (config.n_gpus or 1) * (config.nodes or 1)
    largest = rows // unit * unit
    fix = f"use batch_size {largest} or less" if largest else f"use a smaller micro_batch (now {config.micro_batch})"
    raise InvalidConfig(
        f"batch_size {batch} is more than the {rows} training rows: each epoch would be one step over a partial "
        f"batch; {fix}, or more data"
    )


def _read_mapping(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise InvalidConfig(_folder_advice(path))
    if not path.is_file():
        raise InvalidConfig(f"no config file {path}; `lorafit init {path}` writes a starter config")
    try:
        text = path.read_text()
        data = safeload.load_yaml(text)
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
    return _anchored(data, path, text)


def _folder_advice(path: Path) -> str:
    """What a folder given where a config file goes most likely is, and the command that takes it."""
    if (path / "config.yaml").is_file():
        return f"{path} is a folder, not a config file; to train its run again pass {path / 'config.yaml'}"
    if (path / "config.json").is_file():
        return f"{path} is a folder, not a config file; to train this model pass --model {path}"
    return f"{path} is a folder, not a config file; `lorafit init {path / 'lorafit.yaml'}` writes a starter config"


def _is_plan(data: dict[str, Any]) -> bool:
    return "schema_version" in data and "settings" in data and "estimate" in data


def _plan_as_config(path: Path) -> dict[str, Any]:
    """A saved Plan as config keys: every setting pinned, the effective batch and epochs it planned for."""
    plan = Plan.load(path)
    settings = plan.settings.model_dump()
    return {"batch_size": plan.batch_size, "epochs": plan.epochs} | {key: settings[key] for key in SETTINGS_KEYS}


# --- `lorafit init` -------------------------------------------------------------------------------------------
def starter_config(name: str) -> str:
    return options.starter_yaml(name)


def write_starter(path: Path, force: bool = False) -> None:
    """Write a commented starter config; never over an existing file unless `force`, and never over a symlink,
    device, pipe or socket, even with it."""
    problem = target_problem(path)
    if problem:
        raise InvalidConfig(f"{path} {problem}")
    if path.exists() and not force:
        raise InvalidConfig(f"{path} already exists; pass --force to replace it")
    try:
        write_atomic(path, starter_config(path.name))
    except OSError as error:
        raise InvalidConfig(f"cannot write {path}: {error.strerror or error}") from None
