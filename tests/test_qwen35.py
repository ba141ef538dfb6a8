"""Qwen3.5's text model, a hybrid of Gated DeltaNet linear attention and gated full attention: its config.json,
its counts against transformers' own build, the estimate against the traced step, and `lorafit train` on a tiny
random model of it, on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import build_on_meta, lora_trained, refused, train_tiny
from lorafit import memory
from lorafit.errors import InvalidConfig
from lorafit.linear_attention import LinearAttention
from lorafit.memory.linear_attention import deltanet_saved_bytes
from lorafit.models import ModelSpec, from_config_json, resolve
from lorafit.schema import Settings

# A Qwen3.5 text config.json shrunk to 8 layers (two groups of three linear-attention layers and one full), with
# more value heads than key heads as every released size has (Qwen3_5TextConfig's keys)
TINY_CONFIG = {
    "model_type": "qwen3_5_text",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "tie_word_embeddings": False,
}


def tiny_spec(tmp_path: Path, **changes: object) -> ModelSpec:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG | changes))
    return from_config_json(tmp_path)


# --- config.json and counts -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "changes",
    [{}, {"layer_types": ["linear_attention"] * 3 + ["full_attention"]} | {"num_hidden_layers": 4}],
    ids=["interval", "layer_types"],
)
def test_counts_equal_the_models_transformers_builds(tmp_path: Path, changes: dict) -> None:
    spec = tiny_spec(tmp_path, **changes)
    model = build_on_meta(spec)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert spec.num_params == model.num_parameters()
    linear_weights = sum(m.weight.numel() for n, m in model.named_modules() if type(m).__name__ == "Linear")
    lm_head = spec.vocab_size * spec.hidden_size
    # the mean over layers, rounded down: within one weight a layer of the exact sum
    assert 0 <= linear_weights - lm_head - spec.quantized_linear_params < spec.num_hidden_layers


def test_an_image_text_config_reads_as_the_text_model_the_trainer_loads(tmp_path: Path) -> None:
    """A hub checkpoint's config.json (model_type qwen3_5, text_config and vision_config): AutoModelForCausalLM,
    which `lorafit train` uses, builds Qwen3_5ForCausalLM from it, without the vision tower."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    wrapper = {"model_type": "qwen3_5", "text_config": TINY_CONFIG, "vision_config": vision}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    spec = from_config_json(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**wrapper))
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert spec.vision is None and spec.num_params == model.num_parameters()


