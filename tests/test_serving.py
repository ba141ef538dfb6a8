"""Serving memory of the merged model: GGUF sizes against published files, the mix and fallback rules of
llama-quantize, the KV cache and compute buffer worked by hand, and the section in `lorafit plan`."""

from __future__ import annotations

import io
import json
import tomllib
from importlib import resources

import pytest
from rich.console import Console

from conftest import run_cli
from lorafit import hardware, models, render, serving
from lorafit import plan as planner
from lorafit.models import ModelSpec
from lorafit.schema import PlanRequest
from lorafit.units import BYTES_PER_MIB, gib

PUBLISHED = tomllib.loads(resources.files("lorafit").joinpath("catalog/gguf_published.toml").read_text())["file"]


def types_of(spec: ModelSpec, file_type: str, kind: str) -> list[str]:
    return [ggml_type for tensor, ggml_type in serving.ggml_types(spec, file_type) if tensor.kind == kind]


# --- the tensors -------------------------------------------------------------------------------------------------
# llama.cpp has no Llama 3.2 Vision: no GGUF is written or served for it (tests/test_mllama.py)
@pytest.mark.parametrize("name", sorted(n for n, spec in models.catalog().items() if spec.cross_attention is None))
def test_the_gguf_tensors_hold_every_parameter_once(name: str) -> None:
    """tests/test_models.py checks num_params against the published counts; the GGUF layout must add up to it."""
    spec = models.catalog()[name]
    # an image-text model's vision tower goes to llama.cpp's separate mmproj file, not the text model's GGUF
    assert sum(t.elements for t in serving.gguf_tensors(spec)) == spec.num_params - spec.vision_params


# --- published files ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("row", PUBLISHED, ids=lambda r: f"{r['model']}-{r['type']}")
def test_gguf_weights_match_published_file_sizes(row: dict) -> None:
    """A file is its tensor data plus metadata (tokenizer, chat template, tensor directory, alignment): the file
    is never smaller than lorafit's tensor data, and larger by no more than the metadata can be."""
    spec = models.resolve(row["model"])
    metadata = residual(row)
    assert 0 <= metadata <= spec.vocab_size * 80 + BYTES_PER_MIB, f"{metadata:,} bytes of metadata"
    assert metadata / row["bytes"] < 0.015


def test_every_published_row_names_its_source() -> None:
    assert all(row["source"].startswith("https://") and row["file"].startswith("https://") for row in PUBLISHED)


def residual(row: dict, how: serving.Quantizer | None = None) -> int:
    spec = models.resolve(row["model"])
    how = how or serving.Quantizer(imatrix=row.get("imatrix", False), legacy_qkv=row.get("legacy_qkv", False))
    return row["bytes"] - serving.gguf_weight_bytes(spec, row["type"], how)


def test_files_with_one_tokenizer_leave_the_same_metadata_whatever_their_type() -> None:
    """The residual is the tokenizer, not a type rule gone wrong: for one vocabulary it is the same in q4_0, q4_k_m,
    q6_k and q8_0 files, by different producers, to within 0.6 MB (chat templates and tokenizer versions differ),
    while the producer flags move the tensor data by 2 to 60 MB."""
    by_vocab: dict[int, list[int]] = {}
    for row in PUBLISHED:
        by_vocab.setdefault(models.resolve(row["model"]).vocab_size, []).append(residual(row))
    assert len([sizes for sizes in by_vocab.values() if len(sizes) > 1]) >= 5
    for sizes in by_vocab.values():
        assert max(sizes) - min(sizes) <= 600_000
    for row in PUBLISHED:
        if row.get("imatrix") or row.get("legacy_qkv"):
            assert abs(residual(row, serving.Quantizer()) - residual(row)) >= 2 * BYTES_PER_MIB


