"""GGUF export of Qwen3.5's text model as llama.cpp's qwen35: its Gated DeltaNet layers (A as -exp(A_log), the
conv kernel squeezed, value heads tiled across key heads, the gated norm unshifted) and gated full attention give
llama.cpp the logits of transformers; a trained run exports end to end through the export's own check; value
heads narrower or wider than key heads, which llama.cpp's qwen35 cannot hold, are one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import export_checked, randomize_lora_b, train_tiny
from lorafit.errors import ExportError

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is the [gguf] extra")

from test_export_gguf import f32_logit_gap  # noqa: E402
from test_qwen35 import small_hybrid  # noqa: E402


def tiny_qwen35(folder: Path, tokenizer: Any, value_heads: int, model_type: str = "qwen3_5_text", **moe: int) -> Any:
    """Four layers (three DeltaNet, one gated attention), rows of 256 (with `moe`, Qwen3-MoE's experts and shared
    expert); 1-D parameters away from their init (norms of 1 + w near 1, the DeltaNet's gated norm, A_log and
    dt_bias near 1) so that one written wrong shows; a router and shared-expert gate far from zero (both runtimes
    route alike; the gate matters)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        linear_num_key_heads=2,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
        **moe,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1:
                shifted = name.endswith("norm.weight") and ".linear_attn." not in name  # (1 + w) norms
                torch.nn.init.normal_(parameter, 0.0 if shifted else 1.0, 0.1)
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                parameter.normal_(0.0, 0.5)
            elif ".experts." in name:
                parameter.normal_(0.0, 0.05)
    torch.nn.init.normal_(model.get_output_embeddings().weight, std=0.1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model.eval()
    return model


@pytest.mark.parametrize("value_heads", [2, 4], ids=["heads-equal", "values-tiled"])
def test_qwen35_gives_llama_cpp_the_logits_of_transformers(
    value_heads: int, tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gguf import GGUFReader

    from lorafit.export import gguf_hybrid

    folder = tmp_path / "model"
    model = tiny_qwen35(folder, tokenizer, value_heads)
    gap = f32_logit_gap(model, tokenizer, folder)
    assert gap(tmp_path / "model-f32.gguf") < 1e-3
    tensors = {tensor.name for tensor in GGUFReader(tmp_path / "model-f32.gguf").tensors}
    assert {"blk.0.ssm_a", "blk.0.ssm_dt.bias", "blk.0.ssm_conv1d.weight", "blk.3.attn_q.weight"} <= tensors
    assert not any(name.startswith("blk.3.ssm_") for name in tensors)

    # the comparison can fail: value heads left grouped by key head (where there are more of them), or else the
    # gated norm shifted by 1 as the others are, compute with the wrong weights
    transform = gguf_hybrid.transform
    if value_heads == 2:
        monkeypatch.setattr(gguf_hybrid, "plain_norm", lambda entry, name: False)
    else:
        monkeypatch.setattr(
            gguf_hybrid,
            "transform",
            lambda entry, config, name, weight: transform(entry, config | {"linear_num_value_heads": 2}, name, weight),
        )
    assert gap(tmp_path / "wrong.gguf") > 1e-2


def test_value_heads_of_another_width_are_one_line(tmp_path: Path) -> None:
    from lorafit.export import gguf

    config = {"model_type": "qwen3_5_text", "linear_key_head_dim": 128, "linear_value_head_dim": 96}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="linear_key_head_dim = linear_value_head_dim.*128 and 96.*--to merged"):
        gguf.architecture(tmp_path)


def test_a_trained_qwen35_run_exports_to_checked_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`lorafit train` on a tiny Qwen3.5 (LoRA on both layer kinds), its adapter's B made random (a real update of
    every adapted projection), then `export --to gguf` f16 and q4_k_m: the export's own check loads each file in
    llama.cpp and compares it with the merged model in transformers (logits and greedy tokens for f16)."""

    run, _ = train_tiny(tmp_path, lambda vocab: small_hybrid(4).scaled(vocab_size=vocab), capsys)
    randomize_lora_b(run)

    output = tmp_path / "gguf"
    export_checked(run, output, capsys, "f16", "q4_k_m")
    assert sorted(path.name for path in output.glob("*.gguf")) == ["run-f16.gguf", "run-q4_k_m.gguf"]


def test_the_language_model_of_qwen35_image_text_is_written(tokenizer: Any, tmp_path: Path) -> None:
    """A hub checkpoint's layout (Qwen3_5ForConditionalGeneration: model.language_model.* beside model.visual.*):
    its language model, renamed, gives llama.cpp the text logits of transformers; the vision tower is not written
    (its tensors have no GGUF name: written, they would fail the export)."""
    from safetensors.torch import load_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = tiny_qwen35(tmp_path / "text", tokenizer, 4).config.to_dict()
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 256}
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config).float().eval()
    weights = load_file(tmp_path / "text" / "model.safetensors")  # the 1-D parameters away from their init
    with torch.no_grad():
        model.lm_head.weight.copy_(weights.pop("lm_head.weight"))
        model.model.language_model.load_state_dict({name.removeprefix("model."): w for name, w in weights.items()})
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    gap = f32_logit_gap(model, tokenizer, folder)
    assert gap(tmp_path / "model-f32.gguf") < 1e-3
