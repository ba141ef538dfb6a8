"""make bench-moe: lorafit's closed-form estimate beside the `--exact` trace (the real transformers / peft /
bitsandbytes step on fake tensors at the real shapes) for the mixture-of-experts presets, and the time model's
closed form beside its roofline over the traced op list.

Rows: Qwen3-30B-A3B, gpt-oss-20b (eager attention: transformers has no sdpa path for it), Mixtral-8x7B and
DeepSeek-V2-Lite (latent attention, shared experts, a dense first layer: src/lorafit/mla.py), Mistral Small 4
(the same blocks), Gemma 4 26B-A4B (a dense MLP beside the experts: src/lorafit/gemma4.py), QLoRA, one row of
2048 tokens, with and without gradient checkpointing, LoRA on the attention (`all`) or on the attention and the
experts (`experts`, lora_dropout 0). These are check rows: no constant was fitted on them
(timing.MOE_ROUTING_KERNELS was fitted on Mixtral's traced kernel count, so its time row is a fit row).

    python bench/moe_trace.py [--models qwen3-30b-a3b,...,deepseek-v2-lite,mistral-small-4-119b] [--time]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lorafit import hardware  # noqa: E402
from lorafit.models import resolve  # noqa: E402
from lorafit.schema import Settings  # noqa: E402
from trace_rows import TIME_TITLE, main, micro_batch_times, peak_gib  # noqa: E402

MODELS = ("qwen3-30b-a3b", "gpt-oss-20b", "mixtral-8x7b", "deepseek-v2-lite", "mistral-small-4-119b", "gemma-4-26b-a4b")


def settings_for(name: str, targets: str, ckpt: bool) -> Settings:
    spec = resolve(name)
    attn = "sdpa" if "sdpa" in spec.attention_implementations else spec.attention_implementations[0]
    dropout = 0.0 if targets == "experts" else 0.05
    return Settings(
        method="qlora", quant="nf4", seq_len=2048, grad_ckpt=ckpt, attn=attn, lora_targets=targets, lora_dropout=dropout
    )


def memory_rows(models: list[str]) -> None:
    print(f"{'model':15s} {'targets':8s} {'ckpt':5s} {'trace GiB':>10s} {'estimate GiB':>13s} {'diff':>7s}")
    for name in models:
        for targets in ("all", "experts"):
            for ckpt in (True, False):
                traced, analytic, diff = peak_gib(name, settings_for(name, targets, ckpt))
                print(f"{name:15s} {targets:8s} {ckpt!s:5s} {traced:10.2f} {analytic:13.2f} {diff:+6.2f}%", flush=True)


def time_rows(models: list[str]) -> None:
    gpu = hardware.resolve("H100")
    print("\n" + TIME_TITLE.format(gpu=gpu.name))
    print(f"{'model':15s} {'targets':8s} {'traced ms':>10s} {'closed ms':>10s} {'diff':>7s}")
    for name in models:
        for targets in ("all", "experts"):
            traced, closed = (time.total for time in micro_batch_times(name, settings_for(name, targets, True), gpu))
            diff = 100 * (closed / traced - 1)
            print(f"{name:15s} {targets:8s} {traced * 1e3:10.0f} {closed * 1e3:10.0f} {diff:+6.1f}%", flush=True)


if __name__ == "__main__":
    main(__doc__, MODELS, memory_rows, time_rows)
