"""GGUF export of Gemma 4 (the 31B's layout) as llama.cpp's gemma4: sliding layers with one head size, global
layers with their own wider heads, fewer KV heads, no v_proj (K doubles as V) and a proportional rope on a quarter
of the head; the 26B-A4B's MoE block beside the dense MLP (fused experts, the router's scales, three more norms);
the E2B's per-layer input embeddings, shared-KV layers and double-wide MLP; the text model and the image-text
model's language model give llama.cpp the logits of transformers, and a trained run exports end to end through the
export's own check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import export_checked, randomize_lora_b, run_train, word_rows
from lorafit.errors import ExportError
from lorafit.export.verify import reference_model
from lorafit.models import from_config_json
from lorafit.serving import gguf_tensors

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is the [gguf] extra")

from test_export_gguf import TEXT, f32_logit_gap  # noqa: E402
from test_gemma4 import TINY_E, TINY_MOE, TINY_TEXT, TINY_VISION, gemma4_config  # noqa: E402

# a window narrower than the test text, so that the sliding layers' mask shows in the logits
TEXT_CHANGES = {"sliding_window": 8}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from lorafit.train.demo import build_tokenizer, corpus

    return build_tokenizer(corpus(), vocab_size=512)


def gemma4_model(
    folder: Path, tokenizer: Any, *, image_text: bool, moe: bool = False, e_size: bool = False, text: dict | None = None
) -> None:
    """A tiny random Gemma 4 saved as transformers saves it: Gemma4ForConditionalGeneration (vision tower and
    all) or Gemma4ForCausalLM (the text config alone); with `moe`, the 26B-A4B's MoE block in every layer; with
    `e_size`, the E2B's per-layer inputs and its last 4 of 12 layers shared-KV with a double-wide MLP."""
    from transformers import AutoModelForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

    changes = text or {}
    text = TINY_TEXT | TEXT_CHANGES | {"vocab_size": len(tokenizer)} | (TINY_MOE if moe else {})
    if e_size:
        text |= TINY_E | {"num_hidden_layers": 12, "vocab_size_per_layer_input": len(tokenizer)}
    text |= changes
    torch.manual_seed(0)
    if image_text:
        config = Gemma4ForConditionalGeneration.config_class.from_dict(gemma4_config(text, TINY_VISION))
        model = Gemma4ForConditionalGeneration(config)
    else:
        model = AutoModelForCausalLM.from_config(Gemma4TextConfig(**text))
    with torch.no_grad():
        # Gemma 4 attends unscaled over RMS-normed queries and keys, so with transformers' initial q/k norm weights
        # of 1 a tiny model's attention logits reach the head size and its softmax amplifies any rounding: rounding
        # its weights to f16 alone moves transformers' own logits by 1.7 % of the largest (measured once). Norms of a
        # trained model's size keep that under the tolerance; all norms and the layer scalars move off 1 so that a
        # misplaced one shows.
        for name, parameter in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.uniform_(0.2, 0.4)
            elif "norm" in name:
                parameter.uniform_(0.8, 1.2)
            elif name.endswith(("router.scale", "per_expert_scale")):
                parameter.uniform_(0.5, 1.5)  # off 1, so that a scale read wrongly shows
            elif name.endswith("router.proj.weight"):
                # a random router's scores are near ties, and rounding to f16 then sends a token to other experts
                # (greedy tokens differed after training, measured once); a router of decisive scores, as a trained
                # one has, keeps the comparison about the file's weights
                parameter.mul_(16)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.8, 1.2)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.mark.parametrize(
    ("image_text", "moe", "e_size"),
    [(False, False, False), (True, False, False), (True, True, False), (True, False, True)],
    ids=["text", "image-text", "26b-a4b-layout", "e2b-layout"],
)
def test_gemma4_gives_llama_cpp_the_logits_of_transformers(
    image_text: bool, moe: bool, e_size: bool, tokenizer: Any, tmp_path: Path
) -> None:
    from gguf import GGUFReader

    folder = tmp_path / "model"
    gemma4_model(folder, tokenizer, image_text=image_text, moe=moe, e_size=e_size)
    assert len(tokenizer(TEXT)["input_ids"]) > 8 * 4  # several sliding windows long
    assert f32_logit_gap(reference_model(folder), tokenizer, folder)(tmp_path / "model-f32.gguf") < 1e-3
    reader = GGUFReader(tmp_path / "model-f32.gguf")
    names = [tensor.name for tensor in reader.tensors]
    assert all(name.startswith(("token_embd.", "per_layer_", "blk.", "output", "rope_freqs")) for name in names), names
    kv_heads = reader.fields["gemma4.attention.head_count_kv"]
    assert "blk.0.attn_v.weight" in names
    if e_size:  # the global layers have their own v_proj; the last 4 layers none, nor k_proj
        assert "blk.5.attn_v.weight" in names and not {"blk.11.attn_k.weight", "blk.11.attn_v.weight"} & set(names)
        assert {"per_layer_token_embd.weight", "blk.0.inp_gate.weight", "blk.11.proj.weight"} <= set(names)
        assert [int(kv_heads.parts[i][0]) for i in kv_heads.data] == [2, 2, 2, 2, 2, 2] * 2
        # the serving plan's tensors are the file's (src/lorafit/serving.py), element for element
        planned = {t.name: t.elements for t in gguf_tensors(from_config_json(folder))}
        stored = {t.name: int(t.n_elements) for t in reader.tensors if t.name in planned}
        assert stored == planned
        return
    assert "blk.5.attn_v.weight" not in names  # the global layer's K is its V
    assert [int(kv_heads.parts[i][0]) for i in kv_heads.data] == [2, 2, 2, 2, 2, 1]
    moe_tensors = {"blk.0.ffn_gate_up_exps.weight", "blk.0.ffn_gate_inp.scale", "blk.0.ffn_down_exps.scale"}
    assert (moe_tensors <= set(names)) == moe and "blk.0.ffn_down.weight" in names


