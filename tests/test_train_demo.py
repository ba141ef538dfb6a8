"""The embedded demo: bundled data as its generator writes it, an honest held-out split, and a run that learns."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from lorafit.cli import main
from lorafit.train.demo import REQUIRED_DROP, demo_file


def generator():  # noqa: ANN201 - the module object of demo/make_instructions.py
    spec = importlib.util.spec_from_file_location("make_instructions", demo_file("make_instructions.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in demo_file(name).read_text().splitlines()]


def test_the_bundled_data_is_what_the_generator_writes() -> None:
    make = generator()
    train, held_out = make.conversations()
    assert demo_file("instructions.jsonl").read_text() == make.jsonl(train)
    assert demo_file("heldout.jsonl").read_text() == make.jsonl(held_out)


def test_held_out_questions_are_new_phrasings_of_taught_facts() -> None:
    islands = generator().ISLANDS
    train, held_out = rows("instructions.jsonl"), rows("heldout.jsonl")
    assert (len(train), len(held_out)) == (288, 72)
    train_prompts = {row["messages"][0]["content"] for row in train}
    assert not train_prompts & {row["messages"][0]["content"] for row in held_out}

    def island(prompt: str) -> str:
        (name,) = [name for name in islands if name in prompt]
        return name

    taught = {(island(row["messages"][0]["content"]), row["messages"][1]["content"]) for row in train}
    for row in held_out:  # the fact is in the training rows, asked in other words
        assert (island(row["messages"][0]["content"]), row["messages"][1]["content"]) in taught


def test_the_bundled_text_is_small() -> None:
    total = sum(path.stat().st_size for path in demo_file("").iterdir() if path.is_file())
    assert total < 300_000


def test_the_demo_learns_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A shortened demo (120 of its 300 steps) already passes the demo's own bar on held-out questions."""
    out = tmp_path / "demo"
    try:
        main(["train", "--demo", "--output-dir", str(out), "--max-steps", "120"])
    except SystemExit as exit_:
        assert exit_.code in (0, None), capsys.readouterr().err
    text = capsys.readouterr().out
    assert "learned" in text and "did not learn" not in text
    assert "before (base model)" in text and "after (QLoRA adapter)" in text
    run = json.loads((out / "lorafit-run.json").read_text())
    assert run["eval_after"] < (1 - REQUIRED_DROP) * run["eval_before"]
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert Path(adapter["base_model_name_or_path"]) == (out / "base-model").resolve()
    assert (out / "base-model" / "model.safetensors").is_file()
