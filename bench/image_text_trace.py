"""`make bench-image-text`: lorafit's estimate beside the `--exact` trace for image-text models fine-tuned on text.

Each row traces the real transformers step of the full-size model (Gemma3ForConditionalGeneration,
Mistral3ForConditionalGeneration, Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration,
Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration, Gemma4ForConditionalGeneration, with their
vision towers packed by transformers' bitsandbytes quantizer; Llama 3.2 Vision's MllamaForCausalLM, the language
model that AutoModelForCausalLM loads, its cross-attention layers packed too) on fake tensors at the real shapes, a
text-only batch, and prints the traced peak beside `memory.estimate` for the same settings. These are check rows:
nothing here was fitted.

    python bench/image_text_trace.py [--models gemma-3-12b,...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lorafit.schema import Settings  # noqa: E402
from trace_rows import peak_gib  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "image-text-trace.json"
QLORA_2048 = dict(method="qlora", quant="nf4", micro_batch=1, seq_len=2048, grad_ckpt=True, lora_targets="all")
# issue 27's acceptance rows first (Gemma-3-12B and Mistral-Small-3.2 QLoRA at 2048 tokens), then the other presets
# and other settings
ROWS: tuple[tuple[str, dict], ...] = (
    ("gemma-3-12b", QLORA_2048),
    ("mistralai/Mistral-Small-3.2-24B-Instruct-2506", QLORA_2048),
    # Llama 3.2 Vision: MllamaForCausalLM, its cross-attention layers stored and skipped (src/lorafit/mllama.py)
    ("meta-llama/Llama-3.2-11B-Vision", QLORA_2048),
    ("gemma-3-4b", QLORA_2048),
    ("gemma-3-27b", QLORA_2048),
    ("qwen2.5-vl-7b", QLORA_2048),
    ("qwen2-vl-7b", QLORA_2048),
    ("Qwen/Qwen3-VL-8B-Instruct", QLORA_2048),
    ("Qwen/Qwen3-VL-30B-A3B-Instruct", QLORA_2048),
    ("qwen2.5-vl-3b", QLORA_2048),
    ("gemma-3-4b", dict(method="lora", quant="none", micro_batch=1, seq_len=2048, grad_ckpt=True)),
    ("gemma-3-4b", dict(method="full", quant="none", micro_batch=1, seq_len=1024, grad_ckpt=True)),
    ("qwen3-vl-4b", dict(method="lora", quant="none", micro_batch=1, seq_len=2048, grad_ckpt=True)),
    ("qwen2.5-vl-7b", dict(method="qlora", quant="nf4", micro_batch=2, seq_len=1024, grad_ckpt=False)),
    ("mistral-small-3.1-24b", QLORA_2048 | {"lora_targets": "qv"}),
    ("meta-llama/Llama-3.2-90B-Vision-Instruct", QLORA_2048),
    ("llama-3.2-11b-vision", dict(method="lora", quant="none", micro_batch=1, seq_len=2048, grad_ckpt=True)),
    # Gemma 4 31B: global layers of their own head size (traced at 6 and 12 layers, one and two periods)
    ("google/gemma-4-31B-it", QLORA_2048),
    ("gemma-4-31b", dict(method="lora", quant="none", micro_batch=1, seq_len=2048, grad_ckpt=True)),
    # the plan's choice on an H100 (chunked loss, micro-batch 8): the peak is the last layer's, a global one
    ("gemma-4-31b", QLORA_2048 | {"micro_batch": 8, "loss": "chunked"}),
    # Gemma 4 26B-A4B: the 31B's layers with an MoE block (128 fused experts left 16-bit) beside a dense MLP
    ("google/gemma-4-26B-A4B-it", QLORA_2048),
    ("gemma-4-26b-a4b", QLORA_2048 | {"micro_batch": 4, "loss": "chunked"}),  # the peak: a layer's backward
    # Gemma 4 E2B / E4B: per-layer input embeddings (16-bit), shared-KV layers, an audio tower (traced at full depth)
    ("google/gemma-4-E2B-it", QLORA_2048),
    ("google/gemma-4-E4B-it", QLORA_2048),
    ("gemma-4-e2b", dict(method="lora", quant="none", micro_batch=1, seq_len=2048, grad_ckpt=True)),
    ("gemma-4-e4b", dict(method="lora", quant="none", micro_batch=1, seq_len=2048, grad_ckpt=True)),
    # without checkpointing every layer's activations count: the E2B's double-wide MLP, the per-layer input path
    ("gemma-4-e2b", QLORA_2048 | {"micro_batch": 4, "grad_ckpt": False, "loss": "chunked"}),  # the plan's on an H100
    ("gemma-4-e4b", QLORA_2048 | {"micro_batch": 2, "grad_ckpt": False, "loss": "chunked"}),
)
TOLERANCE = 0.03


def row(model: str, settings: Settings) -> dict:
    started = time.monotonic()
    traced, analytic, error = peak_gib(model, settings)
    return {
        "model": model,
        "settings": f"{settings.method} b{settings.micro_batch} s{settings.seq_len} "
        f"{'ckpt' if settings.grad_ckpt else 'no-ckpt'} {settings.lora_targets}",
        "traced_gib": round(traced, 3),
        "estimate_gib": round(analytic, 3),
        "error_pct": round(error, 2),
        "trace_seconds": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="only these models (comma-separated; default: every row)")
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    wanted = set(args.models.split(",")) if args.models else None
    rows = []
    print(f"{'model':48} {'settings':28} {'trace GiB':>9} {'estimate':>9} {'error':>7}")
    for model, values in ROWS:
        if wanted is not None and model not in wanted:
            continue
        result = row(model, Settings(**values))
        rows.append(result)
        print(
            f"{model:48} {result['settings']:28} {result['traced_gib']:9.3f} {result['estimate_gib']:9.3f} "
            f"{result['error_pct']:+6.2f}%",
            flush=True,
        )
    worst = max(abs(r["error_pct"]) for r in rows)
    print(f"worst |error| {worst:.2f}% (target: within {100 * TOLERANCE:.0f}%)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": rows, "worst_abs_error_pct": worst}, indent=2) + "\n")
    return 0 if worst <= 100 * TOLERANCE else 1


if __name__ == "__main__":
    raise SystemExit(main())
