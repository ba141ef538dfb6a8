"""The linear-attention hybrid MoE families, Qwen3-Next and Qwen3.5 MoE: Qwen3.5's Gated DeltaNet / gated attention
layers with every MLP a sparse MoE block plus a sigmoid-gated shared expert. Their names and config.json, their
counts against transformers' own build, the shared expert's saved tensors, the estimate against the traced step
at full size, and `lorafit train` on tiny random models of both on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import build_on_meta, lora_trained, refused, run_cli, train_tiny
from lorafit import memory
from lorafit.memory.linear_attention import shared_expert_saved_bytes
from lorafit.models import ModelSpec, from_config_json, resolve
from lorafit.schema import Settings
from test_qwen35 import TINY_CONFIG

# Qwen3.5's shrunk text config.json (test_qwen35) with experts, for both families (their config classes' keys): two
# groups of three linear-attention layers and one full, 8 experts of which 2 per token, a shared expert wider than a
# routed one
TINY = {key: value for key, value in TINY_CONFIG.items() if key != "model_type"} | {
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}
FAMILIES = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}


def tiny_spec(tmp_path: Path, model_type: str, **changes: object) -> ModelSpec:
    (tmp_path / "config.json").write_text(json.dumps(TINY | {"model_type": model_type} | changes))
    return from_config_json(tmp_path)


# --- names and config.json ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("hub_id", "preset"),
    [
        ("Qwen/Qwen3-Next-80B-A3B-Instruct", "qwen3-next-80b-a3b"),
        ("Qwen/Qwen3-Next-80B-A3B-Thinking", "qwen3-next-80b-a3b"),
        ("unsloth/Qwen3-Next-80B-A3B-Instruct", "qwen3-next-80b-a3b"),
        ("Qwen/Qwen3.5-35B-A3B", "qwen3.5-35b-a3b"),
    ],
)
def test_the_hub_names_resolve_to_the_presets(hub_id: str, preset: str, capsys: pytest.CaptureFixture[str]) -> None:
    spec = resolve(hub_id)
    assert (spec.variant_of or spec.name) == preset and spec.is_moe and spec.linear_attention is not None
    code, out, err = run_cli(["estimate", "--model", hub_id, "--gpu", "H100"], capsys)
    assert code == 0 and not err and "GiB" in out


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_counts_equal_the_models_transformers_builds(tmp_path: Path, model_type: str) -> None:
    """Every parameter and, of the decoder's nn.Linear weights (what 4-bit packs: the shared expert and its
    hidden -> 1 gate among them, not the fused experts), the per-layer mean within rounding."""
    spec = tiny_spec(tmp_path, model_type)
    model = build_on_meta(spec)
    assert type(model).__name__ == FAMILIES[model_type]
    assert spec.num_params == model.num_parameters()
    layers = model.model.layers
    linear_weights = sum(m.weight.numel() for m in layers.modules() if type(m).__name__ == "Linear")
    assert 0 <= linear_weights - spec.quantized_linear_params < spec.num_hidden_layers
    assert "shared_expert_gate" in dict(layers[0].mlp.named_children())


@pytest.mark.parametrize("changes", [{"decoder_sparse_step": 2}, {"mlp_only_layers": [0]}], ids=["step", "dense"])
def test_a_qwen3_next_with_dense_mlp_layers_is_one_line(
    tmp_path: Path, changes: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    """Qwen3NextConfig can make some layers a dense MLP; lorafit plans every layer sparse, as every released
    checkpoint is, and says so rather than miscount."""
    (tmp_path / "config.json").write_text(json.dumps(TINY | {"model_type": "qwen3_next"} | changes))
    err = refused(["estimate", "--model", str(tmp_path)], capsys)
    assert "sparse" in err


def test_an_image_text_qwen35_moe_config_reads_as_its_text_model(tmp_path: Path) -> None:
    """A hub checkpoint's config.json (model_type qwen3_5_moe: text_config and vision_config): AutoModelForCausalLM,
    which `lorafit train` uses, builds Qwen3_5MoeForCausalLM from it, without the vision tower."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    text = TINY | {"model_type": "qwen3_5_moe_text"}
    wrapper = {"model_type": "qwen3_5_moe", "text_config": text, "vision_config": vision}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    spec = from_config_json(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**wrapper))
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    assert spec.vision is None and spec.num_params == model.num_parameters()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_lora_params_equal_the_trainable_count_of_a_peft_model(tmp_path: Path, model_type: str) -> None:
    """peft finds each adapted name in the layers that have it: Qwen3-Next's fused in_proj_qkvz, Qwen3.5 MoE's
    in_proj_qkv / in_proj_z; with `experts`, the fused experts through target_parameters."""
    spec = tiny_spec(tmp_path, model_type)
    for targets in ("all", "attn", "qv", "experts"):
        settings = Settings(method="lora", quant="none", attn="sdpa", lora_r=4, lora_targets=targets, lora_dropout=0)
        assert sum(lora_trained(spec, settings).values()) == spec.lora_params(4, targets), targets