def test_gemma4_without_its_proportional_rope_would_be_caught(
    tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparison above can fail: the global layers rotating their whole head give other logits."""
    from lorafit.export import gguf

    folder = tmp_path / "model"
    gemma4_model(folder, tokenizer, image_text=False)
    monkeypatch.setattr(gguf, "proportional_factors", lambda rope, head_dim: [1.0] * (head_dim // 2))
    assert f32_logit_gap(reference_model(folder), tokenizer, folder)(tmp_path / "wrong.gguf") > 1e-2


def test_shared_kv_layers_llama_cpp_would_read_differently_are_one_line(tokenizer: Any, tmp_path: Path) -> None:
    """llama.cpp's gemma4 reads the last unshared layer for a shared full-attention layer and the one before for a
    sliding one: with 4 shared layers of 12 those are two sliding layers, and the export says so."""
    from lorafit.export import gguf

    folder = tmp_path / "model"
    gemma4_model(folder, tokenizer, image_text=False, e_size=True, text={"num_kv_shared_layers": 4})
    with pytest.raises(ExportError, match="not a sliding then a full-attention one") as error:
        gguf.write_gguf(folder, tmp_path / "wrong.gguf", "f32")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("moe", "e_size"),
    [(False, False), (True, False), (False, True)],
    ids=["31b-layout", "26b-a4b-layout-experts", "e2b-layout"],
)
def test_a_trained_gemma4_run_exports_through_the_check(
    moe: bool, e_size: bool, tokenizer: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """QLoRA on a tiny image-text Gemma 4 (the 26B-A4B's layout with adapters on its fused experts), then `export
    --to gguf` f16 and q4_k_m: the export's own check loads each file in llama.cpp and compares it with the merged
    model (f16: logits within tolerance, the same greedy tokens)."""

    gemma4_model(tmp_path / "model", tokenizer, image_text=True, moe=moe, e_size=e_size)
    experts = ["--lora-targets", "experts", "--lora-dropout", "0"] if moe else []
    run = run_train(
        tmp_path, word_rows(8, "yes"), capsys, "--method", "qlora", "--micro-batch", "4", "--max-steps", "1", *experts
    )
    randomize_lora_b(run)  # a real update of every adapted weight

    output = tmp_path / "gguf"
    report = export_checked(run, output, capsys, "f16", "q4_k_m")
    assert sorted(path.name for path in output.glob("*.gguf")) == ["run-f16.gguf", "run-q4_k_m.gguf"]
    (note,) = [line for line in report["notes"] if "vision tower" in line]
    assert "--mmproj" in note and "--to merged" in note
