"""Runtime facts of the stacks read from their sources (issue 28): DeepSpeed's default reduce bucket under
`--stack trl` with ZeRO-3, Unsloth's per-layer rotary caches at its 2024 versions, and the plan's line for an
Unsloth dynamic 4-bit repo, whose 16-bit modules are not counted."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from lorafit import models
from lorafit.memory import estimate
from lorafit.memory.runtime import stack_runtime
from lorafit.schema import Settings

GIB = 2**30


def test_trl_under_zero3_holds_deepspeeds_default_reduce_bucket() -> None:
    """An accelerate config sets no reduce_bucket_size, so DeepSpeed's 5e8 holds (one bf16 buffer under ZeRO-3),
    where lorafit's own deepspeed.json writes 5e7."""
    spec = models.resolve("llama-2-7b")
    job = dict(method="lora", precision="bf16", n_gpus=2, shard="zero3", micro_batch=1, grad_accum=1, seq_len=512)
    trl = estimate(spec, Settings(stack="trl", **job)).per_gpu_gib["communication_buffers"]
    own = estimate(spec, Settings(stack="lorafit", **job)).per_gpu_gib["communication_buffers"]
    assert trl - own == pytest.approx((500_000_000 - 50_000_000) * 2 / GIB, abs=1e-3)


@pytest.mark.parametrize(
    ("model", "positions"),
    [("llama-2-7b", 4096), ("llama-3.1-8b", 32768)],  # 4096 trained positions; 131072, capped at 4 x 8192
)
def test_unsloth_2024_keeps_a_rotary_cache_in_every_layer(model: str, positions: int) -> None:
    """Unsloth 2024.x gave each of the 32 attention layers cos and sin caches (head_dim 128, fp16 on a T4)."""
    spec = models.resolve(model)
    settings = Settings(stack="unsloth", method="qlora", precision="fp16", micro_batch=1, grad_accum=1, seq_len=512)
    pinned = stack_runtime(settings)
    weights = estimate(spec, settings, runtime=pinned).breakdown_gib["weights"]
    for dtype, size in (("compute", 2), ("fp32", 4)):  # Gemma's stay fp32
        then = pinned.model_copy(update={"per_layer_rope_cache": dtype})
        grown = estimate(spec, settings, runtime=then).breakdown_gib["weights"] - weights
        assert grown == pytest.approx(32 * 2 * positions * 128 * size / GIB, abs=1e-3)


def test_a_dynamic_4bit_repo_is_said_to_keep_16bit_layers(capsys: pytest.CaptureFixture[str]) -> None:
    repo = "unsloth/Qwen3-8B-unsloth-bnb-4bit"  # not in catalog/unsloth_dynamic.toml (those: test_prequantized)
    code, out, _ = run_cli(["plan", "--model", repo, "--gpu", "a100-80gb", "--stack", "unsloth", "--json"], capsys)
    assert code == 0
    said = " ".join(json.loads(out)["reasons"])
    assert f"{repo} is an Unsloth dynamic 4-bit checkpoint" in said and "may be low" in said
    # a plain pre-quantised copy packs every linear, and is not said to
    code, out, _ = run_cli(["plan", "--model", "unsloth/llama-3-8b-bnb-4bit", "--gpu", "a100-80gb", "--json"], capsys)
    assert code == 0 and "dynamic 4-bit" not in " ".join(json.loads(out)["reasons"])


def test_unsloths_4bit_load_of_a_16bit_name_is_said_to_take_its_dynamic_copy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # (qwen3-8b: its dynamic copy is not in catalog/unsloth_dynamic.toml)
    job = ["plan", "--model", "qwen3-8b", "--gpu", "a100-80gb", "--method", "qlora", "--json"]
    code, out, _ = run_cli([*job, "--stack", "unsloth"], capsys)
    assert code == 0 and "Unsloth's dynamic 4-bit copy" in " ".join(json.loads(out)["reasons"])
    code, out, _ = run_cli([*job, "--stack", "trl"], capsys)  # transformers' own load packs every linear
    assert code == 0 and "dynamic 4-bit" not in " ".join(json.loads(out)["reasons"])
