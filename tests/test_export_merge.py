"""`lorafit export --to merged`: the merge against peft's own, the checks on the run and its base, and the output
folder's safety (refusals, no half-written folder)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import run_cli
from lorafit.errors import ExportError

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")


def build_run(root: Path, *, hidden: int = 64, shards: bool = False, dtype: str = "float32") -> Path:
    """A base model folder and a run folder holding a LoRA adapter with non-zero B (as training leaves it)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lorafit.train import demo
    from lorafit.train.runfolder import model_digest, write_run_file

    tokenizer = demo.build_tokenizer(demo.corpus(), vocab_size=512)
    base_dir, run_dir = root / "base", root / "run"
    demo.build_model(base_dir, tokenizer, demo.tiny_spec(len(tokenizer), hidden_size=hidden))
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=getattr(torch, dtype))
    if shards or dtype != "float32":
        shutil.rmtree(base_dir)
        model.save_pretrained(base_dir, max_shard_size="100KB" if shards else "5GB")
        tokenizer.save_pretrained(base_dir)
    config = LoraConfig(r=4, lora_alpha=12, target_modules="all-linear", init_lora_weights=False)
    torch.manual_seed(1)
    adapted = get_peft_model(model, config)
    adapted.save_pretrained(run_dir)
    tokenizer.save_pretrained(run_dir)
    adapter_config = run_dir / "adapter_config.json"
    data = json.loads(adapter_config.read_text()) | {"base_model_name_or_path": str(base_dir)}
    adapter_config.write_text(json.dumps(data))
    write_run_file(run_dir, {"status": "finished", "base_digest": model_digest(base_dir)})
    return run_dir


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_run(tmp_path_factory.mktemp("merge"))


