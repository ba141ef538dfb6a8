"""make bench-exact: how fast `lorafit estimate --exact` is, and how close its trace is to real steps.

1. Speed and memory. Each estimate runs in a fresh process limited to 2 threads (what a user waits for,
   imports included), next to the targets: a 7B model in under 15 s, a 70B in under 30 s, peak RSS under 2 GB.
2. Trace against reality on the CPU. Models of ~100-300M parameters are built from random configs, saved and
   trained for two real steps (real bitsandbytes 4-bit, real peft) under the live-tensor tracker, in a fresh
   process that also samples its resident set size. Printed side by side: the trace's peak, the tracked real
   peak, and the RSS growth during the steps next to the tracked growth (peak minus what was alive before).

    python bench/exact_speed.py [--speed-only | --real-only]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
MIB = 2**20
GIB = 2**30

SPEED_CASES = [  # (model, settings, target seconds)
    ("llama-2-7b", {"method": "qlora", "seq_len": 2048}, 15),
    ("llama-3.1-8b", {"method": "lora", "quant": "none", "seq_len": 4096, "grad_ckpt": False}, 15),
    ("llama-2-70b", {"method": "qlora", "seq_len": 2048}, 30),
    ("llama-3.1-70b", {"method": "qlora", "seq_len": 4096, "micro_batch": 2}, 30),
]
RSS_TARGET_BYTES = 2 * 10**9
LAST_CPU_SECONDS = [0.0]  # user + system seconds of the last worker

# ~100-300M parameters: (label, hidden, layers, heads, vocab, settings)
REAL_CASES = [
    ("llama 134M qlora ckpt", 768, 12, 12, 32000, {"method": "qlora", "micro_batch": 2, "seq_len": 256}),
    (
        "llama 134M lora no-ckpt",
        768,
        12,
        12,
        32000,
        {"method": "lora", "quant": "none", "micro_batch": 1, "seq_len": 256, "grad_ckpt": False},
    ),
    (
        "llama 285M qlora ckpt 8-bit AdamW",
        1024,
        16,
        16,
        32000,
        {"method": "qlora", "micro_batch": 1, "seq_len": 256, "optimizer": "adamw_8bit"},
    ),
]


def child_env() -> dict[str, str]:
    return os.environ | {
        "OMP_NUM_THREADS": "2",
        "MKL_NUM_THREADS": "2",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONWARNINGS": "ignore",
    }


def run_child(args: list[str]) -> tuple[dict, float, int]:
    """Run this file as a worker in a fresh process: (its JSON answer, wall seconds, peak RSS bytes)."""
    started = time.perf_counter()
    command = [sys.executable, __file__, *args]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=child_env()) as child:
        output = child.stdout.read()
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - started
    LAST_CPU_SECONDS[0] = usage.ru_utime + usage.ru_stime
    if child.returncode != 0:
        raise SystemExit(f"worker {args} failed with exit code {child.returncode}")
    return json.loads(output.decode().strip().splitlines()[-1]), seconds, usage.ru_maxrss * 1024


# --- workers (run in the child process) --------------------------------------------------------------------
def worker_estimate(model: str, settings_json: str) -> None:
    import torch

    from lorafit.models import resolve
    from lorafit.schema import Settings
    from lorafit.trace import exact_estimate

    torch.set_num_threads(2)
    estimate = exact_estimate(resolve(model), Settings(**json.loads(settings_json)))
    print(json.dumps({"allocated_gib": estimate.peak_allocated_gib, "phase": estimate.peak_phase}))


def worker_real(spec_json: str, settings_json: str) -> None:
    import psutil
    import torch
    from transformers import AutoModelForCausalLM

    from lorafit.models import ModelSpec
    from lorafit.schema import Settings
    from lorafit.trace import real_step
    from lorafit.trace.tracker import LiveTensorTracker, Phase
    from lorafit.train import build

    torch.set_num_threads(2)
    spec = ModelSpec.model_validate_json(spec_json)
    settings = Settings(**json.loads(settings_json))
    process = psutil.Process()
    samples = {"before": 0, "max": 0, "step2_before": 0, "step2_max": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            rss = process.memory_info().rss
            samples["max"] = max(samples["max"], rss)
            samples["step2_max"] = max(samples["step2_max"], rss)
            time.sleep(0.002)

    def before_steps() -> None:
        samples["before"] = samples["max"] = process.memory_info().rss
        threading.Thread(target=sample, daemon=True).start()

    # Step 2 starts after a whole step has warmed the allocator, the kernels and bitsandbytes' compiled code.
    set_phase = LiveTensorTracker.set_phase

    def noting_step_2(tracker: LiveTensorTracker, phase: Phase) -> None:
        if phase == Phase(2, 1, "batch"):
            samples["step2_before"] = samples["step2_max"] = process.memory_info().rss
            samples["step2_tracked_before"] = tracker.live_bytes
        set_phase(tracker, phase)

    LiveTensorTracker.set_phase = noting_step_2

    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(build.hf_config(spec, settings), dtype=torch.bfloat16)
        model.save_pretrained(folder)
        del model
        measured = real_step(Path(folder), spec, settings, before_steps=before_steps)
    stop.set()
    step_2_peak = max(snapshot.total_bytes for phase, snapshot in measured.phase_peaks.items() if phase.step == 2)
    print(
        json.dumps(
            {
                "peak_bytes": measured.peak_bytes,
                "phase": measured.peak_description,
                "tracked_growth": measured.peak_bytes - measured.phase_starts[Phase(1, 1, "batch")].total_bytes,
                "rss_growth": samples["max"] - samples["before"],
                "step2_tracked_growth": step_2_peak - samples["step2_tracked_before"],
                "step2_rss_growth": samples["step2_max"] - samples["step2_before"],
                "params": measured.total_params,
            }
        )
    )


# --- the report ---------------------------------------------------------------------------------------------
def speed() -> None:
    print("1. `lorafit estimate --exact`, each in a fresh process with 2 threads (imports included)")
    print(f"machine load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (wall time counts the others)")
    print(
        f"{'model':14} {'settings':58} {'wall s':>8} {'cpu s':>8} {'target':>7} {'peak RSS':>9} {'target':>7}  estimate"
    )
    for model, settings, target in SPEED_CASES:
        answer, seconds, rss = run_child(["--worker-estimate", model, json.dumps(settings)])
        cpu_seconds = LAST_CPU_SECONDS[0]
        verdict = "ok" if seconds < target and rss < RSS_TARGET_BYTES else "MISSED"
        print(
            f"{model:14} {json.dumps(settings):58} {seconds:8.1f} {cpu_seconds:8.1f} {f'<{target}':>7} "
            f"{rss / 10**9:8.2f}G "
            f"{'<2G':>7}  {answer['allocated_gib']:.2f} GiB at {answer['phase']}  [{verdict}]"
        )


def real() -> None:
    from lorafit.models import resolve
    from lorafit.schema import Settings
    from lorafit.trace import trace_step

    print("\n2. trace against two real CPU steps (device='cpu' kernels); growth above what was alive before the")
    print("   steps (and before step 2), tracked tensors next to the process's resident set size")
    print(
        f"{'case':34} {'params':>7} {'trace MiB':>10} {'real MiB':>9} {'diff':>7}  {'growth: tracked':>15} "
        f"{'RSS':>7}  {'step 2: tracked':>15} {'RSS':>7}  peak phase"
    )
    for label, hidden, layers, heads, vocab, settings_kw in REAL_CASES:
        spec = resolve("llama-2-7b").scaled(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=hidden // heads,
            vocab_size=vocab,
            intermediate_size=(hidden * 8 // 3 // 64 + 1) * 64,
        )
        settings = Settings(**settings_kw)
        answer, _, _ = run_child(["--worker-real", spec.model_dump_json(), json.dumps(settings_kw)])
        traced = trace_step(spec, settings, device="cpu").peak_bytes
        diff = traced / answer["peak_bytes"] - 1
        print(
            f"{label:34} {answer['params'] / 1e6:6.0f}M {traced / MIB:10.1f} {answer['peak_bytes'] / MIB:9.1f} "
            f"{diff:+7.2%}  {answer['tracked_growth'] / MIB:15.1f} {answer['rss_growth'] / MIB:7.1f}  "
            f"{answer['step2_tracked_growth'] / MIB:15.1f} {answer['step2_rss_growth'] / MIB:7.1f}  "
            f"{answer['phase']}"
        )


def main() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notices
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed-only", action="store_true")
    parser.add_argument("--real-only", action="store_true")
    parser.add_argument("--worker-estimate", nargs=2, metavar=("MODEL", "SETTINGS_JSON"), help=argparse.SUPPRESS)
    parser.add_argument("--worker-real", nargs=2, metavar=("SPEC_JSON", "SETTINGS_JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_estimate:
        worker_estimate(*args.worker_estimate)
    elif args.worker_real:
        worker_real(*args.worker_real)
    else:
        if not args.real_only:
            speed()
        if not args.speed_only:
            real()


if __name__ == "__main__":
    main()
