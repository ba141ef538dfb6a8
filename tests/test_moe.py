"""Mixture-of-experts families (Qwen3-MoE, gpt-oss; Mixtral beside them): their names, their config.json, the
estimate against the traced step at small shapes, and `lorafit train` on tiny random models of each, on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import lora_trained, merged_changes, randomize_lora_b, refused, run_cli, run_train, train_tiny
from lorafit import memory
from lorafit.errors import InvalidConfig
from lorafit.models import ModelSpec, catalog, from_config_json, resolve
from lorafit.schema import Settings

MOE_PRESETS = ["qwen3-30b-a3b", "gpt-oss-20b", "mixtral-8x7b"]


def tiny_moe(name: str, vocab_size: int = 512) -> ModelSpec:
    """A catalog MoE shrunk to 2 layers of 4 experts (2 per token), keeping its family's traits."""
    spec = catalog()[name]
    shape: dict = dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=vocab_size,
        max_position_embeddings=spec.max_position_embeddings,  # gpt-oss's YaRN factor is 131072 / 4096
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    if spec.moe_intermediate_size is not None:
        shape["moe_intermediate_size"] = 48
    return spec.scaled(**shape)


# --- names and config.json ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("hub_id", "preset", "positions"),
    [
        ("openai/gpt-oss-20b", "gpt-oss-20b", 131072),
        ("openai/gpt-oss-120b", "gpt-oss-120b", 131072),
        ("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b", 40960),
        ("Qwen/Qwen3-30B-A3B-Instruct-2507", "qwen3-30b-a3b", 262144),
        ("Qwen/Qwen3-235B-A22B", "qwen3-235b-a22b", 40960),
    ],
)
def test_the_names_people_type_resolve(hub_id: str, preset: str, positions: int) -> None:
    spec = resolve(hub_id)
    assert spec.hf_id == hub_id and spec.is_moe
    assert spec.num_params == catalog()[preset].num_params
    assert spec.max_position_embeddings == positions


def test_total_and_active_counts_match_the_model_cards() -> None:
    """Qwen3-30B-A3B: "30.5B in total and 3.3B activated"; Qwen3-235B-A22B: 235B / 22B; gpt-oss (arXiv 2508.10925,
    table 1): 20.91B and 116.83B total, 3.61B and 5.13B active without the 0.58B embedding table."""
    assert round(resolve("qwen3-30b-a3b").num_params / 1e8) == 305
    assert round(resolve("qwen3-30b-a3b").active_params / 1e8) == 34  # 3.35B: the card rounds down
    assert round(resolve("qwen3-235b-a22b").active_params / 1e9) == 22
    for name, total, active in (("gpt-oss-20b", 20.91e9, 3.61e9), ("gpt-oss-120b", 116.83e9, 5.13e9)):
        spec = resolve(name)
        assert spec.num_params == pytest.approx(total, rel=1e-3)
        assert spec.active_params - spec.embedding_params == pytest.approx(active, rel=0.01)


QWEN3_30B_A3B_CONFIG = {  # the keys of Qwen/Qwen3-30B-A3B's config.json that shape the model
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
}


def test_a_qwen3_moe_config_json_reads_its_expert_count_and_width(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B_CONFIG))
    spec = from_config_json(tmp_path)
    assert (spec.num_local_experts, spec.mlp_width, spec.norm_topk_prob) == (128, 768, True)
    assert spec.num_params == resolve("qwen3-30b-a3b").num_params


@pytest.mark.parametrize("dense", [{"mlp_only_layers": [0, 47]}, {"decoder_sparse_step": 2}])
def test_a_qwen3_moe_config_with_dense_layers_is_one_line(tmp_path: Path, dense: dict) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B_CONFIG | dense))
    with pytest.raises(InvalidConfig, match="dense MLP .* not modelled") as error:
        from_config_json(tmp_path)
    assert "\n" not in str(error.value)


def test_gpt_oss_plans_with_eager_attention_and_refuses_sdpa(capsys: pytest.CaptureFixture[str]) -> None:
    """transformers 5.25 has no sdpa path for gpt-oss (GptOssPreTrainedModel._supports_sdpa = False)."""
    assert "sdpa" not in resolve("gpt-oss-20b").attention_implementations
    code, out, err = run_cli(["estimate", "--model", "openai/gpt-oss-20b", "--attn", "sdpa"], capsys)
    assert code == 2 and err.count("\n") == 1 and "sdpa" in err