def test_lora_params_equal_the_trainable_count_of_a_peft_model(tmp_path: Path) -> None:
    """LoRA on the full-attention layers' q/k/v/o and the linear-attention layers' in_proj_qkv / in_proj_z /
    out_proj, and the MLP in every layer: peft finds each name in the layers that have it."""
    spec = tiny_spec(tmp_path)
    for targets in ("all", "attn", "qv"):
        settings = Settings(method="lora", quant="none", attn="sdpa", lora_r=4, lora_targets=targets)
        assert sum(lora_trained(spec, settings).values()) == spec.lora_params(4, targets), targets


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"layer_types": ["full_attention", "linear_attention"] * 4}, "one full-attention layer in every"),
        ({"linear_num_value_heads": 3}, "multiple of linear_num_key_heads"),
        ({"linear_conv_kernel_dim": 0}, "linear-attention key"),
    ],
    ids=["irregular", "heads", "kernel"],
)
def test_a_hybrid_config_lorafit_cannot_model_is_one_line(
    tmp_path: Path, changes: dict, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(InvalidConfig, match=words):
        tiny_spec(tmp_path, **changes)
    err = refused(["estimate", "--model", str(tmp_path)], capsys)
    assert words in err


def test_the_hub_names_resolve() -> None:
    assert resolve("Qwen/Qwen3.5-27B").name == "qwen3.5-27b"
    copy = resolve("unsloth/Qwen3.5-27B-bnb-4bit")
    assert copy.prequantized is not None and copy.prequantized.base == "Qwen/Qwen3.5-27B"


# --- the estimate against the traced step ---------------------------------------------------------------------
def small_hybrid(layers: int, interval: int = 4) -> ModelSpec:
    block = LinearAttention(
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        full_attention_interval=interval,
    )
    shape = dict(hidden_size=512, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    return ModelSpec(
        name="qwen3.5-small",
        architecture="qwen3_5_text",
        num_hidden_layers=layers,
        vocab_size=2048,
        max_position_embeddings=4096,
        linear_attention=block,
        **shape,
    )


@pytest.mark.parametrize("ckpt", [True, False], ids=["ckpt", "no-ckpt"])
def test_small_hybrid_estimate_is_within_5_percent_of_the_trace(ckpt: bool) -> None:
    """Four layers (three DeltaNet, one gated attention), traced whole on fake CUDA tensors."""
    from lorafit.trace.api import trace_step

    spec = small_hybrid(4)
    settings = Settings(method="qlora", quant="nf4", micro_batch=2, seq_len=256, grad_ckpt=ckpt, attn="sdpa")
    traced = trace_step(spec, settings, device="cuda").peak_bytes
    analytic = sum(memory.breakdown(spec, settings, memory.Runtime())[0].values())
    assert analytic == pytest.approx(traced, rel=0.05), f"analytic {analytic / 2**20:.2f}, traced {traced / 2**20:.2f}"


def test_qlora_at_2048_tokens_is_within_3_percent_of_the_full_size_trace() -> None:
    """The acceptance case of issue 27 for Qwen3.5-27B: QLoRA, one row of 2048 tokens, the real shapes on fake
    tensors, traced in whole groups of layers (make bench-hybrid prints it with checkpointing off too)."""
    from lorafit.trace import exact_estimate

    spec = resolve("Qwen/Qwen3.5-27B")
    settings = Settings(method="qlora", quant="nf4", micro_batch=1, seq_len=2048, attn="sdpa")
    traced = exact_estimate(spec, settings).peak_allocated_gib
    analytic = memory.estimate(spec, settings).peak_allocated_gib
    assert analytic == pytest.approx(traced, rel=0.03), f"analytic {analytic} GiB, traced {traced} GiB"


def test_the_deltanet_term_is_what_transformers_block_saves_for_backward() -> None:
    """transformers' own Gated DeltaNet block (its PyTorch path, frozen bf16 weights), run on real tensors: the
    distinct tensors autograd saves, weights aside, come to the estimate's DeltaNet term per token within 1 %."""
    import torch
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    spec = small_hybrid(1, interval=1000)
    block = spec.linear_attention
    assert block is not None
    keys = {key: getattr(block, key) for key in LinearAttention.model_fields if key != "full_attention_interval"}
    config = Qwen3_5TextConfig(hidden_size=spec.hidden_size, num_hidden_layers=1, **keys)
    module = Qwen3_5GatedDeltaNet(config, 0).to(torch.bfloat16).requires_grad_(False)
    hidden = torch.randn(2, 256, spec.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()} | {hidden.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(hidden, attention_mask=torch.ones(2, 256, dtype=torch.long))
    settings = Settings(method="qlora", quant="nf4", micro_batch=2, seq_len=256, attn="sdpa")
    per_token = sum(saved.values()) / settings.tokens_per_micro_batch
    assert deltanet_saved_bytes(spec, settings) == pytest.approx(per_token, rel=0.01)


# --- lorafit train on a tiny random model ---------------------------------------------------------------------
def test_train_runs_a_step_on_a_tiny_hybrid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """QLoRA-free LoRA steps on the CPU (transformers' PyTorch DeltaNet path, no fla / causal-conv1d); the adapter
    holds both layer kinds' projections."""
    run, _ = train_tiny(tmp_path, lambda vocab: tiny_spec(tmp_path).scaled(vocab_size=vocab), capsys)
    adapter = json.loads((run / "adapter_config.json").read_text())
    assert {"q_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "down_proj"} <= set(adapter["target_modules"])


# --- the time model's DeltaNet term ---------------------------------------------------------------------------
def test_chunk_flops_are_the_matmuls_torch_counts_plus_the_triangular_solves() -> None:
    """torch's FLOP counter over transformers' chunked gated delta rule counts its batched matmuls (not the two
    triangular solves, C (dk + dv) per head and token by the derivation): the time model's term is both."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from lorafit.linear_attention import chunk_flops_per_token

    block = LinearAttention(
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
    )
    tokens, heads = 256, block.linear_num_value_heads
    query, key = (torch.randn(1, tokens, 2, 64) for _ in range(2))
    value, decay, beta = torch.randn(1, tokens, heads, 32), -torch.rand(1, tokens, heads), torch.rand(1, tokens, heads)
    with FlopCounterMode(display=False) as counter:
        torch_chunk_gated_delta_rule(query, key, value, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
    solves = heads * 64 * (64 + 32)
    assert counter.get_total_flops() == (chunk_flops_per_token(block) - solves) * tokens
