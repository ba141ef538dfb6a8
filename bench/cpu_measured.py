"""Measured rows for bench/memory_accuracy.py: real training steps on this machine's CPU.

Each row builds a small Llama-style model from a random config, saves it, loads it the way `lorafit train` does
(real bitsandbytes 4-bit on the CPU, real peft, the optimizer transformers' Trainer builds) and runs two real
training steps under lorafit's live-tensor tracker (`lorafit.trace.real_step`). `measured_allocated_bytes` is
the peak of live tensor bytes - what `torch.cuda.max_memory_allocated()` reports on a GPU, without the
allocator's 512-byte rounding. The steps run CPU kernels, so the rows carry `runtime: {"device": "cpu"}` (the
CPU dropout keeps a float mask, CUDA a bool one).

    python bench/cpu_measured.py        # prints the rows as JSON lines
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lorafit.models import ModelSpec, resolve  # noqa: E402
from lorafit.schema import Settings  # noqa: E402


def llama(
    hidden: int,
    layers: int,
    vocab: int,
    heads: int = 4,
    kv_heads: int = 2,
    inter: int | None = None,
    name: str = "llama-2-7b",
) -> ModelSpec:
    """A random Llama-style shape: `heads` of hidden/heads, SwiGLU MLP of ~2.7 x hidden unless given."""
    return resolve(name).scaled(
        hidden_size=hidden,
        num_hidden_layers=layers,
        vocab_size=vocab,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=inter or (hidden * 8 // 3 // 64 + 1) * 64,
    )


# (label, model, settings): QLoRA and LoRA (and full), checkpointing on and off, several micro-batches, sequence
# lengths, vocabularies, ranks and optimizers. Each runs in a few seconds on two cores.
ROWS: list[tuple[str, ModelSpec, Settings]] = [
    ("qlora ckpt r16", llama(256, 2, 2048), Settings(method="qlora", lora_r=16, micro_batch=2, seq_len=256)),
    (
        "qlora no-ckpt r8 vocab 8k",
        llama(256, 2, 8192),
        Settings(method="qlora", lora_r=8, micro_batch=1, seq_len=256, grad_ckpt=False),
    ),
    ("qlora ckpt r64 batch 4", llama(192, 3, 1024), Settings(method="qlora", lora_r=64, micro_batch=4, seq_len=128)),
    (
        "qlora no-double-quant 8-bit AdamW",
        llama(256, 2, 4096),
        Settings(
            method="qlora", double_quant=False, optimizer="adamw_8bit", micro_batch=2, seq_len=192, grad_ckpt=False
        ),
    ),
    (
        "qlora q/v targets long sequence",
        llama(128, 2, 1024),
        Settings(method="qlora", lora_targets="qv", micro_batch=1, seq_len=1024),
    ),
    ("qlora accumulation 2", llama(256, 2, 2048), Settings(method="qlora", micro_batch=2, seq_len=128, grad_accum=2)),
    ("lora ckpt r16", llama(256, 2, 2048), Settings(method="lora", quant="none", micro_batch=2, seq_len=256)),
    (
        "lora no-ckpt attn targets",
        llama(320, 2, 4096, heads=5, kv_heads=5),
        Settings(method="lora", quant="none", lora_targets="attn", micro_batch=2, seq_len=128, grad_ckpt=False),
    ),
    (
        "lora no-ckpt r4 vocab 16k",
        llama(192, 2, 16384),
        Settings(method="lora", quant="none", lora_r=4, micro_batch=1, seq_len=256, grad_ckpt=False),
    ),
    (
        "lora dropout 0 batch 4",
        llama(256, 3, 1024),
        Settings(method="lora", quant="none", lora_dropout=0.0, micro_batch=4, seq_len=128, grad_ckpt=False),
    ),
    ("full ckpt AdamW", llama(192, 2, 2048), Settings(method="full", quant="none", micro_batch=2, seq_len=128)),
    (
        "full no-ckpt 8-bit AdamW",
        llama(256, 2, 4096),
        Settings(method="full", quant="none", optimizer="adamw_8bit", micro_batch=1, seq_len=256, grad_ckpt=False),
    ),
]


def save_random_model(spec: ModelSpec, settings: Settings, folder: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from lorafit.train import build

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build.hf_config(spec, settings), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def measure_rows() -> list[dict]:
    """One dict per row: the ModelSpec and Settings (as dicts), the runtime, and the measured peak."""
    import torch

    from lorafit.trace import real_step

    torch.set_num_threads(2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, (label, spec, settings) in enumerate(ROWS):
            folder = save_random_model(spec, settings, Path(tmp) / f"model-{index}")
            started = time.perf_counter()
            measured = real_step(folder, spec, settings)
            rows.append(
                {
                    "name": label,
                    "spec": spec.model_dump(mode="json"),
                    "settings": settings.model_dump(mode="json"),
                    "runtime": {"device": "cpu", "fused_optimizer": True},
                    "measured_allocated_bytes": measured.peak_bytes,
                    "peak_phase": measured.peak_description,
                    "breakdown_bytes": measured.breakdown,
                    "seconds": round(time.perf_counter() - started, 2),
                }
            )
    return rows


if __name__ == "__main__":
    for row in measure_rows():
        print(json.dumps(row))
