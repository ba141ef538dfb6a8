"""`lorafit measure`: a tiny model's plan trained for a few steps on the CPU, its measured figures beside the
estimate, each measurement stored in the user's cache and exported as calibration rows; bad input refused in one
line with nothing written. And the measuring engine's memory readers, shared with `make gpu-check`."""

from __future__ import annotations

import csv
import json
import mmap
import threading
import time
from pathlib import Path

import pytest

from conftest import run_cli, tiny_spec
from lorafit import hardware
from lorafit.measure import engine, run

CALIBRATION = Path(__file__).resolve().parents[1] / "bench" / "calibration" / "measured_memory.csv"
SMALL_RUN = ["--method", "lora", "--seq-len", "64", "--micro-batch", "2", "--grad-accum", "1", "--steps", "2"]


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    """A Llama config.json at a few thousand parameters per layer: all `lorafit measure` needs (it builds the
    weights itself, at random)."""
    spec = tiny_spec(hidden_size=64, intermediate_size=128, head_dim=16, vocab_size=256)
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(spec.to_hf_config()))
    return folder


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The measurements file under a temporary XDG cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "lorafit" / "measurements.jsonl"


def stored(cache: Path) -> list[dict]:
    return [json.loads(line) for line in cache.read_text().splitlines()] if cache.exists() else []