def test_merge_equals_peft_merge_and_unload(run_dir: Path, tmp_path: Path) -> None:
    """The streamed merge gives the weights peft's merge_and_unload gives, and a folder transformers loads alone."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lorafit.export import merge, source

    result = merge.merge(source.open_run(run_dir), tmp_path / "merged", overwrite=False)
    assert result.check is not None and result.check.passed and result.check.max_abs_diff is not None
    base = AutoModelForCausalLM.from_pretrained(run_dir.parent / "base")
    expected = PeftModel.from_pretrained(base, run_dir).merge_and_unload().state_dict()
    ours = load_file(tmp_path / "merged" / "model.safetensors")
    adapted = [name for name in ours if "proj" in name]
    assert adapted
    for name, value in ours.items():
        assert torch.allclose(value, expected[name], atol=1e-6), name
    base_weights = load_file(run_dir.parent / "base" / "model.safetensors")
    assert not torch.equal(ours[adapted[0]], base_weights[adapted[0]])  # the adapter really moved the weights
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in config
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (tmp_path / "merged" / name).is_file(), name
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert loaded.config.vocab_size == base.config.vocab_size


def test_sharded_bf16_base_keeps_its_layout_and_dtype(tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lorafit.export import merge, source

    run = build_run(tmp_path, shards=True, dtype="bfloat16")
    base_files = sorted(p.name for p in (tmp_path / "base").glob("*.safetensors"))
    assert len(base_files) > 1
    result = merge.merge(source.open_run(run), tmp_path / "merged", overwrite=False)
    assert sorted(p.name for p in (tmp_path / "merged").glob("*.safetensors")) == base_files
    assert (tmp_path / "merged" / "model.safetensors.index.json").is_file()
    assert result.check is not None and result.check.passed
    merged = {}
    for name in base_files:
        merged |= load_file(tmp_path / "merged" / name)
    assert {value.dtype for value in merged.values()} == {torch.bfloat16}
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    expected = PeftModel.from_pretrained(base, run).merge_and_unload().state_dict()
    for name, value in merged.items():  # one rounding to bf16 of the fp32 sum
        assert torch.allclose(value.float(), expected[name], rtol=2**-7, atol=1e-6), name


def test_changed_base_is_refused(run_dir: Path, tmp_path: Path) -> None:
    from lorafit.export import source

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    base_copy = tmp_path / "base"
    shutil.copytree(run_dir.parent / "base", base_copy)
    adapter = copy / "adapter_config.json"
    adapter.write_text(json.dumps(json.loads(adapter.read_text()) | {"base_model_name_or_path": str(base_copy)}))
    config = json.loads((base_copy / "config.json").read_text()) | {"rms_norm_eps": 1e-3}
    (base_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="not the one this run trained on"):
        source.open_run(copy)


def test_base_of_another_shape_is_refused_without_a_digest(run_dir: Path, tmp_path: Path) -> None:
    """A run from before the digest was recorded: the shapes of B @ A against the base still catch another model."""
    from lorafit.export import source
    from lorafit.train import demo

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / "lorafit-run.json").unlink()
    other = tmp_path / "other"
    tokenizer = demo.build_tokenizer(demo.corpus(), vocab_size=512)
    demo.build_model(other, tokenizer, demo.tiny_spec(len(tokenizer), hidden_size=96, heads=4))
    adapter = copy / "adapter_config.json"
    adapter.write_text(json.dumps(json.loads(adapter.read_text()) | {"base_model_name_or_path": str(other)}))
    with pytest.raises(ExportError, match="differs from the one the adapter was trained on"):
        source.open_run(copy)


def test_missing_base_and_non_run_folders(run_dir: Path, tmp_path: Path) -> None:
    from lorafit.export import source

    with pytest.raises(ExportError, match="no run folder"):
        source.open_run(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="holds no adapter or model"):
        source.open_run(tmp_path / "empty")
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    adapter = copy / "adapter_config.json"
    adapter.write_text(json.dumps(json.loads(adapter.read_text()) | {"base_model_name_or_path": str(tmp_path / "x")}))
    with pytest.raises(ExportError, match="base model .* is not there"):
        source.open_run(copy)


def test_output_is_refused_unless_overwrite_and_never_half_written(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lorafit.export import merge, source

    run = source.open_run(run_dir)
    output = tmp_path / "merged"
    merge.merge(run, output, overwrite=False)
    (output / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="exists; pass --overwrite"):
        merge.merge(run, output, overwrite=False)
    assert (output / "keep.txt").read_text() == "mine"

    def broken(*args: object, **kwargs: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(merge, "write_streamed", broken)
    with pytest.raises(ExportError, match=r"could not write .*merged: no space left on device.*partial export was"):
        merge.merge(run, output, overwrite=True)  # a disk that fills while writing: one line, no traceback
    assert (output / "keep.txt").read_text() == "mine"  # the old output stays until the new one is complete
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]  # no staging folder left behind
    monkeypatch.undo()
    merge.merge(run, output, overwrite=True)
    assert not (output / "keep.txt").exists() and (output / "model.safetensors").is_file()


def test_overwrite_replaces_only_an_earlier_export_of_the_same_kind(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """--overwrite never deletes a folder of other files, the run, its base, a folder holding them, `.` or `..`;
    a path under a file is one line too."""
    from lorafit.export import job

    base_dir = run_dir.parent / "base"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    (tmp_path / "notes.txt").write_text("a file")
    work = tmp_path / "work" / "here"
    work.mkdir(parents=True)
    (work / "keep.txt").write_text("mine")
    gguf = tmp_path / "gguf"
    job.export_gguf(run_dir, gguf, ["f16"], overwrite=False, check=False, ollama=False)
    before = {path: sorted(p.name for p in path.iterdir()) for path in (mine, run_dir, base_dir, work, gguf)}
    monkeypatch.chdir(work)
    for output, message in [
        (mine, "not the output of an earlier `lorafit export --to merged`"),
        (gguf, "not the output of an earlier `lorafit export --to merged`"),
        (run_dir, "would replace"),
        (base_dir, "would replace"),
        (run_dir.parent, "would replace"),
        (Path("."), "would replace the current folder"),
        (Path(".."), "would replace the current folder"),
        (tmp_path / "notes.txt" / "sub", "is a file, not a folder"),
    ]:
        args = ["export", str(run_dir), "--to", "merged", "--output", str(output), "--overwrite"]
        code, _, err = run_cli(args, capsys)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (output, err)
    for output in (mine, run_dir, base_dir):  # the same rules for --to gguf
        args = ["export", str(run_dir), "--to", "gguf", "--no-verify", "--output", str(output), "--overwrite"]
        code, _, err = run_cli(args, capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, (output, err)
    assert before == {path: sorted(p.name for p in path.iterdir()) for path in before}
    assert (mine / "thesis.tex").read_text() == "years of work"
    code, _, err = run_cli(["export", str(run_dir), "--to", "merged", "--output", str(tmp_path / "m")], capsys)
    assert code == 0, err
    code, _, err = run_cli(["export", str(run_dir), "--to", "merged", "--output", "../../m", "--overwrite"], capsys)
    assert code == 0, err  # an earlier merged export is replaced


def test_killed_exports_leave_nothing_the_next_one_keeps(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kill leaves `.NAME.partial-PID`; the next export to NAME removes those whose process is gone (only
    those: another name, a live process, a name that only looks alike stay)."""
    import os
    import subprocess
    import sys

    from lorafit.export import job

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    left = [tmp_path / f".merged.partial-{dead}", tmp_path / f".merged.partial-{dead + 1_000_000_000}"]
    kept = [tmp_path / f".merged.partial-{os.getppid()}", tmp_path / f".other.partial-{dead}"]
    kept += [tmp_path / f".merged.partial-{dead}x", tmp_path / f".merged.retired-{dead}"]
    for folder in left + kept:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"0" * 1000)
    result = job.export_merged(run_dir, tmp_path / "merged", overwrite=False)
    assert not any(folder.exists() for folder in left) and all(folder.exists() for folder in kept)
    assert any("removed 2 folder(s) killed exports left" in note for note in result.notes)
    # an earlier output moved aside when the kill came between the two renames: its only copy, kept and named
    assert any(f"kept at {tmp_path / f'.merged.retired-{dead}'}" in note for note in result.notes)
    job.export_merged(run_dir, tmp_path / "merged", overwrite=True)
    assert not (tmp_path / f".merged.retired-{dead}").exists()  # the output is there again: removed


