"""bench/gpu_check.py: the CPU smoke run writes every row, the full check refuses to start without CUDA, and the
time budget stops new rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import bench_module

MODELS = {"llama-2-7b", "llama-3.1-8b", "qwen2.5-7b"}


@pytest.fixture(scope="module")
def gpu_check():
    yield from bench_module("gpu_check")


def positive(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_smoke_run_writes_every_row_with_its_figures(gpu_check, tmp_path: Path, capsys) -> None:
    from lorafit import hardware, models
    from lorafit.plan import make_plan
    from lorafit.schema import PlanRequest

    out = tmp_path / "smoke.json"
    assert gpu_check.main(["--smoke", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    rows = data["rows"]

    # 3 models x QLoRA/LoRA x checkpointing on/off x micro-batch 1/2, every one run through the Trainer
    measure = [r for r in rows if r["check"] == "measure"]
    combinations = {
        (r["model"], r["settings"]["method"], r["settings"]["grad_ckpt"], r["settings"]["micro_batch"]) for r in measure
    }
    assert len(measure) == len(combinations) == 24
    assert {r["model"] for r in measure} == MODELS
    assert data["mode"] == "tiny" and data["environment"]["device"] == "cpu"
    assert data["skipped"] == []
    for row in rows:
        assert row["status"] == "ran", row.get("traceback", row)
        assert row["name"] in printed
        measured, predicted = row["measured"], row["predicted"]
        assert positive(measured["tokens_per_s"])
        assert len(measured["step_seconds"]) == data["steps"]["warmup"] + data["steps"]["timed"]
        # the CPU has no allocator figures: said, not invented
        assert measured["allocated_gib"] is measured["reserved_gib"] is measured["device_gib"] is None
        assert "CPU" in measured["note"]
        for key in ("allocated_gib", "reserved_gib", "device_gib", "tokens_per_s"):
            assert positive(predicted[key]), (row["name"], key)
        assert predicted["reserved_gib"] >= predicted["allocated_gib"]
        assert predicted["device_gib"] >= predicted["reserved_gib"]
        assert row["error"]["tokens_per_s"] is None  # the time model is a GPU's: no error against the CPU

    # the fits rows run make_plan's own choice for each card, then twice its micro-batch where a plan fits
    fits = {r["name"]: r for r in rows if r["check"] == "fits"}
    spec = models.resolve("llama-3.1-8b")
    for card_name in ("RTX 4090", "RTX 4060 Ti 16GB", "RTX 4060"):
        card = hardware.resolve(card_name)
        plan = make_plan(PlanRequest(model=spec, gpu=card, fixed={"method": "qlora", "seq_len": 2048}))
        of_card = [r for r in fits.values() if r["fits"]["card"] == card.name]
        assert of_card[0]["fits"]["plan_fits"] is plan.fits
        assert of_card[0]["settings"]["micro_batch"] == plan.settings.micro_batch
        assert of_card[0]["settings"]["grad_ckpt"] is plan.settings.grad_ckpt
        assert of_card[0]["settings"]["optimizer"] == plan.settings.optimizer
        if plan.fits:
            assert len(of_card) == 2
            assert of_card[1]["settings"]["micro_batch"] == 2 * plan.settings.micro_batch
        else:
            assert len(of_card) == 1 and "no plan fits" in of_card[0]["name"]
        for row in of_card:
            assert row["fits"]["expected"] is None and row["fits"]["agrees"] is None  # tiny models: no verdict


def test_full_check_without_cuda_exits_2_with_one_line(gpu_check, capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main([])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "needs a CUDA GPU; use --smoke" in err


def test_no_time_left_skips_every_row_and_still_writes_them(gpu_check, tmp_path: Path, capsys) -> None:
    out = tmp_path / "late.json"
    assert gpu_check.main(["--smoke", "--time-budget", "0", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    names = [row["name"] for row in data["rows"]]
    assert names == [row.name for row in gpu_check.all_rows(tiny=True, device="cpu")]
    assert data["skipped"] == names
    assert all(row["status"] == "skipped" and row["reason"] == "time budget" for row in data["rows"])
    printed = capsys.readouterr().out
    assert "skipped (time budget of 0 min): " + ", ".join(names) in printed


def test_budget_starts_work_only_while_the_longest_of_its_kind_fits(gpu_check) -> None:
    now = [0.0]
    budget = gpu_check.Budget(100, clock=lambda: now[0])
    assert budget.allows("build", "row")  # nothing measured yet
    with budget.timing("build"):
        now[0] += 20
    with budget.timing("row"):
        now[0] += 30
    with budget.timing("row"):
        now[0] += 10  # the longest row stays 30 s
    assert budget.elapsed() == 60
    assert budget.allows("row")  # 40 s left, rows take up to 30
    assert not budget.allows("build", "row")  # a new model needs 20 + 30
    now[0] = 71
    assert not budget.allows("row")


def test_relative_error_is_lorafit_against_the_measurement(gpu_check) -> None:
    measured = {"allocated_gib": 10.0, "reserved_gib": 12.0, "device_gib": None, "tokens_per_s": 1000.0}
    predicted = {"allocated_gib": 11.0, "reserved_gib": 9.0, "device_gib": 13.0, "tokens_per_s": 1500.0}
    errors = gpu_check.relative_errors(measured, predicted, speed=True)
    assert errors == {"allocated": 0.1, "reserved": -0.25, "device": None, "tokens_per_s": 0.5}
    assert gpu_check.relative_errors(measured, predicted, speed=False)["tokens_per_s"] is None


def test_results_file_is_named_after_the_gpu(gpu_check) -> None:
    assert gpu_check.slug("NVIDIA H200") == "nvidia-h200"
    assert gpu_check.slug("NVIDIA GeForce RTX 4090 (24 GB)") == "nvidia-geforce-rtx-4090-24-gb"


def test_fits_check_runs_first_and_the_paged_optimizer_last_of_it(gpu_check) -> None:
    """A short budget skips measurement rows of the other models, not the fits check; the paged optimizer, whose
    managed memory bitsandbytes never frees, runs after everything measured on the same model."""
    rows = gpu_check.all_rows(tiny=False, device="cuda")
    order = [row for _, groups in gpu_check.run_order(rows) for group in groups for row in group]
    assert sorted(row.name for row in order) == sorted(row.name for row in rows)
    first_model = [row for row in order if row.model == order[0].model]
    assert order[0].model == "llama-3.1-8b"
    assert order[len(first_model) - 1].check == "fits"
    fits = [index for index, row in enumerate(order) if row.check == "fits"]
    assert fits == list(range(fits[0], len(first_model)))
    paged = [index for index, row in enumerate(order) if row.settings.optimizer.startswith("paged")]
    assert all(index > max(set(range(len(first_model))) - set(paged)) for index in paged)


def test_the_fsdp_host_loading_check_runs_the_sharded_step(gpu_check, tmp_path: Path) -> None:
    """The check's own path on the CPU (gloo, a process group of one): the base loaded where lorafit train
    loads it for FSDP, sharded per layer, a forward and backward with every adapter graded."""
    context = gpu_check.Context("cpu", True, None, None, tmp_path, 1)
    result = gpu_check.fsdp_host_loading(context)
    assert (
        result["ok"] and result["adapters_with_gradients"] > 0 and result["model_bytes"] > result["largest_layer_bytes"]
    )
    assert result["peak_bytes_while_sharding"] is None  # no CUDA memory to read on the CPU
