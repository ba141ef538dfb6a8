"""Read another trainer's config file (`lorafit plan --from FILE`) into lorafit's own settings.

People who train with axolotl, LLaMA-Factory, TRL, torchtune or litgpt ask "does my config fit?". Each reader
(a module per tool; what they share is lorafit.configs.reading, how a file's kind is told lorafit.configs.kinds)
maps the keys of one tool that change a step's memory onto lorafit's options (`lorafit.options`): what
lorafit models becomes a value, what it does not model becomes one line of `unmodelled`, and every other key
is ignored. The kind of file is told from its keys, never from its name.

`values` holds what the file states. Where leaving a key out means something else in that tool than in lorafit
and changes memory (LLaMA-Factory's LoRA rank 8, axolotl's sequence_len 512, ...), the tool's default is put in
too, with the source it comes from. The code paths of each tool (what its step keeps alive) are its stack's, in
catalog/stacks.toml, and are not repeated here; only the facets a file switches (autocast, fused AdamW) are.
A key this module reads must have the shape its tool gives it (a switch true or false, a section a mapping, a
number not a boolean), else it is refused in one line naming it, never read as on, off or a default; the values
mapped are checked by the caller with `options.validate`. The file is parsed with bounds (`safeload`). Pure Python.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lorafit import options, safeload
from lorafit.configs.axolotl import read_axolotl
from lorafit.configs.kinds import KIND_TITLES, STACK_OF_KIND, detect, mixed_evidence
from lorafit.configs.litgpt import read_litgpt
from lorafit.configs.llama_factory import read_llama_factory
from lorafit.configs.reading import Reading, Unmappable, number_checked, shown_value
from lorafit.configs.torchtune import read_torchtune
from lorafit.configs.trl import read_trl
from lorafit.errors import InvalidConfig


@dataclass(frozen=True)
class Imported:
    """A config file of another tool in lorafit's terms: what it sets, and what it sets that lorafit cannot."""

    kind: str  # one of KIND_TITLES
    values: dict[str, Any]  # lorafit option name -> value; `stack` always, `model` when the file names one
    unmodelled: list[str]  # "KEY: VALUE (why)", one per key that changes memory in a way lorafit does not model


def read(path: Path) -> Imported:
    """Read a training config of any kind in KIND_TITLES. Raises InvalidConfig, one line naming the file, when
    the file cannot be read or parsed, its kind cannot be told, or a value has no lorafit counterpart."""
    path = Path(path)
    config = _load(path)
    kind = detect(config)
    if kind is None and (mixed := mixed_evidence(config)):
        raise InvalidConfig(
            f"{path}: cannot tell which trainer this config is for: it has lorafit's keys and {mixed}; "
            "a lorafit config holds lorafit's keys only (see `lorafit init`)"
        )
    if kind is None:
        understood = ", ".join(KIND_TITLES.values())
        raise InvalidConfig(
            f"{path}: cannot tell which trainer this config is for (none of the keys lorafit looks for); "
            f"lorafit reads {understood} configs"
        )
    reading = Reading(config)
    try:
        READERS[kind](reading)
    except Unmappable as problem:
        raise InvalidConfig(_one_line(f"{path}: {problem}")) from None
    values = {"stack": STACK_OF_KIND[kind]} | reading.values
    return Imported(kind=kind, values=values, unmodelled=reading.unmodelled)


# --- reading the file -----------------------------------------------------------------------------------------
def _load(path: Path) -> dict[str, Any]:
    """The top-level mapping of a YAML or JSON file: JSON when it starts with a brace, as every JSON config does,
    else YAML, whatever the file is called."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise InvalidConfig(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InvalidConfig(f"{path} is a directory, not a config file") from None
    except UnicodeDecodeError:
        raise InvalidConfig(f"{path} is not a text file (not UTF-8)") from None
    except OSError as error:
        raise InvalidConfig(f"{path}: cannot be read ({error.strerror or error})") from None
    if text.lstrip().startswith(("{", "[")):
        try:
            config = safeload.load_json(text)
        except json.JSONDecodeError as error:
            raise InvalidConfig(f"{path} is not valid JSON (line {error.lineno}: {error.msg})") from None
        except ValueError as error:  # past a bound: too deep, a number too long
            raise InvalidConfig(f"{path} cannot be read as settings ({error})") from None
    else:
        try:
            config = safeload.load_yaml(text)
        except safeload.Refused as error:
            raise InvalidConfig(f"{path} cannot be read as settings ({error})") from None
        except yaml.YAMLError as error:
            raise InvalidConfig(_one_line(f"{path} is not valid YAML ({_yaml_problem(error)})")) from None
    if not isinstance(config, dict):
        found = "nothing" if config is None else f"a {type(config).__name__}"
        raise InvalidConfig(f"{path} must hold a mapping of settings at the top level, not {found}")
    if names := [key for key in config if not isinstance(key, str)]:
        raise InvalidConfig(f"{path}: the key {shown_value(names[0])} is not a setting's name")
    return config


def _yaml_problem(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    return f"line {mark.line + 1}: {problem}" if mark is not None else problem


def _one_line(text: str) -> str:
    return " ".join(text.split())


# --- lorafit ---------------------------------------------------------------------------------------------------
def read_lorafit(reading: Reading) -> None:
    """lorafit's own train YAML: its keys are already lorafit's names (the caller validates the values). A key
    that is none of them is refused here, as `lorafit train` refuses it, rather than left out by the command."""
    known = [option.name for option in options.OPTIONS if option.config]
    for key, value in reading.config.items():
        if key not in known:
            raise Unmappable(options.unknown_key(key, known))
        reading.values[key] = number_checked(key, key, value)


READERS: dict[str, Callable[[Reading], None]] = {
    "axolotl": read_axolotl,
    "llama-factory": read_llama_factory,
    "trl": read_trl,
    "torchtune": read_torchtune,
    "litgpt": read_litgpt,
    "lorafit": read_lorafit,
}