# --- the estimate against the traced step ---------------------------------------------------------------------
@pytest.mark.parametrize("ckpt", [True, False], ids=["ckpt", "no-ckpt"])
@pytest.mark.parametrize("name", MOE_PRESETS)
def test_small_moe_estimate_is_within_5_percent_of_the_trace(name: str, ckpt: bool) -> None:
    from lorafit.trace import trace_depth

    spec = tiny_moe(name, vocab_size=2048).scaled(hidden_size=256, head_dim=64, intermediate_size=256)
    attn = "sdpa" if "sdpa" in spec.attention_implementations else spec.attention_implementations[0]
    settings = Settings(method="qlora", quant="nf4", micro_batch=2, seq_len=256, grad_ckpt=ckpt, attn=attn)
    runtime = memory.Runtime(device="cpu")
    traced = trace_depth(spec, settings, device="cpu").peak_bytes
    analytic = sum(memory.breakdown(spec, settings, runtime)[0].values())
    assert analytic == pytest.approx(traced, rel=0.05), f"analytic {analytic / 2**20:.2f}, traced {traced / 2**20:.2f}"


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_qlora_at_2048_tokens_is_within_3_percent_of_the_full_size_trace(name: str) -> None:
    """The acceptance case of issue 27: QLoRA, one row of 2048 tokens, the real shapes on fake tensors."""
    from lorafit.trace import exact_estimate

    spec = resolve(name)
    attn = "sdpa" if "sdpa" in spec.attention_implementations else spec.attention_implementations[0]
    settings = Settings(method="qlora", quant="nf4", micro_batch=1, seq_len=2048, attn=attn)
    traced = exact_estimate(spec, settings).peak_allocated_gib
    analytic = memory.estimate(spec, settings).peak_allocated_gib
    assert analytic == pytest.approx(traced, rel=0.03), f"analytic {analytic} GiB, traced {traced} GiB"


