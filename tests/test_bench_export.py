"""bench/export_gguf.py: its comparisons find what differs between two GGUF files and nothing where they match, its
measurement reads a child's own peak, and on a tiny model lorafit's file matches llama.cpp's converter's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import bench_module

pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")


@pytest.fixture(scope="module")
def bench():
    yield from bench_module("export_gguf")


@pytest.fixture(scope="module")
def tiny(bench, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The bench's tiny model (hidden 256, 2 layers) and lorafit's f16 GGUF of it."""
    from lorafit.export.gguf import write_gguf

    root = tmp_path_factory.mktemp("export")
    model_dir = root / "model"
    bench.build(model_dir, tiny=True)
    path = root / "lorafit.gguf"
    write_gguf(model_dir, path, "f16")
    return model_dir, path


def write_file(path: Path, tensors: dict[str, np.ndarray], keys: dict[str, str | int]) -> Path:
    """A GGUF of the given tensors and llama keys, written with gguf-py."""
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in keys.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)
    for name, values in tensors.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_tiny_model_is_tinyllama_shrunk_in_bf16(bench, tiny: tuple[Path, Path]) -> None:
    from lorafit.export.source import safetensors_header

    model_dir, _ = tiny
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (256, 2, 2)
    assert config["tie_word_embeddings"] is False
    header = safetensors_header(model_dir / "model.safetensors")
    assert {entry["dtype"] for entry in header.values()} == {"BF16"}
    assert header["model.embed_tokens.weight"]["shape"][0] == config["vocab_size"]
    # the model is reused: a second build returns the recorded spec and leaves the weights as they are
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert bench.build(model_dir, tiny=True).hidden_size == 256
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_a_file_and_its_copy_match_in_every_tensor_and_key(bench, tiny: tuple[Path, Path], tmp_path: Path) -> None:
    _, path = tiny
    copy = shutil.copy(path, tmp_path / "copy.gguf")
    tensors = bench.compare_tensors(path, copy)
    assert tensors.identical
    assert len(tensors.equal) == 2 * 9 + 3  # 9 per layer, embedding, output norm, output
    keys = bench.compare_metadata(path, copy)
    assert keys.identical
    assert keys.equal > 20
    assert keys.naming["general.name"] == {"lorafit": "model", "llama_cpp": "model"}


def test_differences_are_found_and_measured(bench, tmp_path: Path) -> None:
    base = np.arange(64, dtype=np.float16).reshape(4, 16) / 8
    changed = base.copy()
    changed[2, 5] += np.float16(0.5)  # exactly representable: the largest difference is 0.5
    norm = np.ones(16, dtype=np.float32)
    keys = {"llama.block_count": 2, "general.name": "a", "tokenizer.ggml.pre": "gpt-2", "llama.only_in_a": 1}
    a = write_file(
        tmp_path / "a.gguf",
        {"same.weight": norm, "changed.weight": base, "retyped.weight": base, "only_a.weight": norm},
        keys,
    )
    b = write_file(
        tmp_path / "b.gguf",
        {"same.weight": norm, "changed.weight": changed, "retyped.weight": base.astype(np.float32)},
        {"llama.block_count": 3, "general.name": "b", "tokenizer.ggml.pre": "gpt-2", "llama.only_in_b": "x"},
    )

    tensors = bench.compare_tensors(a, b)
    assert not tensors.identical
    assert tensors.equal == ["same.weight"]
    assert tensors.only_lorafit == ["only_a.weight"] and tensors.only_llama_cpp == []
    different = {entry["name"]: entry for entry in tensors.different}
    assert set(different) == {"changed.weight", "retyped.weight"}
    assert different["changed.weight"]["max_abs_difference"] == 0.5
    assert different["changed.weight"]["differing_bytes"] in (1, 2)  # one f16 value: one or both of its bytes
    retyped = different["retyped.weight"]
    assert (retyped["lorafit"], retyped["llama_cpp"]) == ("F16 [16, 4]", "F32 [16, 4]")  # GGUF order: columns first
    assert retyped["max_abs_difference"] is None

    meta = bench.compare_metadata(a, b)
    assert not meta.identical
    assert set(meta.different) == {"llama.block_count", "GGUF.tensor_count"}  # the header's count: 4 and 3
    assert (meta.different["llama.block_count"]["lorafit"], meta.different["llama.block_count"]["llama_cpp"]) == (2, 3)
    assert meta.only_lorafit == {"llama.only_in_a": 1} and meta.only_llama_cpp == {"llama.only_in_b": "x"}
    assert meta.naming["general.name"] == {"lorafit": "a", "llama_cpp": "b"}  # reported, not a difference