# --- llama-quantize's mixes ------------------------------------------------------------------------------------
# "More bits" layers of a 32-layer model: the first and last eighth (0-3, 28-31) and every third layer between,
# counting from the end of the first eighth (6, 9, ..., 27) - listed by hand from llama.cpp's use_more_bits.
MORE_BITS_OF_32 = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


def test_q4_k_m_gives_half_the_value_and_down_projections_six_bits() -> None:
    spec = models.catalog()["llama-2-7b"]
    for kind in ("attn_v", "ffn_down"):
        chosen = types_of(spec, "q4_k_m", kind)
        assert [i for i, t in enumerate(chosen) if t == "q6_k"] == MORE_BITS_OF_32
        assert {chosen[i] for i in range(32) if i not in MORE_BITS_OF_32} == {"q4_k"}
    for kind in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up", "token_embd"):
        assert set(types_of(spec, "q4_k_m", kind)) == {"q4_k"}
    assert types_of(spec, "q4_k_m", "output") == ["q6_k"]
    assert set(types_of(spec, "q4_k_m", "norm")) == {"f32"}


def test_q5_k_m_and_q6_k_and_q8_0() -> None:
    spec = models.catalog()["llama-2-7b"]
    assert types_of(spec, "q5_k_m", "attn_v").count("q6_k") == 16
    assert set(types_of(spec, "q5_k_m", "attn_q")) == {"q5_k"}
    assert types_of(spec, "q6_k", "output") == ["q6_k"]
    assert types_of(spec, "q8_0", "output") == ["q8_0"]  # q8_0 keeps its output matrix at 8 bits
    assert set(types_of(spec, "f16", "attn_q")) == {"f16"}


def test_a_tied_embedding_is_quantised_as_the_output_matrix() -> None:
    spec = models.catalog()["llama-3.2-1b"]
    assert types_of(spec, "q4_k_m", "output") == []
    assert types_of(spec, "q4_k_m", "token_embd") == ["q6_k"]


def test_a_70b_llama_gets_five_bits_where_q4_k_m_gives_four_to_attn_v() -> None:
    chosen = types_of(models.catalog()["llama-3.1-70b"], "q4_k_m", "attn_v")
    assert set(chosen) == {"q6_k", "q5_k"}


def test_eight_experts_get_eight_bit_attention_values_and_keys() -> None:
    spec = models.catalog()["mixtral-8x7b"]
    assert set(types_of(spec, "q4_k_m", "attn_v")) == set(types_of(spec, "q4_k_m", "attn_k")) == {"q8_0"}
    assert set(types_of(spec, "q4_k_m", "attn_output")) == {"q5_k"}
    assert set(types_of(spec, "q4_k_m", "router")) == {"f32"}


def test_phi3_fused_qkv_today_and_in_2024() -> None:
    spec = models.catalog()["phi-3-mini"]
    assert types_of(spec, "q4_k_m", "attn_qkv").count("q6_k") == 16
    legacy = serving.ggml_types(spec, "q4_k_m", serving.Quantizer(legacy_qkv=True))
    assert {t for tensor, t in legacy if tensor.kind == "attn_qkv"} == {"q5_k"}


# --- rows that are not a multiple of the block ------------------------------------------------------------------
def test_rows_of_896_fall_back_to_32_weight_blocks() -> None:
    """Qwen2.5-0.5B's hidden size 896 = 3.5 x 256: q4_k -> q5_0, q6_k -> q8_0; its down projection (4864 =
    19 x 256) keeps the k-quants; the tied embedding, output stand-in, gets q8_0."""
    spec = models.catalog()["qwen2.5-0.5b"]
    assert set(types_of(spec, "q4_k_m", "attn_q")) == {"q5_0"}
    assert set(types_of(spec, "q4_k_m", "attn_v")) == {"q8_0", "q5_0"}
    assert set(types_of(spec, "q4_k_m", "ffn_down")) == {"q6_k", "q4_k"}
    assert types_of(spec, "q4_k_m", "token_embd") == ["q8_0"]
    assert set(types_of(spec, "q5_k_m", "ffn_up")) == {"q5_1"}


