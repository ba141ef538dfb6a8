"""The embedded demo: bundled data as its generator writes it, an honest held-out split, and a run that learns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import load_script, run_cli
from lorafit.cli import main
from lorafit.train.demo import BASE_COMPLETE, REQUIRED_DROP, demo_file


def generator():  # noqa: ANN201 - the module object of tools/make_demo_data.py
    return load_script("tools/make_demo_data.py")


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


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

    # The same command again: the run is finished, so it says so in one line and changes nothing.
    before = folder_bytes(out)
    code, text, err = run_cli(["train", "--demo", "--output-dir", str(out), "--max-steps", "120"], capsys)
    assert (code, err) == (0, "")
    assert "finished after 120 steps" in text and "--overwrite" in text and "step 121" not in text
    assert folder_bytes(out) == before


def test_a_demo_base_cut_short_by_a_full_disk_is_built_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The base model's weights fail to save (a full disk): one line, nothing half-built left behind, and the
    next run builds it; a base an earlier version left without its weights is rebuilt too."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    def full_disk(*args: object, **kwargs: object) -> None:  # safetensors' words for ENOSPC, measured
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    out = tmp_path / "demo"
    args = ["train", "--demo", "--output-dir", str(out), "--max-steps", "2"]
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    code, _, err = run_cli(args, capsys)
    assert code == 2 and err.count("\n") == 1 and "no space left on device" in err
    assert not (out / "base-model").exists() and not list(out.glob(".base-model*"))

    monkeypatch.undo()  # space freed
    code, text, err = run_cli(args, capsys)
    assert code in (0, 1), err  # 1: two steps do not teach the facts, which the demo says
    assert (out / "base-model" / "model.safetensors").is_file() and (out / "base-model" / BASE_COMPLETE).is_file()
    assert "held-out questions" in text

    # What an earlier lorafit left when the disk filled up while it saved the base: the run file and a
    # base folder with its config but no weights (and no marker).
    import json
    import shutil

    for entry in out.iterdir():
        if entry.name not in ("base-model", "lorafit-run.json"):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    for entry in (out / "base-model").iterdir():
        if entry.name != "config.json":
            entry.unlink()
    run_file = json.loads((out / "lorafit-run.json").read_text())
    (out / "lorafit-run.json").write_text(json.dumps(run_file | {"status": "started"}))
    code, _, err = run_cli(args, capsys)
    assert code in (0, 1), err
    assert (out / "base-model" / "model.safetensors").is_file()
