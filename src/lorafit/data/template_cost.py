"""What a family's chat template adds to a conversation, in tokens (catalog/chat_templates.toml), and how far the
estimate built on it was measured to be from the real tokenizer (catalog/token_accuracy.toml, written by
`make bench-tokens`). Data only: the estimate itself is data/tokens.py's TemplateEstimate."""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass
from fnmatch import fnmatchcase
from importlib import resources
from typing import Any

from lorafit.errors import DataError


@dataclass(frozen=True)
class TemplateCost:
    """One family's chat template, in tokens: see the header of catalog/chat_templates.toml."""

    name: str
    template: str  # the checkpoint whose template this is
    models: tuple[str, ...]
    fixed_tokens: int
    tokens_per_message: int
    default_system_tokens: int
    template_file: str  # in llama.cpp's models/ folder, for the bench ("" none)
    vocab: str  # llama.cpp's vocab-only GGUF of the family, for the bench ("" none)

    def tokens(self, roles: list[str]) -> int:
        """The template's own tokens around messages of these roles (their text not included)."""
        system = bool(roles) and roles[0] == "system"
        return self.fixed_tokens + self.tokens_per_message * len(roles) + (0 if system else self.default_system_tokens)

    def describe(self) -> str:
        system = f", a {self.default_system_tokens}-token default system turn" if self.default_system_tokens else ""
        fixed = f", {self.fixed_tokens} more a row" if self.fixed_tokens else ""
        return f"the chat template of {self.template} ({self.tokens_per_message} tokens a message{system}{fixed})"


def _read(path: str) -> dict[str, Any]:
    return tomllib.loads(resources.files("lorafit").joinpath(path).read_text(encoding="utf-8"))


@functools.cache
def templates() -> dict[str, TemplateCost]:
    """catalog/chat_templates.toml, by family name."""
    fields = TemplateCost.__dataclass_fields__
    table = _read("catalog/chat_templates.toml")["template"]
    try:
        return {
            name: TemplateCost(
                name=name, **{key: tuple(v) if key == "models" else v for key, v in entry.items() if key in fields}
            )
            for name, entry in table.items()
        }
    except TypeError as error:  # a shipped file is wrong: a bug, said plainly
        raise DataError(f"catalog/chat_templates.toml: {error}") from None


def template_for(*names: str | None) -> TemplateCost | None:
    """The family template whose `models` patterns match one of `names` (catalog name, hub id, as typed)."""
    keys = [name.strip().lower() for name in names if name]
    for cost in templates().values():
        if any(fnmatchcase(key, pattern) for key in keys for pattern in cost.models):
            return cost
    return None


@functools.cache
def token_accuracy() -> dict[str, dict[str, Any]]:
    """catalog/token_accuracy.toml: per family, the estimate's measured error (or why it was not measured)."""
    return dict(_read("catalog/token_accuracy.toml").get("family", {}))


def accuracy_line(name: str) -> str:
    """The measured error of family `name`'s estimate, in words, for the plan."""
    entry = token_accuracy().get(name)
    if entry is None:
        return "its error is not measured yet (make bench-tokens)"
    if not entry.get("rows"):
        return f"its error is not measured: {entry['why']}"
    return (
        f"measured against {entry['tokenizer']} on {entry['rows']:,} generated chat rows (make bench-tokens): "
        f"total {entry['total_error']:+.1%}, longest row {entry['longest_error']:+.1%}, "
        f"a row {entry['row_error']:.0%} off on average"
    )