def test_a_fallback_is_sized_in_its_own_blocks() -> None:
    spec = models.catalog()["qwen2.5-0.5b"]
    q = next(t for t in serving.gguf_tensors(spec) if t.kind == "attn_q")
    assert serving.tensor_bytes(q, "q5_0") == 896 * 896 // 32 * 22


def test_rows_not_a_multiple_of_32_stay_f16() -> None:
    spec = models.catalog()["llama-2-7b"].scaled(
        hidden_size=48, num_attention_heads=2, num_key_value_heads=2, intermediate_size=256, vocab_size=64
    )
    assert set(types_of(spec, "q4_k_m", "attn_q")) == {"f16"}
    assert set(types_of(spec, "q4_k_m", "ffn_down")) <= {"q4_k", "q6_k"}  # rows of 256 quantise
    assert types_of(spec, "q8_0", "output") == ["f16"]


def test_an_unknown_gguf_type_is_a_clear_error() -> None:
    with pytest.raises(serving.InvalidConfig, match="no GGUF type 'q3_k_m'"):
        serving.gguf_weight_bytes(models.catalog()["llama-2-7b"], "q3_k_m")


# --- GPTQ / AWQ ------------------------------------------------------------------------------------------------
def test_a_gptq_linear_worked_by_hand() -> None:
    """4096 x 4096 at 4 bits in groups of 128: 8 MiB of codes, 32 groups x 4096 outputs x (2-byte scale + half a
    byte of zero point), and a 4-byte group index per input row."""
    gptq, awq = serving.formats()["packed"]["gptq"], serving.formats()["packed"]["awq"]
    assert serving.packed_linear_bytes(4096, 4096, gptq) == 8_388_608 + 327_680 + 16_384
    assert serving.packed_linear_bytes(4096, 4096, awq) == 8_388_608 + 327_680


def test_gptq_keeps_embeddings_and_head_in_16_bit() -> None:
    spec = models.catalog()["llama-3.1-8b"]
    linear = spec.num_hidden_layers * spec.layer_linear_params
    head_and_embedding = 2 * spec.vocab_size * spec.hidden_size
    packed = serving.packed_weight_bytes(spec, "awq")
    assert packed > head_and_embedding * 2 + linear * 4 / 8
    assert packed < head_and_embedding * 2 + linear * 4.2 / 8 + spec.num_params * 0.001


# --- KV cache and compute buffer -------------------------------------------------------------------------------
def test_kv_cache_worked_by_hand() -> None:
    # Llama 3.1 8B: 2 (K and V) x 32 layers x 8 KV heads x 128 head_dim x 8192 tokens x 2 bytes = 2^30
    assert serving.kv_cache_bytes(models.catalog()["llama-3.1-8b"], 8192) == 2**30
    # Llama 2 7B has as many KV heads as heads (32): 2 x 32 x 32 x 128 x 4096 x 2 = 2 GiB
    assert serving.kv_cache_bytes(models.catalog()["llama-2-7b"], 4096) == 2 * 2**30


def test_compute_buffer_matches_llama_cpp_s_report() -> None:
    """llama.cpp printed "CUDA0 compute buffer size = 105.00 MiB" for TriLM 3.9B (vocab 50688, hidden 3072) at
    n_ubatch 512 (mozilla-ai/llamafile#552)."""
    trilm = models.catalog()["llama-2-7b"].scaled(vocab_size=50688, hidden_size=3072, num_hidden_layers=30)
    assert serving.compute_bytes(trilm) / BYTES_PER_MIB == pytest.approx(105.00, abs=0.005)


