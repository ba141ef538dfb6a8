"""The CPU as a card (lorafit.hostcard): the time model reads back exactly the rates measured on this host."""

from __future__ import annotations

import math

import pytest

from conftest import load_script
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
    monkeypatch.setattr(hostcard, "quantized_rates", lambda: (8e9, 1.05))
    card = fresh_card()
    assert timing.achievable_matmul_flops(card, "fp32") == pytest.approx(150e9)
    assert timing.achievable_matmul_flops(card, "bf16") == pytest.approx(400e9)
    assert timing.achievable_bytes_per_second(card) == pytest.approx(30e9)
    assert timing.dequant_bytes_per_second(card) == pytest.approx(8e9)
    assert timing.quant_matmul_slowdown(card) == pytest.approx(1.05)


def test_without_bitsandbytes_the_card_falls_back_to_the_time_models_figures(fresh_card, monkeypatch) -> None:
    monkeypatch.setattr(hostcard, "matmul_flops_per_second", lambda dtype: 100e9)
    monkeypatch.setattr(hostcard, "copy_bytes_per_second", lambda: 20e9)
    monkeypatch.setattr(hostcard, "quantized_rates", lambda: None)
    card = fresh_card()
    assert timing.dequant_bytes_per_second(card) == pytest.approx(20e9)
    assert timing.quant_matmul_slowdown(card) == timing.QUANT_MATMUL_SLOWDOWN


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
    # bitsandbytes' CPU dequantisation, measured (each micro-benchmark meets its own share of a shared host's
    # load, so no bound relative to the copy): within what memory can move, and a 4-bit matmul no faster than a
    # plain one
    assert 0.05e9 < timing.dequant_bytes_per_second(card) < 2e12
    assert timing.quant_matmul_slowdown(card) >= 1.0
    # a small model's micro-batch on this card: every op positive and finite, fp32 as lorafit trains on the CPU
    spec = models.resolve("smollm2-135m")
    settings = Settings(method="lora", quant="none", precision="fp32", micro_batch=1, seq_len=256)
    ops = timing.micro_batch_time(spec, settings, card)
    assert math.isfinite(ops.total) and ops.matmul > 0 and ops.elementwise > 0
    assert timing.step_time(spec, settings, card).total >= ops.total


# --- bench/time_structure_cpu.py: its prediction half, on a card with fixed rates (the timing is the bench's) ----
@pytest.fixture(scope="module")
def bench():
    return load_script("bench/time_structure_cpu.py")


@pytest.fixture
def fixed_card(fresh_card, monkeypatch):
    """A CPU card with fixed rates: 100 GFLOP/s fp32, 300 bf16, 20 GB/s."""
    monkeypatch.setattr(hostcard, "matmul_flops_per_second", lambda dtype: {"fp32": 100e9, "bf16": 300e9}[dtype])
    monkeypatch.setattr(hostcard, "copy_bytes_per_second", lambda: 20e9)
    monkeypatch.setattr(hostcard, "quantized_rates", lambda: (5e9, 1.0))
    return fresh_card()


def test_the_bench_predicts_each_pair_from_the_time_model(bench, fixed_card) -> None:
    spec = models.resolve("smollm2-135m").scaled(num_hidden_layers=bench.LAYERS)
    seconds = bench.predicted_seconds(spec, fixed_card)
    assert set(seconds) == set(bench.CONFIGS)
    assert seconds["lora"]["total"] == pytest.approx(timing.step_time(spec, bench.BASE, fixed_card).total)
    predicted = bench.ratios({name: ops["total"] for name, ops in seconds.items()})
    # the per-token work grows 8 times; what does not (the optimizer, the kernels' fixed cost) keeps it under 8
    assert 6 < predicted["micro-batch 8 / 1"] < 8
    # four times the tokens, and attention grows with the square of the sequence
    assert predicted["sequence 1024 / 256"] > 4
    # recomputing the layers' forward costs time; dequantising a 4-bit base too
    assert predicted["checkpointing on / off"] > 1
    assert predicted["QLoRA / LoRA"] > 1


def test_the_verdict_is_the_prediction_within_25_percent_of_the_measurement(bench) -> None:
    rows = bench.compare({"close": 2.0, "far": 2.0}, {"close": 2.4, "far": 1.4})
    assert [(row["error"], row["passes"]) for row in rows] == [(0.2, True), (-0.3, False)]
    printed = bench.table(rows)
    assert "+20%" in printed and "-30%" in printed and "FAIL" in printed
