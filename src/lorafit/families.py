"""The families lorafit models: catalog/architectures.toml's traits of each decoder block, read once, and the
config.json `model_type`s that name them. Code asks a family's traits, never its name, so a family is added
as one table."""

from __future__ import annotations

import tomllib
from functools import cache
from importlib import resources
from typing import Literal, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lorafit import mla

# The families of catalog/architectures.toml, for the type checker (tests/test_architectures.py: the two agree)
Families = Literal[
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe", "gpt_oss"
]
# gemma4.py, linear_attention.py (Qwen3.5 and, with a shared expert, Qwen3-Next and Qwen3.5 MoE), mla.py
Architecture = Literal[Families, "gemma4", "qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", mla.LatentFamily]
AttentionKernel = Literal["sdpa", "flash", "eager"]


class ArchitectureSpec(BaseModel):
    """How one family's decoder block differs from Llama's (catalog/architectures.toml, whose header explains each
    trait). Code asks these traits, never the family's name, so a family is added as one table."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    model_types: tuple[str, ...] = Field(min_length=1)
    source: str
    norms_per_layer: Literal[2, 4]
    qk_norm: bool
    qk_norm_saved: bool
    logit_softcapping: bool
    attention: tuple[AttentionKernel, ...] = Field(min_length=1)
    fused_qkv: bool
    fused_gate_up: bool
    qkv_bias: bool
    tie_word_embeddings: bool
    attention_bias_key: bool
    pad_token_id: int | None = None
    llama_cpp_70b: bool
    # mixture-of-experts traits (optional: a dense family states none of them)
    experts_key: str = "num_local_experts"
    experts_module: str = "mlp.experts"  # where the fused experts sit in a block (Gemma 4: beside the MLP, `experts`)
    attention_sinks: bool = False
    moe_biases: bool = False
    clamped_swiglu: bool = False
    experts_transposed: bool = False
    attention_output_gate: bool = False  # Qwen3.5: q_proj also yields a sigmoid gate on the attention output

    @model_validator(mode="after")
    def _saved_norms_exist(self) -> ArchitectureSpec:
        if self.qk_norm_saved and not self.qk_norm:
            raise ValueError("qk_norm_saved needs qk_norm")
        return self


def load_architectures(text: str) -> dict[str, ArchitectureSpec]:
    """The `[architecture.<name>]` tables of an architectures.toml text, by name."""
    tables = tomllib.loads(text)["architecture"]
    return {name: ArchitectureSpec.model_validate({"name": name, **traits}) for name, traits in tables.items()}


@cache
def architectures() -> dict[str, ArchitectureSpec]:
    """The families lorafit models (catalog/architectures.toml)."""
    return load_architectures(resources.files("lorafit").joinpath("catalog/architectures.toml").read_text())


def model_types() -> dict[str, Architecture]:
    """config.json `model_type` -> the family lorafit reads it as."""
    families = {model_type: arch.name for arch in architectures().values() for model_type in arch.model_types}
    return cast(dict[str, Architecture], families)


def known_architecture(value: object) -> Architecture:
    """A family of the table (validates `ModelSpec.architecture` against the table, not only the literal)."""
    if not isinstance(value, str) or value not in architectures():
        raise ValueError(f"unknown architecture {value!r}; known: {', '.join(architectures())}")
    return cast(Architecture, value)


# config.json `model_type` -> family, as the shipped table has it (the code itself asks `model_types()`)
MODEL_TYPES: dict[str, Architecture] = model_types()
