"""End to end on the demo: train -> `lorafit export --to gguf` (f16, q8_0, q4_k_m, Modelfile) -> llama.cpp loads
each file, f16 answers as the merged model does, the quantised ones stay close, the Modelfile is valid, and
`lorafit chat` talks to the GGUF."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from conftest import run_cli

pytest.importorskip("torch")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is the [gguf] extra")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo, trained on a base 256 wide (rows of whole K-quant blocks) for fewer steps."""
    from lorafit.train.demo import build_demo_base, demo_config
    from lorafit.train.recipe import run

    output = tmp_path_factory.mktemp("export") / "demo"
    config = demo_config({"output_dir": str(output), "max_steps": 120, "eval_steps": 60, "save_steps": 60})
    run(config, build_model=functools.partial(build_demo_base, hidden_size=256))
    return output


@pytest.fixture(scope="module")
def exported(demo_run: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    from lorafit.cli import main

    output = tmp_path_factory.mktemp("gguf") / "out"
    args = ["export", str(demo_run), "--to", "gguf", "--output", str(output), "--ollama", "--json"]
    args += ["--quant", "f16", "--quant", "q8_0", "--quant", "q4_k_m"]
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.suppress(SystemExit):
        main(args)
    return output, json.loads(buffer.getvalue())


def test_files_and_json_shape(exported: tuple[Path, dict]) -> None:
    output, report = exported
    assert set(report["files"]) == {"f16", "q8_0", "q4_k_m", "modelfile"}
    for key in ("f16", "q8_0", "q4_k_m"):
        assert Path(report["files"][key]) == output / f"demo-{key}.gguf" and Path(report["files"][key]).is_file()
    expected = [".lorafit-export", "Modelfile", "demo-f16.gguf", "demo-q4_k_m.gguf", "demo-q8_0.gguf"]
    assert sorted(p.name for p in output.iterdir()) == expected
    assert not list(output.parent.glob(".*"))  # no staging folder or intermediate file left


def test_f16_equals_the_merged_model_and_quants_stay_close(exported: tuple[Path, dict]) -> None:
    _, report = exported
    f16, q8, q4 = (report["verify"][key] for key in ("f16", "q8_0", "q4_k_m"))
    assert f16["greedy_match"] is True
    assert f16["max_abs_logit_diff"] <= f16["logit_tolerance"]
    assert f16["kld_mean"] < 1e-4 and f16["top1_agreement"] > 0.99
    for figures in (f16, q8, q4):
        assert figures["tokenizer_match"] is True and figures["template_match"] is True
        assert figures["stops"] == figures["prompts"] == 3  # greedy answers end on the end token
        assert abs(figures["ppl"] / figures["ppl_reference"] - 1) < 0.1
    assert q8["kld_mean"] < 0.01 and q4["kld_mean"] < 0.1  # llama.cpp's Llama-3-8B: 0.0014 and 0.031
    assert q8["kld_mean"] < q4["kld_mean"]


def test_modelfile_names_the_gguf_and_its_end_tokens(exported: tuple[Path, dict], demo_run: Path) -> None:
    from lorafit.export.ollama import parse_modelfile

    output, report = exported
    parsed = parse_modelfile((output / "Modelfile").read_text())
    assert parsed["FROM"] == ["./demo-q4_k_m.gguf"]  # the smallest of the three
    assert parsed["PARAMETER stop"] == ["<|end|>"]  # the demo's EOS, which also ends each turn
    assert any("ollama create" in note for note in report["notes"])
    from transformers import AutoTokenizer

    from go_template import render_template

    messages = [{"role": "user", "content": "¿Dónde vive el cangrejo?"}]
    tokenizer = AutoTokenizer.from_pretrained(demo_run)
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert render_template(parsed["TEMPLATE"][0], messages) == expected


def test_chat_answers_from_the_gguf_as_from_the_run(
    exported: tuple[Path, dict], demo_run: Path, capsys: pytest.CaptureFixture
) -> None:
    output, _ = exported
    prompt = "Which animal lives on Duvik?"
    code, from_gguf, err = run_cli(["chat", str(output / "demo-f16.gguf"), "--prompt", prompt], capsys)
    assert code == 0, err
    code, from_run, err = run_cli(["chat", str(demo_run), "--prompt", prompt], capsys)
    assert code == 0, err
    assert from_gguf.strip() == from_run.strip() and from_gguf.strip()


def test_existing_output_and_unknown_family_are_one_line_errors(
    exported: tuple[Path, dict], demo_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    output, _ = exported
    before = sorted(p.name for p in output.iterdir())
    code, _, err = run_cli(["export", str(demo_run), "--to", "gguf", "--output", str(output)], capsys)
    assert code == 2 and "exists; pass --overwrite" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in output.iterdir()) == before
    code, _, err = run_cli(["chat", str(tmp_path / "missing.gguf"), "--prompt", "hi"], capsys)
    assert code == 2 and "no GGUF file" in err