# --- the answer ------------------------------------------------------------------------------------------------
def test_the_total_is_its_parts_and_the_verdicts_follow_from_it() -> None:
    spec, gpu = models.catalog()["llama-3.1-8b"], hardware.resolve("RTX 4060 Ti 8GB")
    answer = serving.serving(spec, 8192, gpu, headroom=0.1)
    cards = [g for g in hardware.catalog().values() if g.kind != "apple"]
    for row in answer.formats:
        parts = row.weights_gib + row.kv_cache_gib + row.compute_gib + row.cuda_context_gib
        assert row.total_gib == pytest.approx(parts, abs=0.002)
        assert row.bits_per_weight == pytest.approx(row.weights_bytes * 8 / spec.num_params, abs=0.001)
        assert row.kv_cache_gib == pytest.approx(1.0)
        assert row.fits_gpu == (row.total_gib <= gpu.usable_gib(0.1))
        smallest = hardware.catalog()[row.smallest_gpu]
        assert row.total_gib <= smallest.usable_gib(0.1)
        assert not [g for g in cards if g.memory_gib < smallest.memory_gib and row.total_gib <= g.usable_gib(0.1)]
    by_format = {row.format: row for row in answer.formats}
    assert by_format["gguf q4_k_m"].weights_gib < by_format["awq"].weights_gib < by_format["gguf q8_0"].weights_gib


def test_plan_json_has_the_serving_section(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["plan", "--model", "qwen2.5-7b", "--gpu", "RTX 4090", "--json"], capsys)
    assert code == 0
    section = json.loads(out)["serving"]
    assert section["context"] == 4096 and section["gpu"] == "RTX 4090"
    names = [row["format"] for row in section["formats"]]
    assert names == ["gguf f16", "gguf q8_0", "gguf q6_k", "gguf q5_k_m", "gguf q4_k_m", "gptq", "awq", "bf16"]
    spec = models.catalog()["qwen2.5-7b"]
    q4 = section["formats"][names.index("gguf q4_k_m")]
    assert q4["weights_bytes"] == serving.gguf_weight_bytes(spec, "q4_k_m")
    assert q4["kv_cache_gib"] == pytest.approx(gib(serving.kv_cache_bytes(spec, 4096)), abs=0.001)


def test_serve_context_is_an_option_and_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    asked = ["plan", "--model", "llama-3.1-8b", "--gpu", "L4", "--serve-context", "32768", "--json"]
    code, out, _ = run_cli(asked, capsys)
    assert code == 0
    assert json.loads(out)["serving"]["formats"][0]["kv_cache_gib"] == pytest.approx(4.0)
    code, _, err = run_cli(["plan", "--model", "llama-2-7b", "--gpu", "L4", "--serve-context", "8192"], capsys)
    assert code == 2
    assert err.strip() == "lorafit: error: --serve-context 8192 is past llama-2-7b's maximum of 4096 tokens"
    code, _, err = run_cli(["plan", "--model", "llama-2-7b", "--serve-context", "0"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1


def test_the_default_context_is_capped_at_the_model_s_maximum(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["plan", "--model", "tinyllama-1.1b", "--gpu", "T4", "--json"], capsys)
    assert code == 0 and json.loads(out)["serving"]["context"] == 2048


def test_plan_for_people_shows_the_serving_table() -> None:
    plan = planner.make_plan(
        PlanRequest(model=models.catalog()["llama-3.1-8b"], gpu=hardware.resolve("RTX 4060 Ti 8GB"))
    )
    out = Console(file=io.StringIO(), width=200)
    render.show_plan(plan, out)
    text = out.file.getvalue()
    assert "serving the merged model at 4,096 tokens" in text
    assert "fits: on the RTX 4060 Ti 8GB with 10% kept free" in " ".join(text.split())
    for row in plan.serving.formats:
        line = next(line for line in text.splitlines() if f" {row.format} " in line and row.runtime in line)
        assert f" {row.total_gib:.2f} " in line
        assert (" yes " if row.fits_gpu else " no ") in line
        assert row.smallest_gpu in line
