"""The CPU as a card (lorafit.hostcard): the time model reads back exactly the rates measured on this host."""

from __future__ import annotations

import math

import pytest

from lorafit import hostcard, models, timing
from lorafit.schema import Settings


@pytest.fixture
def fresh_card():
    """cpu_card() measured anew in this test, and the cache left empty for the next one."""
    hostcard.cpu_card.cache_clear()
    yield hostcard.cpu_card
    hostcard.cpu_card.cache_clear()


def test_the_time_model_reads_back_the_measured_rates(fresh_card, monkeypatch) -> None:
    rates = {"fp32": 150e9, "bf16": 400e9}
    monkeypatch.setattr(hostcard, "matmul_flops_per_second", lambda dtype: rates[dtype])
    monkeypatch.setattr(hostcard, "copy_bytes_per_second", lambda: 30e9)
    card = fresh_card()
    assert timing.achievable_matmul_flops(card, "fp32") == pytest.approx(150e9)
    assert timing.achievable_matmul_flops(card, "bf16") == pytest.approx(400e9)
    assert timing.achievable_bytes_per_second(card) == pytest.approx(30e9)


def test_cpu_card_is_measured_once_and_plausible(fresh_card) -> None:
    import torch

    card = fresh_card()
    assert fresh_card() is card  # cached for the process
    assert card.name == f"CPU ({torch.get_num_threads()} threads)"
    fp32 = timing.achievable_matmul_flops(card, "fp32")
    # one core of a 2010 laptop reaches a few GFLOP/s; no CPU socket reaches 100 TFLOP/s in fp32
    assert 1e9 < fp32 < 100e12
    assert timing.achievable_matmul_flops(card, "bf16") > 0
    # DDR3 single channel to many-channel HBM CPUs
    assert 1e9 < timing.achievable_bytes_per_second(card) < 2e12
    assert card.memory_gib > 0.5
    # a small model's micro-batch on this card: every op positive and finite, fp32 as lorafit trains on the CPU
    spec = models.resolve("smollm2-135m")
    settings = Settings(method="lora", quant="none", precision="fp32", micro_batch=1, seq_len=256)
    ops = timing.micro_batch_time(spec, settings, card)
    assert math.isfinite(ops.total) and ops.matmul > 0 and ops.elementwise > 0
    assert timing.step_time(spec, settings, card).total >= ops.total