def test_a_key_of_another_type_is_a_difference(bench, tmp_path: Path) -> None:
    tensor = {"t.weight": np.ones(4, dtype=np.float32)}
    a = write_file(tmp_path / "a.gguf", tensor, {"llama.block_count": 2})
    b_path = tmp_path / "b.gguf"
    writer = gguf.GGUFWriter(b_path, "llama")
    writer.add_int32("llama.block_count", 2)
    writer.add_tensor("t.weight", tensor["t.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta = bench.compare_metadata(a, b_path)
    assert meta.different["llama.block_count"]["types"] == [["UINT32"], ["INT32"]]
    assert bench.compare_tensors(a, b_path).identical


def test_measure_reads_the_childs_own_peak_and_exit_code(bench) -> None:
    hold = "import time; block = bytearray(300 * 2**20); time.sleep(0.2); raise SystemExit(3)"
    run = bench.measure(hold, [])
    assert run.returncode == 3
    assert run.peak_rss_bytes > 300 * 2**20
    assert run.seconds >= 0.2


def test_a_childs_peak_is_not_its_parents(bench) -> None:
    """ru_maxrss of a child starts from the parent's peak: a large parent must not show in a small child."""
    held = bytearray(500 * 2**20)
    held[::4096] = b"x" * len(held[::4096])  # touch every page, so the parent's RSS really holds it
    small = bench.measure("import sys; print(sys.argv[1])", ["hello"])
    assert small.returncode == 0 and small.stdout.strip() == "hello"
    assert small.peak_rss_source == "VmHWM"
    assert small.peak_rss_bytes < 100 * 2**20
    del held


def test_lorafit_matches_llama_cpps_converter_on_the_tiny_model(bench, tiny: tuple[Path, Path], tmp_path) -> None:
    """Runs where `make bench-export` (or the bench once) has extracted llama.cpp's converter; no download here."""
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports sentencepiece (the bench extra)")
    script = bench.extracted_converter(bench.llama_cpp_version(), bench.OUT / "llama-src")
    if script is None:
        pytest.skip("llama.cpp's converter is not extracted in bench/out/llama-src: run `make bench-export` once")
    model_dir, ours = tiny
    theirs = tmp_path / "llama-cpp.gguf"
    run = bench.convert_llama_cpp(script, model_dir, theirs)
    assert run.returncode == 0, run.stderr_tail
    tensors = bench.compare_tensors(ours, theirs)
    assert tensors.identical, tensors.different
    meta = bench.compare_metadata(ours, theirs)
    assert meta.different == {}  # keys present in both agree, tokenizer.ggml.pre among them
    assert "tokenizer.ggml.pre" not in meta.only_lorafit


def test_the_bench_runs_end_to_end_on_the_tiny_model(bench, tmp_path: Path) -> None:
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports sentencepiece (the bench extra)")
    if bench.extracted_converter(bench.llama_cpp_version(), bench.OUT / "llama-src") is None:
        pytest.skip("llama.cpp's converter is not extracted in bench/out/llama-src: run `make bench-export` once")
    out = tmp_path / "result.json"
    assert bench.main(["--tiny", "--repeat", "1", "--workdir", str(tmp_path / "work"), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["goals"]["identical_tensors"] is True
    assert result["tensors"]["different"] == []
    assert len(result["runs"]["lorafit"]["repeats"]) == len(result["runs"]["llama_cpp"]["repeats"]) == 1
    assert result["runs"]["lorafit"]["peak_rss_bytes_max"] > result["imports_only"]["peak_rss_bytes"] * 0.9
    assert not (tmp_path / "work" / "lorafit-f16.gguf").exists()  # the GGUF files go unless --keep


@pytest.mark.parametrize("family", ["qwen3-30b-a3b", "gpt-oss-20b", "gemma-3-4b"])
def test_lorafit_matches_llama_cpps_converter_on_moe_and_image_text_families(
    bench, family: str, tmp_path: Path
) -> None:
    """The stacked (Qwen3-MoE) and de-interleaved, transposed (gpt-oss) experts and Gemma 3's language model with
    its norms + 1 are the tensors llama.cpp's own converter writes, byte for byte, and no key both write differs."""
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports sentencepiece (the bench extra)")
    script = bench.extracted_converter(bench.llama_cpp_version(), bench.OUT / "llama-src")
    if script is None:
        pytest.skip("llama.cpp's converter is not extracted in bench/out/llama-src: run `make bench-export` once")
    from lorafit.export.gguf import write_gguf

    model_dir = tmp_path / "model"
    bench.build(model_dir, tiny=True, family=family)
    ours, theirs = tmp_path / "lorafit.gguf", tmp_path / "llama-cpp.gguf"
    write_gguf(model_dir, ours, "f16")
    run = bench.convert_llama_cpp(script, model_dir, theirs)
    assert run.returncode == 0, run.stderr_tail
    tensors = bench.compare_tensors(ours, theirs)
    assert tensors.identical, tensors.different
    assert any("_exps." in name for name in tensors.equal) or family == "gemma-3-4b"
    assert bench.compare_metadata(ours, theirs).different == {}
