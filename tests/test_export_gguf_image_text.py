"""GGUF export of image-text models' language model (Gemma 3 as llama.cpp's gemma3, Mistral Small 3.x as its
mistral3, Qwen2-VL / Qwen2.5-VL as its qwen2vl, Qwen3-VL as its qwen3vl): transformers saves it as
language_model.model.* or model.*, the adapter names it model.language_model.*; the text model is written without
the vision tower and projector, gives llama.cpp the logits of transformers, and a trained run exports end to end
through the export's own check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import randomize_lora_b, run_cli, run_train, word_rows
from lorafit.errors import ExportError
from lorafit.export.verify import reference_model

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is the [gguf] extra")

from test_export_gguf import TEXT, f32_logit_gap, hf_logits, llama_cpp_logits  # noqa: E402
from test_vision import ONE_PER_FAMILY, tiny  # noqa: E402

WRITTEN = ("gemma3", "mistral3", "qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from lorafit.train.demo import build_tokenizer, corpus

    return build_tokenizer(corpus(), vocab_size=512)


def image_text_model(folder: Path, tokenizer: Any, family: str) -> None:
    """A tiny random image-text model of the family. Gemma 3's text part gets a sliding window narrower than the
    test text on its first layer only, the real models' query scale (query_pre_attn_scalar = head_dim) and rope
    (linear x 8 on full-attention layers), so that the window, the per-layer pattern, both rope bases and the
    scaling that applies to one kind of layer all show in the logits."""
    from lorafit.train.demo import build_model

    build_model(folder, tokenizer, tiny(ONE_PER_FAMILY[family], vocab_size=len(tokenizer)), seed=0)
    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"]
    if family == "gemma3":
        text |= {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
        text["query_pre_attn_scalar"] = text["head_dim"]
        # Gemma 3 4B/12B/27B's rope: linear scaling by 8 on the full-attention layers only
        text["rope_parameters"]["full_attention"] |= {"rope_type": "linear", "factor": 8.0}
    if family == "mistral3":  # as Mistral Small 3.1's config.json: no tie (Mistral3Config: True), an lm_head saved
        config.pop("tie_word_embeddings", None)
        text.pop("tie_word_embeddings", None)
    if family.startswith("qwen2"):  # llama.cpp 0.3.36's qwen2vl normalises with eps 0 (catalog/gguf.toml)
        text["rms_norm_eps"] = 1e-12
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("family", WRITTEN)
def test_the_language_model_gives_llama_cpp_the_logits_of_transformers(
    family: str, tokenizer: Any, tmp_path: Path
) -> None:
    from gguf import GGUFReader

    folder = tmp_path / "model"
    image_text_model(folder, tokenizer, family)
    assert len(tokenizer(TEXT)["input_ids"]) > 8 * 4  # several sliding windows long
    assert f32_logit_gap(reference_model(folder), tokenizer, folder)(tmp_path / "model-f32.gguf") < 1e-3
    names = [tensor.name for tensor in GGUFReader(tmp_path / "model-f32.gguf").tensors]
    assert all(name.startswith(("token_embd.", "blk.", "output")) for name in names), names


def test_qwen3_vl_moe_experts_as_the_hub_ships_them(tokenizer: Any, tmp_path: Path) -> None:
    """Qwen3-VL-MoE checkpoints store the fused experts experts x in x out (transformers transposes them on load);
    a model built from a config saves them experts x out x in. Both give llama.cpp transformers' logits."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "model"
    image_text_model(folder, tokenizer, "qwen3_vl_moe")
    weights = load_file(folder / "model.safetensors")
    fused = [name for name in weights if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert fused
    for name in fused:
        weights[name] = weights[name].transpose(1, 2).contiguous()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    assert f32_logit_gap(reference_model(folder), tokenizer, folder)(tmp_path / "model-f32.gguf") < 1e-3


def test_gemma3_without_its_sliding_window_would_be_caught(
    tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparison above can fail: the same Gemma 3 written without the sliding-window keys gives other logits."""
    from lorafit.export import gguf

    folder = tmp_path / "model"
    image_text_model(folder, tokenizer, "gemma3")
    original = gguf.architecture
    monkeypatch.setattr(
        gguf,
        "architecture",
        lambda path: gguf.Architecture(
            **(vars(original(path)) | {"entry": original(path).entry | {"sliding_window": False}})
        ),
    )
    assert f32_logit_gap(reference_model(folder), tokenizer, folder)(tmp_path / "wrong.gguf") > 1e-2


def test_llama_cpps_qwen2vl_normalises_with_eps_zero(tokenizer: Any, tmp_path: Path) -> None:
    """What catalog/gguf.toml says of llama.cpp 0.3.36's qwen2vl: it reads no RMS-norm epsilon. With the config's
    1e-5 the tiny model's logits differ from transformers' by more than 0.5 % of the largest; with transformers'
    epsilon set to 0 they agree."""
    from lorafit.export import gguf

    folder = tmp_path / "model"
    image_text_model(folder, tokenizer, "qwen2_5_vl")
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["rms_norm_eps"] = 1e-5
    (folder / "config.json").write_text(json.dumps(config))
    written = gguf.write_gguf(folder, tmp_path / "model-f32.gguf", "f32")
    ids = tokenizer(TEXT)["input_ids"]
    ours = llama_cpp_logits(written.path, ids)
    model = reference_model(folder)
    reference = hf_logits(model, ids)
    assert np.abs(ours - reference).max() > 5e-3 * np.abs(reference).max()
    for module in model.modules():
        if hasattr(module, "variance_epsilon"):
            module.variance_epsilon = 0.0
    eps_zero = hf_logits(model, ids)
    assert np.abs(ours - eps_zero).max() < 1e-3 * np.abs(eps_zero).max()


def test_a_query_scale_llama_cpp_does_not_use_is_one_line(tokenizer: Any, tmp_path: Path) -> None:
    from lorafit.export import gguf

    folder = tmp_path / "model"
    image_text_model(folder, tokenizer, "gemma3")
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["query_pre_attn_scalar"] = 256
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=r"1/sqrt\(16\).*1/sqrt\(256\).*--to merged"):
        gguf.architecture(folder)


@pytest.mark.parametrize("family", ["gemma3", "mistral3", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_a_trained_run_exports_its_language_model(
    family: str, tokenizer: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """QLoRA on the language model of a tiny image-text model, then `export --to gguf`: checked in llama.cpp
    against the merged model (f16 logits and greedy tokens), with one line saying the vision tower is not in
    the file and how llama.cpp writes it."""

    image_text_model(tmp_path / "model", tokenizer, family)
    run = run_train(
        tmp_path, word_rows(8, "yes"), capsys, "--method", "qlora", "--micro-batch", "4", "--max-steps", "1"
    )
    randomize_lora_b(run)  # a real update of every adapted weight

    output = tmp_path / "gguf"
    code, out, err = run_cli(["export", str(run), "--to", "gguf", "-o", str(output), "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    f16 = report["verify"]["f16"]
    assert f16["greedy_match"] is True and f16["max_abs_logit_diff"] <= f16["logit_tolerance"]
    assert f16["tokenizer_match"] is True
    (note,) = [line for line in report["notes"] if "vision tower" in line]
    assert "--mmproj" in note and "--to merged" in note
