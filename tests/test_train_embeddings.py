"""train_embeddings: LoRA/QLoRA that also trains the input embeddings and the LM head in full (peft's
modules_to_save): the run folder's adapter holds the trained copies, a merge and a GGUF export carry them, the
estimate counts what the traced step holds, and the other tools' configs that say so read as the setting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import export_checked, run_cli, tiny_spec, train_tiny
from lorafit import configs

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
PEFT_PREFIX = "base_model.model."


def trained_copies(run: Path) -> dict:
    """The adapter's tensors that are not LoRA matrices, by the base tensor they replace."""
    from safetensors.torch import load_file

    weights = load_file(run / "adapter_model.safetensors")
    return {name.removeprefix(PEFT_PREFIX): value for name, value in weights.items() if ".lora_" not in name}


def test_the_run_trains_the_embeddings_and_head_and_the_merge_carries_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch
    from safetensors.torch import load_file

    from lorafit.export import merge, source

    spec_of = lambda vocab: tiny_spec("llama-3.1-8b", vocab_size=vocab)  # noqa: E731
    run, _ = train_tiny(tmp_path, spec_of, capsys, "--train-embeddings")
    base = load_file(tmp_path / "model" / "model.safetensors")
    copies = trained_copies(run)
    assert set(copies) == {EMBED, HEAD}
    for name, value in copies.items():
        assert value.shape == base[name].shape
        assert not torch.equal(value.float(), base[name].float()), name  # trained, not the frozen original
    merge.merge(source.open_run(run), tmp_path / "merged", overwrite=False)
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    for name, value in copies.items():
        assert torch.equal(merged[name], value.to(merged[name].dtype)), name
    export_checked(run, tmp_path / "gguf", capsys, "f32")


def test_tied_embeddings_train_as_one_module(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    from safetensors.torch import load_file

    spec_of = lambda vocab: tiny_spec("llama-3.2-1b", vocab_size=vocab)  # noqa: E731
    run, spec = train_tiny(tmp_path, spec_of, capsys, "--train-embeddings")
    assert spec.tie_word_embeddings
    base = load_file(tmp_path / "model" / "model.safetensors")
    copies = trained_copies(run)
    assert not torch.equal(copies[EMBED].float(), base[EMBED].float())
    assert all(torch.equal(value, copies[EMBED]) for value in copies.values())  # the head's copy is the same weight


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--method", "full"], "full fine-tuning trains them already"),
        (["--offload-embeddings"], "train_embeddings trains them"),
        (["--stack", "litgpt"], "stack litgpt has no modules_to_save"),
    ],
)
def test_where_it_cannot_run_it_is_refused_in_one_line(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(["estimate", "-m", "llama-3.1-8b", "--train-embeddings", *flags], capsys)
    assert code == 2 and out == ""
    assert says in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("model", "method", "grad_accum"),
    [
        ("llama-3.1-8b", "qlora", 1),
        ("llama-3.1-8b", "qlora", 2),
        ("llama-3.2-1b", "lora", 1),
        ("llama-3.2-1b", "qlora", 2),
    ],
)
def test_the_estimate_counts_what_the_traced_step_holds(model: str, method: str, grad_accum: int) -> None:
    """Against the `--exact` trace of the real transformers + peft step at a real shape (fake tensors)."""
    from lorafit import memory, models
    from lorafit.schema import Settings
    from lorafit.trace import exact_estimate

    spec = models.resolve(model)
    settings = Settings(method=method, seq_len=512, grad_accum=grad_accum, train_embeddings=True)
    estimated, traced = memory.estimate(spec, settings), exact_estimate(spec, settings)
    assert traced.trainable_params == estimated.trainable_params > spec.embedding_params
    assert estimated.peak_allocated_gib == pytest.approx(traced.peak_allocated_gib, rel=0.03)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        (
            "axolotl.yml",
            "base_model: x\nadapter: qlora\nload_in_4bit: true\nlora_modules_to_save: [embed_tokens, lm_head]\n",
        ),
        ("trl.yaml", "model_name_or_path: x\nuse_peft: true\nlora_modules_to_save: [lm_head]\n"),
        (
            "llama_factory.yaml",
            "model_name_or_path: x\nstage: sft\nfinetuning_type: lora\nadditional_target: embed_tokens,lm_head\n",
        ),
    ],
)
def test_a_config_that_trains_the_embeddings_reads_as_the_setting(name: str, text: str, tmp_path: Path) -> None:
    (tmp_path / name).write_text(text)
    read = configs.read(tmp_path / name)
    assert read.values["train_embeddings"] is True
    assert not any("modules_to_save" in line for line in read.unmodelled)


def test_a_config_that_trains_other_modules_stays_unmodelled(tmp_path: Path) -> None:
    path = tmp_path / "axolotl.yml"
    path.write_text("base_model: x\nadapter: lora\nlora_modules_to_save: [embed_tokens, norm]\n")
    read = configs.read(path)
    assert "train_embeddings" not in read.values
    assert any(line.startswith("lora_modules_to_save") for line in read.unmodelled)
    assert json.dumps(read.values)  # still a readable config


def test_the_plan_says_what_training_the_embeddings_costs_and_keeps_them_on_the_gpu(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["plan", "-m", "llama-3.1-8b", "--gpu", "RTX 4090", "--seq-len", "2048"]
    code, frozen, err = run_cli([*args, "--json"], capsys)
    assert code == 0, err
    code, trained, err = run_cli([*args, "--train-embeddings", "--json"], capsys)
    assert code == 0, err  # the planner does not pick offload_embeddings, which the setting rules out
    frozen_plan, trained_plan = json.loads(frozen), json.loads(trained)
    assert trained_plan["settings"]["train_embeddings"] is True
    assert trained_plan["settings"]["offload_embeddings"] is False
    assert trained_plan["estimate"]["trainable_params"] > frozen_plan["estimate"]["trainable_params"] + 10**9
    code, out, err = run_cli([*args, "--train-embeddings"], capsys)
    assert "embeddings and LM head" in out and "GiB at the peak" in out
