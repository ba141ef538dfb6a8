"""catalog/gguf.toml, read once: the architectures lorafit writes as GGUF (with the families it refuses and why)
and the pre-tokenizers it can name."""

from __future__ import annotations

import tomllib
from functools import cache
from importlib import resources
from typing import Any


@cache
def gguf_catalog() -> dict[str, Any]:
    text = resources.files("lorafit").joinpath("catalog", "gguf.toml").read_text()
    return tomllib.loads(text)
