"""GGUF export of the linear-attention hybrid MoE families, Qwen3.5 MoE's text model as llama.cpp's qwen35moe and
Qwen3-Next as its qwen3next: Qwen3.5's DeltaNet and gated attention layers (export/gguf_hybrid.py; Qwen3-Next's fused
in_proj_qkvz / in_proj_ba as ssm_in / ssm_beta_alpha, value heads left grouped) with Qwen3-MoE's experts, the shared
expert (ffn_*_shexp, its width as expert_shared_feed_forward_length) and its hidden -> 1 gate squeezed to llama.cpp's
ffn_gate_inp_shexp vector give llama.cpp the logits of transformers; trained runs export end to end through the
export's own check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import export_checked, randomize_lora_b, run_train, word_rows
from lorafit.models import resolve

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is the [gguf] extra")

from test_export_gguf import f32_logit_gap  # noqa: E402
from test_export_gguf_qwen35 import tiny_qwen35  # noqa: E402
from test_qwen35 import small_hybrid  # noqa: E402

# The families and the tensors only their GGUF files have
FAMILIES = {
    "qwen3_5_moe_text": ("qwen35moe", {"blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.0.ssm_beta.weight"}),
    "qwen3_next": ("qwen3next", {"blk.0.ssm_in.weight", "blk.0.ssm_ba.weight"}),
}


# Four layers (three DeltaNet with twice as many value heads as key heads, one gated attention), 8 experts of which
# 2 per token and a shared expert 96 wide
MOE = dict(moe_intermediate_size=64, shared_expert_intermediate_size=96, num_experts=8, num_experts_per_tok=2)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_hybrid_moe_gives_llama_cpp_the_logits_of_transformers(
    model_type: str, tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gguf import GGUFReader

    from lorafit.export import gguf_hybrid

    folder = tmp_path / "model"
    model = tiny_qwen35(folder, tokenizer, 4, model_type, **MOE)
    gap = f32_logit_gap(model, tokenizer, folder)
    assert gap(tmp_path / "model-f32.gguf") < 1e-3
    reader = GGUFReader(tmp_path / "model-f32.gguf")
    tensors = {tensor.name: tuple(int(n) for n in tensor.shape) for tensor in reader.tensors}
    arch, own = FAMILIES[model_type]
    assert tensors["blk.0.ffn_gate_inp_shexp.weight"] == (256,)
    assert {"blk.0.ffn_gate_shexp.weight", "blk.0.ffn_gate_exps.weight", "blk.3.attn_q.weight"} | own <= set(tensors)
    assert int(reader.fields[f"{arch}.expert_shared_feed_forward_length"].parts[-1][0]) == 96

    # the comparison can fail: the shared expert's gate written negated computes another model
    transform = gguf_hybrid.transform

    def negated(entry: dict, config: dict, name: str, weight: Any) -> Any:
        out = transform(entry, config, name, weight)
        return -out if name.endswith("ffn_gate_inp_shexp.weight") else out

    monkeypatch.setattr(gguf_hybrid, "transform", negated)
    assert gap(tmp_path / "wrong.gguf") > 1e-2


@pytest.mark.parametrize("preset", ["qwen3.5-35b-a3b", "qwen3-next-80b-a3b"])
def test_a_trained_hybrid_moe_run_exports_to_checked_gguf(
    preset: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lorafit train` on a tiny model of the family (LoRA on both layer kinds' projections), its adapter's B made
    random, then `export --to gguf` f32 and q4_k_m through the export's own llama.cpp check."""
    from lorafit.train.demo import build_model, build_tokenizer, corpus

    small = build_tokenizer(corpus(), vocab_size=512)
    # the shapes of test_qwen35.small_hybrid (llama.cpp sizes a value head by the key head), 4 experts of 128, all
    # active as in test_export_gguf_moe (a tiny top-2 of 4 flips a choice wherever two router logits are within
    # rounding), a 128-wide shared expert, bf16 weights as the hub ships them. transformers loads a qwen3_5_moe
    # model's tokenizer as Qwen3_5Tokenizer whatever its tokenizer_config says (tokenization_auto.py
    # MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), which adds the <|endoftext|> the hub's has and the demo's lacks:
    # one row more for it (unused by Qwen3-Next's)
    block = small_hybrid(4).linear_attention.model_dump() | {"shared_expert_intermediate_size": 128}
    shape = dict(hidden_size=512, moe_intermediate_size=128, num_local_experts=4, num_experts_per_tok=4)
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=128, num_hidden_layers=4)
    fused = {"fused_inputs": preset.startswith("qwen3-next")}
    spec = resolve(preset).scaled(**shape, **heads, linear_attention=block | fused)
    spec = spec.scaled(vocab_size=len(small) + 1, max_position_embeddings=4096)
    build_model(tmp_path / "model", small, spec, seed=0, dtype="bfloat16")
    flags = ["--max-steps", "1", "--micro-batch", "2"]
    run = run_train(tmp_path, word_rows(8), capsys, *flags)
    randomize_lora_b(run)
    output = tmp_path / "gguf"
    export_checked(run, output, capsys, "f32", "q4_k_m")
    assert sorted(path.name for path in output.glob("*.gguf")) == ["run-f32.gguf", "run-q4_k_m.gguf"]
