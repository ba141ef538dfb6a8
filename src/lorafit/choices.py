"""The choices of lorafit's settings and the frozen base of its values: the bottom of the import graph.

Every module may import this one and it imports nothing of lorafit, so that the stack catalog, the serving sizes
and the option declaration can share these names without importing each other. Pure Python.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

Command = Literal["estimate", "plan", "train", "chat", "export", "gpus", "models", "stacks", "detect", "serve"]
Method = Literal["qlora", "lora", "full"]
Precision = Literal["bf16", "fp16", "fp32"]
Quant = Literal["none", "int8", "nf4"]
Optimizer = Literal["adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "sgd"]
Attention = Literal["sdpa", "flash", "eager"]
Shard = Literal["none", "ddp", "zero2", "zero3", "fsdp"]
Offload = Literal["none", "optimizer", "params"]
# the trainers whose training step lorafit estimates (src/lorafit/catalog/stacks.toml: versions, sources, facts)
Stack = Literal["lorafit", "trl", "peft-kbit", "axolotl", "llama-factory", "litgpt", "torchtune", "unsloth"]
DataFormat = Literal["alpaca", "sharegpt", "messages", "prompt_completion", "text"]
Scheduler = Literal["cosine", "linear", "constant", "constant_with_warmup"]
Batching = Literal["auto", "length_grouped", "padding_free", "random"]
Loss = Literal["full", "chunked"]
ExportTarget = Literal["merged", "gguf"]
GgufType = Literal["f32", "f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q5_k_s", "q4_k_m", "q4_k_s", "q3_k_m"]

# the memory savers and the value that turns each on (the planner searches them; a stack may lack some)
SAVER_ON: dict[str, Any] = {
    "loss": "chunked",
    "offload_embeddings": True,
    "offload_activations": True,
    "expandable_segments": True,
}


def default_quant(method: str) -> Quant:
    """The base a method trains over when quant is not set: 4-bit for qlora, 16-bit weights otherwise."""
    return "nf4" if method == "qlora" else "none"


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
