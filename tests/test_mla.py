"""DeepSeek-style models (src/lorafit/mla.py): multi-head latent attention, shared experts and dense first layers,
counted against transformers' own build, estimated against the traced step, and trained on a tiny random copy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import build_on_meta, lora_trained, refused, run_cli, train_tiny
from lorafit import memory
from lorafit.errors import InvalidConfig
from lorafit.models import ModelSpec, catalog, from_config_json, resolve
from lorafit.schema import Settings

# DeepSeek-V2-Lite-Chat's config.json (the keys that set its shapes), as the hub has it: q_lora_rank null (one
# q_proj), YaRN positions
V2_LITE_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 102400,
    "max_position_embeddings": 163840,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "norm_topk_prob": False,
    "tie_word_embeddings": False,
}


def tiny_deepseek(name: str = "deepseek-v2-lite", vocab_size: int = 512) -> ModelSpec:
    """A DeepSeek-style preset shrunk to 5 blocks (one dense, four of 16 routed experts, 2 per token, and a shared
    one). As many MoE blocks as that keep its saved folder (transformers writes each expert's tensors apart) below
    model_files.SAME_NAMING, as every real checkpoint of these families is, so the load is left to transformers."""
    spec = catalog()[name]
    assert spec.latent is not None
    latent = spec.latent.model_dump() | {
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
    }
    if latent["q_lora_rank"] is not None:
        latent["q_lora_rank"] = 48
    return spec.scaled(
        num_hidden_layers=5,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=24,
        vocab_size=vocab_size,
        num_local_experts=16,  # DeepSeek-V3's router scores 8 groups (n_group) by their top 2 experts each
        num_experts_per_tok=2,
        latent=latent,
    )


# --- names and config.json ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("hub_id", "preset"),
    [
        ("deepseek-ai/DeepSeek-V2-Lite", "deepseek-v2-lite"),
        ("deepseek-ai/DeepSeek-V2-Lite-Chat", "deepseek-v2-lite"),
        ("deepseek-ai/DeepSeek-V3", "deepseek-v3"),
        ("deepseek-ai/DeepSeek-R1", "deepseek-v3"),
        ("deepseek-ai/DeepSeek-R1-0528", "deepseek-v3"),
        ("mistralai/Mistral-Small-4-119B-2603", "mistral-small-4-119b"),
    ],
)
def test_the_names_people_type_resolve(hub_id: str, preset: str) -> None:
    spec = resolve(hub_id)
    assert spec.hf_id == hub_id and spec.is_moe and spec.latent is not None
    assert spec.num_params == catalog()[preset].num_params


def test_total_and_active_counts_match_the_model_cards() -> None:
    """DeepSeek-V2-Lite: 15.7B total, 2.4B active (arXiv 2405.04434); DeepSeek-V3: 671B total, 37B active
    (without the multi-token-prediction module); active counted here with the embedding and the head."""
    lite, v3 = resolve("deepseek-v2-lite"), resolve("deepseek-v3")
    assert lite.num_params / 1e9 == pytest.approx(15.7, abs=0.05)
    outside = lite.embedding_params + lite.lm_head_params
    assert (lite.active_params - outside) / 1e9 == pytest.approx(2.4, abs=0.2)
    assert v3.num_params / 1e9 == pytest.approx(671, abs=0.5)
    assert v3.active_params / 1e9 == pytest.approx(37, abs=1)


def test_a_config_json_reads_as_the_preset(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(V2_LITE_CONFIG))
    spec = from_config_json(tmp_path)
    preset = resolve("deepseek-v2-lite")
    assert spec.latent == preset.latent and spec.head_size == 192
    assert spec.num_params == preset.num_params and spec.num_local_experts == 64


def test_a_bad_latent_key_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(V2_LITE_CONFIG | {"kv_lora_rank": -1}))
    with pytest.raises(InvalidConfig, match="kv_lora_rank") as error:
        from_config_json(tmp_path)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3", "mistral-small-4-119b"])
def test_counts_equal_the_meta_device_build(name: str) -> None:
    """Every parameter, and the nn.Linear weights bitsandbytes packs (the shared experts' and the dense first
    blocks' MLPs, the latent projections; not the fused routed experts, nor the fp32 router)."""
    import torch

    spec = resolve(name)
    model = build_on_meta(spec)
    assert model.num_parameters() == spec.num_params
    linears = sum(
        module.weight.numel() for module in model.model.layers.modules() if isinstance(module, torch.nn.Linear)
    )
    assert linears == spec.quantized_linear_params


@pytest.mark.parametrize("targets", ["all", "attn", "qv", "experts"])
@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3", "mistral-small-4-119b"])
def test_lora_params_equal_the_trainable_count_of_a_peft_model(name: str, targets: str) -> None:
    """The latent projections LoRA adapts (q_proj, or q_a_proj and q_b_proj; kv_a_proj_with_mqa, kv_b_proj,
    o_proj), counted as peft builds them; `experts` adds the routed experts of the MoE blocks."""
    spec = tiny_deepseek(name).scaled(num_hidden_layers=2)
    settings = Settings(method="lora", quant="none", attn="eager", lora_r=4, lora_targets=targets, lora_dropout=0.0)
    trainable = sum(lora_trained(spec, settings).values())
    assert trainable == spec.lora_params(4, targets) > 0


# --- the estimate against the traced step ---------------------------------------------------------------------
def test_qlora_at_2048_tokens_is_within_3_percent_of_the_full_size_trace() -> None:
    """The acceptance case: DeepSeek-V2-Lite QLoRA, one row of 2048 tokens, the real shapes on fake tensors
    (the trace runs CUDA's memory-efficient attention, which takes values narrower than keys)."""
    from lorafit.trace import exact_estimate

    spec = resolve("deepseek-v2-lite")
    for ckpt in (True, False):
        settings = Settings(method="qlora", quant="nf4", micro_batch=1, seq_len=2048, attn="sdpa", grad_ckpt=ckpt)
        traced = exact_estimate(spec, settings).peak_allocated_gib
        analytic = memory.estimate(spec, settings).peak_allocated_gib
        assert analytic == pytest.approx(traced, rel=0.03), f"ckpt {ckpt}: analytic {analytic}, traced {traced}"


def test_exact_on_deepseek_v3_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """--exact traces 2 and 3 blocks and extrapolates: DeepSeek-V3's first 3 blocks are dense, so it says why not."""
    err = refused(["estimate", "--model", "deepseek-ai/DeepSeek-V3", "--exact"], capsys)
    assert "dense" in err


def test_the_671b_model_does_not_fit_one_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        ["plan", "--model", "deepseek-ai/DeepSeek-R1", "--gpu", "H100", "--method", "qlora"], capsys
    )
    assert code == 0, err
    assert "does not fit" in out


# --- lorafit train on a tiny random model ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3", "mistral-small-4-119b"])
def test_train_adapts_the_latent_attention_and_exports_merged(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, spec = train_tiny(tmp_path, lambda vocab: tiny_deepseek(name, vocab_size=vocab), capsys)
    adapter = json.loads((run / "adapter_config.json").read_text())
    assert set(adapter["target_modules"]) == set(spec.lora_target_names("all"))
    assert {"kv_a_proj_with_mqa", "kv_b_proj"} < set(adapter["target_modules"])
    code, _, err = run_cli(["export", str(run), "--to", "merged", "-o", str(tmp_path / "merged")], capsys)
    assert code == 0, err
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    # --to gguf (llama.cpp's deepseek2, or mistral4) is test_export_gguf_mla.py's