def test_cpu_run_prints_measured_beside_estimate_stores_it_and_exports_it(tiny_model, cache, tmp_path, capsys) -> None:
    code, out, err = run_cli(["measure", "--cpu", "--model", str(tiny_model), *SMALL_RUN], capsys)
    assert code == 0, err
    header = next(line for line in out.splitlines() if "measured" in line and "estimate" in line)
    assert header.index("measured") < header.index("estimate")
    speed = next(line for line in out.splitlines() if "tokens/s" in line)
    numbers = [cell.strip() for cell in speed.split("│")[2:4]]
    assert all(float(n.replace(",", "")) > 0 for n in numbers), speed  # measured and estimated, side by side
    assert str(cache) in " ".join(out.split())
    assert len(stored(cache)) == 1

    code, out, err = run_cli(["measure", "--cpu", "--model", str(tiny_model), *SMALL_RUN, "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["steps"] == 2 and result["device"].startswith("CPU")
    measured, estimate = result["measured"], result["estimate"]
    for figures in (measured, estimate):
        assert {"tokens_per_s", "peak_allocated_gib", "peak_reserved_gib", "peak_device_gib"} <= figures.keys()
    assert measured["tokens_per_s"] > 0 and estimate["tokens_per_s"] > 0
    assert len(measured["step_seconds"]) == result["warmup_steps"] + 2
    timed = measured["step_seconds"][result["warmup_steps"] :]
    assert measured["tokens_per_s"] == pytest.approx(2 * 64 * 2 / sum(timed), rel=0.01)  # 2 steps of 2 x 64 tokens
    # the CPU has no CUDA allocator: no figure rather than an invented one; its device figure is the RSS growth
    assert measured["peak_allocated_gib"] is None and measured["peak_reserved_gib"] is None
    assert measured["peak_device_gib"] > 0 and "RSS" in measured["peak_device_source"]
    assert estimate["peak_device_gib"] >= estimate["peak_reserved_gib"] >= estimate["peak_allocated_gib"] > 0
    # the run's time from the measured speed: the same tokens as the estimate's hours at its own speed
    assert measured["hours"] == pytest.approx(result["run_tokens"] / measured["tokens_per_s"] / 3600, rel=0.01)
    assert estimate["hours"] == pytest.approx(result["run_tokens"] / estimate["tokens_per_s"] / 3600, rel=0.01)
    assert stored(cache)[-1] == result and len(stored(cache)) == 2

    exported = tmp_path / "mine.csv"
    code, out, err = run_cli(["measure", "--export", str(exported)], capsys)
    assert code == 0, err
    with exported.open() as handle, CALIBRATION.open() as calibration:
        reader = csv.DictReader(handle)
        rows = list(reader)
        assert reader.fieldnames == next(csv.reader(calibration))
    assert len(rows) == 2
    row = rows[1]
    assert row["split"] == "check" and row["kind"] == "measured"
    assert row["source"].startswith(f"lorafit measure {result['lorafit']} on {result['device']}")
    assert (row["method"], row["micro_batch"], row["seq_len"], row["grad_ckpt"]) == ("lora", "2", "64", "off")
    assert float(row["tokens_per_s"]) == measured["tokens_per_s"]
    assert float(row["step_time_s"]) == pytest.approx(sum(timed) / len(timed), rel=1e-3)
    assert row["peak_gb"] == ""  # no allocator figure on the CPU

    before = exported.read_text()
    code, _, err = run_cli(["measure", "--export", str(exported)], capsys)
    assert code == 2 and "exists" in err and err.count("\n") == 1
    assert exported.read_text() == before


def refused(args: list[str], capsys, cache: Path) -> str:
    """Exit 2, one line on stderr, and neither a measurement stored nor anything printed on stdout."""
    code, out, err = run_cli(args, capsys)
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("lorafit: error: ")
    assert out == "" and not cache.exists()
    return err


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_no_timed_steps_is_refused(steps, tiny_model, cache, capsys) -> None:
    err = refused(["measure", "--cpu", "--model", str(tiny_model), "--steps", steps], capsys, cache)
    assert f"--steps {steps}" in err


def test_without_a_gpu_and_without_cpu_says_so(tiny_model, cache, capsys) -> None:
    if run.cuda_available():
        pytest.skip("this machine has a CUDA GPU")
    err = refused(["measure", "--model", str(tiny_model)], capsys, cache)
    assert "no CUDA GPU" in err and "--cpu" in err


def test_a_plan_that_does_not_fit_is_not_measured(cache, capsys) -> None:
    err = refused(["measure", "--cpu", "--model", "llama-3.1-405b", "--method", "lora"], capsys, cache)
    assert "does not fit" in err and "measure only what fits" in err


def test_a_model_too_big_for_the_host_ram_is_not_built(tiny_model, cache, capsys, monkeypatch) -> None:
    monkeypatch.setattr(hardware, "available_ram_gib", lambda: 0.001)
    err = refused(["measure", "--cpu", "--model", str(tiny_model), *SMALL_RUN], capsys, cache)
    assert "too big for this machine's RAM" in err


def test_a_model_too_big_for_the_gpu_is_not_built(tiny_model, tmp_path, monkeypatch) -> None:
    """The GPU's free memory against the plan's device figure, checked before anything is built (no GPU here:
    the free memory is given)."""
    from lorafit import answers
    from lorafit.errors import InvalidConfig

    plan = answers.plan({"model": str(tiny_model), "gpu": "RTX 4090"}).plans[0]
    monkeypatch.setattr(run, "free_gpu_gib", lambda: plan.estimate.peak_device_gib / 2)
    with pytest.raises(InvalidConfig, match="too big for this GPU"):
        run.check_plan(plan, "cuda", tmp_path)
    monkeypatch.setattr(run, "free_gpu_gib", lambda: plan.estimate.peak_device_gib * 2)
    run.check_plan(plan, "cuda", tmp_path)  # room enough: no refusal


def test_what_measure_cannot_compare_is_refused(tiny_model, cache, tmp_path, capsys) -> None:
    """A named GPU on the CPU, another trainer's step, several GPUs, and --export beside settings."""
    err = refused(["measure", "--cpu", "--model", str(tiny_model), "--gpu", "RTX 4090"], capsys, cache)
    assert "drop --gpu" in err
    err = refused(["measure", "--cpu", "--model", str(tiny_model), "--stack", "trl"], capsys, cache)
    assert "--stack lorafit" in err
    target = tmp_path / "rows.csv"
    err = refused(["measure", "--export", str(target), "--model", str(tiny_model)], capsys, cache)
    assert "pass it alone" in err and not target.exists()


def test_running_out_of_memory_is_one_line_and_records_nothing(tiny_model, cache, capsys, monkeypatch) -> None:
    import torch

    def out_of_memory(*args: object, **kwargs: object) -> list[float]:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(engine, "train_steps", out_of_memory)
    err = refused(["measure", "--cpu", "--model", str(tiny_model), *SMALL_RUN], capsys, cache)
    assert "ran out of memory" in err and "nothing recorded" in err


# --- the engine's memory readers (shared with make gpu-check) -------------------------------------------------
def test_host_figure_counts_memory_the_process_takes() -> None:
    if not engine.HostMemory.available():
        pytest.skip("no /proc/self/statm here")
    probe = engine.HostMemory()
    before = engine.resident_bytes()
    block = mmap.mmap(-1, 64 * 2**20)  # 64 MiB of fresh pages, touched one by one below so that they are resident
    for offset in range(0, len(block), 4096):
        block[offset] = 1
    assert probe.now() >= before + 60 * 2**20
    block.close()
    assert probe.now() >= before + 60 * 2**20  # a peak: freeing the block does not lower it


def test_device_peak_keeps_a_reading_from_the_middle_of_the_run() -> None:
    readings = []
    lock = threading.Lock()

    def read() -> int:
        with lock:
            readings.append(None)
            return 7 if len(readings) == 2 else 2  # one high reading, low before and after

    with engine.PeakSampler(read, interval_s=0.001) as sampler:
        while len(readings) < 4:
            time.sleep(0.001)
    assert sampler.peak == 7


def test_device_figure_reads_nvidia_smi_in_mib(tmp_path: Path) -> None:
    """Without pynvml the device figure comes from the nvidia-smi command; what it prints is MiB, per GPU."""
    command = tmp_path / "nvidia-smi"
    command.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\ncat "$(dirname "$0")/answer"\n')
    command.chmod(0o755)
    (tmp_path / "answer").write_text("143771\n")
    assert engine.nvidia_smi_used(str(command)) == 143771 * 2**20
    assert "--query-gpu=memory.used" in (tmp_path / "args").read_text()
    (tmp_path / "answer").write_text("No devices were found\n")
    assert engine.nvidia_smi_used(str(command)) is None
    assert engine.nvidia_smi_used(str(tmp_path / "missing")) is None
