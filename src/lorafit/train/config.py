"""The `lorafit train` config: a YAML file in the spirit of Axolotl / LLaMA-Factory, and the same keys as flags.

Its keys, types, defaults and rules are the train options of `lorafit.options` (`TrainConfig`); this module reads
the file, lays flags over it and writes the starter. A step setting left out (None) is filled from `lorafit plan`
for the detected device. A config may also be a plan (`lorafit plan --json > plan.json`): its settings are then
all taken as given.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from lorafit import options, safeload
from lorafit.errors import InvalidConfig
from lorafit.files import target_problem, write_atomic
from lorafit.options import TrainConfig

# The Settings fields a train config can fix (the single-device trainer has no n_gpus or shard).
SETTINGS_KEYS = tuple(key for key in options.STEP_KEYS if key in TrainConfig.model_fields)


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
    """TrainConfig from a mapping, with one line per problem naming the key (and the file it came from)."""
    return options.validate("train", data, source, from_flags)


def _read_mapping(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise InvalidConfig(f"no config file {path}; `lorafit init {path}` writes a starter config")
    try:
        data = safeload.load_yaml(path.read_text())
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