# --- lorafit train and export on tiny random models -----------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b"])
def test_train_adapts_the_attention_and_exports_merged(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """QLoRA on a 2-layer, 4-expert model of the family; the adapter holds attention projections only (peft's
    `target_parameters` wrapper, the one way to reach fused experts, refuses lora_dropout); the merged folder is
    checked against base + adapter by the export itself."""
    run, _ = train_tiny(tmp_path, lambda vocab: tiny_moe(name, vocab), capsys)
    adapter = json.loads((run / "adapter_config.json").read_text())
    assert set(adapter["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}

    # GGUF: tests/test_export_gguf_moe.py, on a router decisive enough that f16 rounding flips no expert choice
    code, _, err = run_cli(["export", str(run), "--to", "merged", "-o", str(tmp_path / "merged")], capsys)
    assert code == 0, err
    assert (tmp_path / "merged" / "model.safetensors").is_file()


# --- LoRA on the experts (lora_targets experts) ---------------------------------------------------------------
@pytest.mark.parametrize("name", MOE_PRESETS)
def test_expert_lora_params_equal_the_trainable_count_of_a_peft_model(name: str) -> None:
    """peft's target_parameters gives each adapted 3-D expert parameter an A (r x in) and a B (out x r) per expert."""
    spec = tiny_moe(name)
    attn = "sdpa" if "sdpa" in spec.attention_implementations else "eager"
    settings = Settings(method="lora", quant="none", attn=attn, lora_r=4, lora_targets="experts", lora_dropout=0.0)
    trainable = sum(lora_trained(spec, settings).values())
    assert trainable == spec.lora_params(4, "experts") > spec.lora_params(4, "attn")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--model", "qwen3-30b-a3b", "--lora-targets", "experts"], "lora_dropout 0"),
        (["--model", "llama-3.1-8b", "--lora-targets", "experts", "--lora-dropout", "0"], "lora_targets all"),
    ],
    ids=["dropout", "dense"],
)
def test_expert_targets_the_stack_cannot_apply_are_one_line(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(["estimate", *args], capsys)
    assert words in err


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b"])
def test_expert_lora_estimate_is_within_3_percent_of_the_full_size_trace(name: str) -> None:
    """With the experts adapted, each layer's backward holds its merged expert weights (W + B A)."""
    from lorafit.trace import exact_estimate

    spec = resolve(name)
    attn = "sdpa" if "sdpa" in spec.attention_implementations else spec.attention_implementations[0]
    settings = Settings(method="qlora", quant="nf4", seq_len=2048, attn=attn, lora_targets="experts", lora_dropout=0)
    traced = exact_estimate(spec, settings).peak_allocated_gib
    analytic = memory.estimate(spec, settings).peak_allocated_gib
    assert analytic == pytest.approx(traced, rel=0.03), f"analytic {analytic} GiB, traced {traced} GiB"
    attention_only = memory.estimate(spec, settings.model_copy(update={"lora_targets": "all"})).peak_allocated_gib
    assert analytic > attention_only + spec.expert_params * 2 / 2**30 / spec.num_hidden_layers


# --- time: the traced op list ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MOE_PRESETS)
def test_traced_matmul_flops_are_two_per_active_weight_per_token_per_pass(name: str) -> None:
    """The router, the attention projections and the k routed experts' grouped matmuls: forward, recomputation
    and input gradients, as timing.base_matmul_seconds counts them (the head: forward and input gradient)."""
    from lorafit import timing
    from lorafit.trace.optime import trace_ops

    spec = tiny_moe(name)
    attn = "sdpa" if "sdpa" in spec.attention_implementations else spec.attention_implementations[0]
    settings = Settings(method="qlora", quant="nf4", micro_batch=2, seq_len=64, attn=attn, grad_ckpt=True)
    traced = sum(op.flops for op in trace_ops(spec, settings) if op.category == "matmul")
    weights = timing.layer_matmul_params(spec) * 3 + timing.head_params(spec) * 2
    assert traced == pytest.approx(2 * settings.tokens_per_micro_batch * weights, rel=0.02)


# --- gpt-oss's MXFP4 checkpoints ------------------------------------------------------------------------------
def save_mxfp4_experts(model_dir: Path) -> None:
    """Rewrite a saved gpt-oss folder as the hub ships it: each expert parameter as MXFP4 blocks (two 4-bit
    values a byte, 32 to a block) and one shared exponent a block (transformers' Mxfp4Deserialize layout)."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(model_dir / "model.safetensors")
    packed = {}
    for name, tensor in weights.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, fan_in, fan_out = tensor.shape
            packed[name + "_blocks"] = torch.randint(0, 256, (experts, fan_out, fan_in // 32, 16), dtype=torch.uint8)
            packed[name + "_scales"] = torch.full((experts, fan_out, fan_in // 32), 120, dtype=torch.uint8)
        else:
            packed[name] = tensor
    save_file(packed, model_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (model_dir / "config.json").write_text(json.dumps(config))


def test_an_mxfp4_gpt_oss_trains_with_lora_on_bf16_experts_and_refuses_qlora(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lorafit.train.demo import build_model, build_tokenizer, corpus

    tokenizer = build_tokenizer(corpus(), vocab_size=512)
    build_model(tmp_path / "model", tokenizer, tiny_moe("gpt-oss-20b", len(tokenizer)), seed=0, dtype="bfloat16")
    save_mxfp4_experts(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"instruction": "hi", "input": "", "output": "hello " * n}) + "\n" for n in range(1, 9))
    )
    args = ["train", "--model", str(tmp_path / "model"), "--data", str(data), "--max-steps", "1", "--micro-batch", "2"]
    code, _, err = run_cli([*args, "--method", "qlora", "--output-dir", str(tmp_path / "qlora")], capsys)
    assert code == 2 and err.count("\n") == 1 and "MXFP4" in err and "--method lora" in err
    code, _, err = run_cli([*args, "--method", "lora", "--output-dir", str(tmp_path / "lora")], capsys)
    assert code == 0, err
    assert (tmp_path / "lora" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b"])
def test_an_expert_adapter_trains_and_merges_into_the_saved_experts(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--lora-targets experts end to end. transformers saves Qwen3-MoE's experts one tensor per expert and
    projection (experts.N.gate_proj ...) and gpt-oss's fused and transposed (experts x in x out): the merge
    writes B A into either layout, and the export's own check compares the merged model's logits with base +
    adapter run by peft. The adapter's B matrices are made random first, so the check sees a real update."""
    from lorafit.train.demo import build_model, build_tokenizer, corpus

    tokenizer = build_tokenizer(corpus(), vocab_size=512)
    build_model(tmp_path / "model", tokenizer, tiny_moe(name, len(tokenizer)), seed=0)
    rows = [{"instruction": "hi", "input": "", "output": "yo " * n} for n in range(1, 9)]
    flags = ["--max-steps", "1", "--micro-batch", "2", "--lora-targets", "experts", "--lora-dropout", "0"]
    run = run_train(tmp_path, rows, capsys, *flags)
    adapter = json.loads((run / "adapter_config.json").read_text())
    assert sorted(adapter["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]  # a set

    randomize_lora_b(run)
    changed = [key for key in merged_changes(tmp_path, capsys)[1] if "experts" in key]
    assert changed and all(".mlp.experts." in key for key in changed)


def test_the_plan_says_what_the_experts_are(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["plan", "--model", "openai/gpt-oss-20b", "--gpu", "H100", "--json"], capsys)
    assert code == 0
    reasons = " ".join(json.loads(out)["reasons"])
    assert "32 experts a layer, 4 per token, held in 16 bit" in reasons and "--lora-targets experts" in reasons
    assert json.loads(out)["settings"]["attn"] == "eager"