def test_the_moe_block_terms_are_what_transformers_block_saves_for_backward() -> None:
    """transformers' own sparse MoE block with its gated shared expert (frozen bf16 weights, real tensors): each
    shared column adds its SwiGLU's 3 x 2 bytes per token, and the routed experts' terms with the shared expert's
    come to the block's saved tensors within 5 % (the router's fp32 probabilities and top-k indices, which no MoE
    term counts, are the rest: about 220 bytes a token here, under 1 % of a full-size layer's)."""
    import torch
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    hidden, width, experts, active, tokens = 256, 64, 16, 4, 256

    def saved_per_token(shared: int) -> float:
        config = Qwen3_5MoeTextConfig(
            hidden_size=hidden,
            moe_intermediate_size=width,
            shared_expert_intermediate_size=shared,
            num_experts=experts,
            num_experts_per_tok=active,
        )
        config._experts_implementation = "grouped_mm"  # as a whole model dispatches it (the estimate's MoE terms)
        block = Qwen3_5MoeSparseMoeBlock(config).to(torch.bfloat16).requires_grad_(False)
        for parameter in block.parameters():
            torch.nn.init.normal_(parameter, std=0.02)
        states = torch.randn(2, tokens // 2, hidden, dtype=torch.bfloat16, requires_grad=True)
        skip = {p.untyped_storage().data_ptr() for p in block.parameters()} | {states.untyped_storage().data_ptr()}
        saved: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.untyped_storage().data_ptr() not in skip:
                saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            block(states)
        return sum(saved.values()) / tokens

    def spec_of(shared: int) -> ModelSpec:
        spec = resolve("qwen3.5-35b-a3b")
        block = spec.linear_attention.model_dump() | {"shared_expert_intermediate_size": shared}  # type: ignore[union-attr]
        shape = {"hidden_size": hidden, "moe_intermediate_size": width, "linear_attention": block}
        return spec.scaled(**shape, num_local_experts=experts, num_experts_per_tok=active)

    settings = Settings(method="qlora", quant="nf4", attn="sdpa")
    slope = (saved_per_token(96) - saved_per_token(32)) / 64
    assert slope == 3 * 2
    parts = memory.activation_parts_per_token(spec_of(96), settings, memory.Runtime())
    moe = parts["gated_act"] + parts["expert_outputs"] + parts["shared_expert"]
    assert moe == pytest.approx(saved_per_token(96), rel=0.05)
    assert parts["shared_expert"] == shared_expert_saved_bytes(spec_of(96), settings, slope) > 6 * 96


# --- the estimate against the traced step ---------------------------------------------------------------------
@pytest.mark.parametrize("hub_id", ["Qwen/Qwen3-Next-80B-A3B-Instruct", "Qwen/Qwen3.5-35B-A3B"])
def test_qlora_at_2048_tokens_is_within_3_percent_of_the_full_size_trace(hub_id: str) -> None:
    """Issue 27's acceptance case: QLoRA, one row of 2048 tokens, the real shapes on fake tensors, traced in whole
    groups of layers (make bench-hybrid prints it with checkpointing off too)."""
    from lorafit.trace import exact_estimate

    spec = resolve(hub_id)
    settings = Settings(method="qlora", quant="nf4", micro_batch=1, seq_len=2048, attn="sdpa")
    traced = exact_estimate(spec, settings).peak_allocated_gib
    analytic = memory.estimate(spec, settings).peak_allocated_gib
    assert analytic == pytest.approx(traced, rel=0.03), f"analytic {analytic} GiB, traced {traced} GiB"


# --- lorafit train on tiny random models ----------------------------------------------------------------------
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_train_runs_a_step_on_a_tiny_hybrid_moe(
    tmp_path: Path, model_type: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """LoRA steps on the CPU (transformers' PyTorch DeltaNet path and its experts' loop); the adapter holds both
    layer kinds' projections."""
    run, _ = train_tiny(tmp_path, lambda vocab: tiny_spec(tmp_path, model_type).scaled(vocab_size=vocab), capsys)
    adapter = json.loads((run / "adapter_config.json").read_text())
    mixer = {"in_proj_qkvz"} if model_type == "qwen3_next" else {"in_proj_qkv", "in_proj_z"}
    assert {"q_proj", "o_proj", "out_proj"} | mixer <= set(adapter["target_modules"])