def test_ctrl_c_says_what_was_left(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from lorafit.export import merge

    def interrupted(*args: object, **kwargs: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(merge, "write_streamed", interrupted)
    args = ["export", str(run_dir), "--to", "merged", "--output", str(tmp_path / "m")]
    code, _, err = run_cli(args, capsys)
    assert code == 130 and "export interrupted: its partial files were removed" in err, err
    assert list(tmp_path.iterdir()) == []


def test_not_enough_disk_is_refused_before_writing(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lorafit.export import merge, source
    from lorafit.train import failures

    monkeypatch.setattr(failures, "free_bytes", lambda path: 1000)
    with pytest.raises(ExportError, match="not enough disk space"):
        merge.merge(source.open_run(run_dir), tmp_path / "merged", overwrite=False)
    assert list(tmp_path.iterdir()) == []
    # a few megabytes free: the message shows them and the margin it keeps, not "0.00 GB"
    monkeypatch.setattr(failures, "free_bytes", lambda path: 20_000_000)
    with pytest.raises(ExportError, match=r"needs [\d.]+ MB plus a 67.1 MB margin, 20.0 MB are free"):
        merge.merge(source.open_run(run_dir), tmp_path / "merged", overwrite=False)


def test_a_folder_that_cannot_be_written_is_not_called_a_full_disk(run_dir: Path, tmp_path: Path) -> None:
    from lorafit.export import merge, source

    with pytest.raises(ExportError, match="cannot write in /proc") as error:
        merge.merge(source.open_run(run_dir), Path("/proc/lorafit-merged"), overwrite=False)
    assert "disk space" not in str(error.value)


def test_cli_merged_json_and_one_line_errors(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["export", str(run_dir), "--to", "merged", "--output", str(tmp_path / "m"), "--json"]
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["files"] == {"merged": str(tmp_path / "m")}
    assert report["verify"]["merged"]["max_abs_logit_diff"] <= report["verify"]["merged"]["tolerance"]
    cases = [
        (["export", str(run_dir), "--to", "merged", "--output", str(tmp_path / "m")], "exists; pass --overwrite"),
        (["export", str(run_dir), "--output", str(tmp_path / "n")], "pass --to merged"),
        (["export", str(run_dir), "--to", "onnx", "--output", str(tmp_path / "n")], "must be one of merged, gguf"),
        (["export", str(tmp_path / "missing"), "--to", "merged", "--output", str(tmp_path / "n")], "no run folder"),
        (["export", str(run_dir), "--to", "gguf", "--quant", "q7", "--output", str(tmp_path / "n")], "--quant q7"),
        (["export", str(run_dir), "--to", "merged", "--quant", "f16", "--output", str(tmp_path / "n")], "--to gguf"),
    ]
    for args, message in cases:
        code, out, err = run_cli(args, capsys)
        assert code == 2, (args, err)
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "n").exists()


def test_a_base_stored_in_4_bits_is_dequantised_and_said_so(tmp_path: Path) -> None:
    """No 16-bit weights to merge into: the NF4 codes are dequantised (bitsandbytes), B @ A added, and the
    export says so; the merged folder has no quantization_config and loads as a plain model."""
    from peft.utils.integrations import dequantize_bnb_weight
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from lorafit.export import job

    run = build_run(tmp_path, hidden=128)
    quantized = AutoModelForCausalLM.from_pretrained(
        tmp_path / "base",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32),
    )
    quantized.save_pretrained(tmp_path / "qbase")
    AutoTokenizer.from_pretrained(tmp_path / "base").save_pretrained(tmp_path / "qbase")
    adapter = run / "adapter_config.json"
    pointed = json.loads(adapter.read_text()) | {"base_model_name_or_path": str(tmp_path / "qbase")}
    adapter.write_text(json.dumps(pointed))
    (run / "lorafit-run.json").unlink()
    result = job.export_merged(run, tmp_path / "merged", overwrite=False)
    assert any("stored quantised" in note for note in result.notes)
    check = result.verify["merged"]
    assert check["max_abs_logit_diff"] <= check["tolerance"]
    assert "quantization_config" not in json.loads((tmp_path / "merged" / "config.json").read_text())
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    layer = quantized.model.layers[0].self_attn.q_proj
    dequantised = dequantize_bnb_weight(layer.weight, state=layer.weight.quant_state).float()
    lora = load_file(run / "adapter_model.safetensors")
    a = next(v for k, v in lora.items() if "layers.0.self_attn.q_proj.lora_A" in k)
    b = next(v for k, v in lora.items() if "layers.0.self_attn.q_proj.lora_B" in k)
    expected = dequantised + (12 / 4) * b @ a
    assert torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"].float(), expected, atol=1e-5)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert getattr(plain.config, "quantization_config", None) is None


def test_gguf_without_llama_cpp_writes_unverified_f16_and_refuses_k_quants(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the gguf extra: f16/q8_0 are still written (said to be unverified); a K-quant, which only
    llama.cpp's quantizer makes, is refused before anything is written."""
    from lorafit.export import job, verify

    monkeypatch.setattr(verify, "llama_cpp_available", lambda: False)
    with pytest.raises(ExportError, match="llama.cpp's quantizer"):
        job.export_gguf(run_dir, tmp_path / "k", ["q4_k_m"], overwrite=False, check=True, ollama=False)
    assert not (tmp_path / "k").exists()
    result = job.export_gguf(run_dir, tmp_path / "g", ["f16", "q8_0"], overwrite=False, check=True, ollama=False)
    assert sorted(result.files) == ["f16", "q8_0"] and all(path.is_file() for path in result.files.values())
    assert result.verify == {} and any("not verified" in note for note in result.notes)
    assert sorted(p.name for p in (tmp_path / "g").iterdir()) == [".lorafit-export", "run-f16.gguf", "run-q8_0.gguf"]


def test_the_modelfile_points_at_the_smallest_file_and_says_so(run_dir: Path, tmp_path: Path) -> None:
    """Several quants, one Modelfile: it runs the smallest file (the one a small card needs), and the note says
    which."""
    from lorafit.export import job
    from lorafit.export.ollama import parse_modelfile

    output = tmp_path / "g"
    result = job.export_gguf(run_dir, output, ["f16", "q8_0"], overwrite=False, check=False, ollama=True)
    assert (output / "run-q8_0.gguf").stat().st_size < (output / "run-f16.gguf").stat().st_size
    assert parse_modelfile(result.files["modelfile"].read_text())["FROM"] == ["./run-q8_0.gguf"]
    assert any(note.startswith("Modelfile for run-q8_0.gguf") for note in result.notes)


def test_the_check_table_says_what_its_columns_count() -> None:
    import io

    from rich.console import Console

    from lorafit.export import cli, job

    figures = {"kld_mean": 0.001, "top1_agreement": 0.98, "ppl": 5.1, "ppl_reference": 5.0}
    figures |= {"tokenizer_match": True, "greedy_match": True, "stops": 2, "prompts": 3}
    console = Console(file=io.StringIO(), width=200)
    cli.show(job.ExportResult(files={"f16": Path("run-f16.gguf")}, verify={"f16": figures}), console)
    text = console.file.getvalue()
    assert "2/3" in text and "stops: greedy answers that ended on an end-of-turn or EOS token within" in text


def test_chat_trust_remote_code_reaches_the_tokenizer(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A model whose tokenizer is custom code in its folder loads with --trust-remote-code (and only with it)."""
    from lorafit.export import job

    model = tmp_path / "model"
    job.export_merged(run_dir, model, overwrite=False)
    (model / "tokenization_custom.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\nclass CustomTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n"
    )
    config = json.loads((model / "tokenizer_config.json").read_text())
    config |= {
        "tokenizer_class": "CustomTokenizer",
        "auto_map": {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]},
    }
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    args = ["chat", str(model), "--prompt", "hi", "--max-new-tokens", "2"]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "tokenizer" in err, err
    code, _, err = run_cli([*args, "--trust-remote-code"], capsys)
    assert code == 0, err


def test_output_names_up_to_the_file_system_limit_are_written_longer_ones_refused(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The hidden staging folder adds a prefix and suffix to the name: a legal 255-byte name still works."""
    longest = tmp_path / ("m" * 255)
    code, _, err = run_cli(["export", str(run_dir), "--to", "merged", "--output", str(longest)], capsys)
    assert code == 0 and (longest / "model.safetensors").is_file(), err
    code, _, err = run_cli(["export", str(run_dir), "--to", "merged", "--output", str(longest), "--overwrite"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["export", str(run_dir), "--to", "merged", "--output", str(tmp_path / ("m" * 256))], capsys)
    assert code == 2 and "256 bytes" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [longest.name]
