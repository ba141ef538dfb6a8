"""Llama 3.2 Vision (model_type mllama) fine-tuned on text: the names people type resolve, the language model that
AutoModelForCausalLM builds is counted (its cross-attention layers stored, packed under QLoRA, skipped by text rows
and left without adapters), its config.json is read, the estimate agrees with the trace, `lorafit train` runs a
tiny random copy on the CPU, and GGUF export says in one line why not and what works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import (
    adapter_names,
    build_on_meta,
    lora_trained,
    merged_changes,
    packed_4bit,
    randomize_lora_b,
    refused,
    run_cli,
    run_train,
    word_rows,
)
from lorafit import memory
from lorafit.errors import InvalidConfig
from lorafit.models import ModelSpec, catalog, from_config_json, resolve
from lorafit.schema import Settings
from test_models import TINY

torch = pytest.importorskip("torch")

PRESETS = ("llama-3.2-11b-vision", "llama-3.2-90b-vision")
# a 2 + 1 layer copy: self-attention, cross-attention, self-attention
TINY_MLLAMA = TINY | {"cross_attention": {"layers": [1]}}
# the tiny vision tower a hub-like folder holds (MllamaVisionConfig keys)
TINY_TOWER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_global_layers": 1,
    "attention_heads": 2,
    "vision_output_dim": 64,
    "image_size": 28,
    "patch_size": 14,
    "intermediate_layers_indices": [0],
}


def tiny(**changes: object) -> ModelSpec:
    return catalog()["llama-3.2-11b-vision"].scaled(**(TINY_MLLAMA | changes))


@pytest.mark.parametrize(
    ("hub_id", "preset"),
    [
        ("meta-llama/Llama-3.2-11B-Vision", "llama-3.2-11b-vision"),
        ("meta-llama/Llama-3.2-11B-Vision-Instruct", "llama-3.2-11b-vision"),
        ("unsloth/Llama-3.2-11B-Vision-Instruct", "llama-3.2-11b-vision"),
        ("meta-llama/Llama-3.2-90B-Vision", "llama-3.2-90b-vision"),
        ("meta-llama/Llama-3.2-90B-Vision-Instruct", "llama-3.2-90b-vision"),
    ],
)
def test_the_names_people_type_resolve(hub_id: str, preset: str) -> None:
    spec = resolve(hub_id)
    assert spec.cross_attention is not None and spec.num_params == catalog()[preset].num_params


def test_plan_answers_for_llama_3_2_vision(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["plan", "--model", "meta-llama/Llama-3.2-11B-Vision", "--gpu", "h100-80gb"], capsys)
    assert code == 0, err
    said = " ".join(out.split())
    assert "8 cross-attention layers" in said and "images in the data are not modelled" in said
    code, out, err = run_cli(["plan", "--model", "llama-3.2-11b-vision", "--gpu", "h100-80gb", "--json"], capsys)
    served = [row["format"] for row in json.loads(out)["serving"]["formats"]]
    assert code == 0 and "bf16" in served and not [name for name in served if "gguf" in name]  # llama.cpp has none


def test_image_rows_are_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    turns = [
        {"role": "user", "content": [{"type": "image", "url": "heron.png"}, {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": "A heron."},
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"messages": turns}) + "\n" for _ in range(3)))
    args = ["plan", "--model", "meta-llama/Llama-3.2-11B-Vision-Instruct", "--gpu", "rtx-4090", "--data", str(data)]
    err = refused(args, capsys)
    assert "keep only the text rows" in err


@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_is_the_language_model_auto_model_for_causal_lm_builds(name: str) -> None:
    """MllamaForCausalLM: the self- and cross-attention layers, no vision tower, untied head, 8 extra embedding
    rows (the meta-device count; the whole checkpoint with its tower is the model card's 10.6B / 88.6B)."""
    spec = catalog()[name]
    model = build_on_meta(spec)
    assert type(model).__name__ == "MllamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == spec.num_params == spec.published_params
    layers = model.model.layers
    cross = [i for i, layer in enumerate(layers) if type(layer).__name__ == "MllamaCrossAttentionDecoderLayer"]
    assert assert_cross(spec) == tuple(cross) and len(layers) - len(cross) == spec.num_hidden_layers
    assert model.get_input_embeddings().weight.shape[0] == spec.vocab_size + 8
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight


def assert_cross(spec: ModelSpec) -> tuple[int, ...]:
    assert spec.cross_attention is not None
    return spec.cross_attention.layers


def test_the_11b_cross_attention_layers_summed_by_hand() -> None:
    """Each of the 8 layers: q and o 4096 x 4096, k and v 4096 x 1024, the 14336-wide MLP, two RMSNorms, q/k norms
    of 128 and two gates (modeling_mllama.py MllamaCrossAttentionDecoderLayer); none of it runs for text, so the
    parameters text passes through are Llama 3.1 8B's plus the 8 image-token rows of the embedding."""
    h, kv, i, head = 4096, 1024, 14336, 128
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h + 2 * head + 2
    spec = resolve("meta-llama/Llama-3.2-11B-Vision")
    assert spec.cross_attention_params == 8 * layer
    assert spec.active_params == catalog()["llama-3.1-8b"].num_params + 8 * h


def test_bitsandbytes_packs_the_cross_attention_linears_too() -> None:
    spec = tiny()
    packed = packed_4bit(build_on_meta(spec))
    assert sum(packed.values()) == spec.quantized_linear_params
    assert any(".cross_attn." in name for name in packed)


def test_lora_adapts_the_self_attention_layers_only() -> None:
    spec = tiny(num_hidden_layers=4, cross_attention={"layers": [1, 3]})
    trained = lora_trained(spec, Settings(method="lora", quant="none", attn="eager", lora_r=4, lora_targets="all"))
    assert sum(trained.values()) == spec.lora_params(4, "all") > 0
    assert {name.split(".layers.")[1].split(".")[0] for name in trained} == {"0", "2", "4", "5"}


# --- config.json ------------------------------------------------------------------------------------------------
# Llama-3.2-11B-Vision's config.json as transformers' converter writes it (the keys the catalog entry cites)
LLAMA_3_2_11B_VISION = {
    "architectures": ["MllamaForConditionalGeneration"],
    "model_type": "mllama",
    "image_token_index": 128256,
    "text_config": {
        "model_type": "mllama_text_model",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "cross_attention_layers": [3, 8, 13, 18, 23, 28, 33, 38],
        "tie_word_embeddings": False,
        "rope_scaling": {"factor": 8.0, "rope_type": "llama3", "original_max_position_embeddings": 8192},
    },
    "vision_config": {"model_type": "mllama_vision_model", "image_size": 560, "hidden_size": 1280},
}


def test_a_config_json_reads_as_its_preset(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_2_11B_VISION))
    read, listed = from_config_json(tmp_path), catalog()["llama-3.2-11b-vision"]
    assert read.cross_attention == listed.cross_attention and read.num_hidden_layers == 32
    assert read.num_params == listed.num_params
    assert read.quantized_linear_params == listed.quantized_linear_params
    assert read.lora_params(16, "all") == listed.lora_params(16, "all")


@pytest.mark.parametrize("layers", [[0, 3], [1], [2, 3]], ids=["first-and-last", "middle", "last-two"])
def test_a_config_json_counts_as_transformers_builds_it(layers: list[int], tmp_path: Path) -> None:
    text = LLAMA_3_2_11B_VISION["text_config"] | TINY | {"num_hidden_layers": 4, "cross_attention_layers": layers}
    del text["head_dim"]  # MllamaTextConfig has none
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_2_11B_VISION | {"text_config": text}))
    spec = from_config_json(tmp_path)
    assert spec.num_hidden_layers == 4 - len(layers)
    assert sum(p.numel() for p in build_on_meta(spec).parameters()) == spec.num_params


@pytest.mark.parametrize(
    "layers", [[3, 3], [40], "3,8", [], list(range(40))], ids=["twice", "past-the-end", "text", "none", "all"]
)
def test_cross_attention_layers_lorafit_cannot_place_are_one_line(layers: object, tmp_path: Path) -> None:
    text = LLAMA_3_2_11B_VISION["text_config"] | {"cross_attention_layers": layers}
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_2_11B_VISION | {"text_config": text}))
    with pytest.raises(InvalidConfig) as error:
        from_config_json(tmp_path)
    assert "cross_attention_layers" in str(error.value) and "\n" not in str(error.value)


# --- the estimate -----------------------------------------------------------------------------------------------
def test_estimate_is_within_3_percent_of_the_trace() -> None:
    """Scaled down (256 wide, 8 self-attention and 2 cross-attention layers in the 11B's layout), QLoRA at 256
    tokens, traced with the CPU's kernels; the full-size 11B at 2048 tokens is `make bench-image-text`."""
    from lorafit.trace import trace_depth

    spec = tiny(
        num_hidden_layers=8,
        cross_attention={"layers": [3, 8]},
        hidden_size=256,
        intermediate_size=704,
        head_dim=64,
        vocab_size=2048,
    )
    settings = Settings(method="qlora", quant="nf4", micro_batch=2, seq_len=256, grad_ckpt=True)
    traced = trace_depth(spec, settings, device="cpu").peak_bytes
    analytic = sum(memory.breakdown(spec, settings, memory.Runtime(device="cpu"))[0].values())
    assert analytic == pytest.approx(traced, rel=0.03), f"analytic {analytic / 2**20:.3f}, traced {traced / 2**20:.3f}"


def test_cross_attention_layers_cost_weights_but_no_activations_or_time() -> None:
    """The same model without its cross-attention layers differs only by their stored weights."""
    from lorafit import timing

    spec = resolve("meta-llama/Llama-3.2-11B-Vision")
    bare = spec.model_copy(update={"cross_attention": None})
    settings = Settings(method="qlora", quant="nf4", micro_batch=1, seq_len=2048, grad_ckpt=True)
    with_cross, without = memory.breakdown(spec, settings)[0], memory.breakdown(bare, settings)[0]
    assert with_cross["weights"] > without["weights"]
    assert {k: v for k, v in with_cross.items() if k != "weights"} == {
        k: v for k, v in without.items() if k != "weights"
    }
    # the 8 embedding rows aside, the FLOPs of a step are the text model's
    assert timing.layer_matmul_params(spec) == timing.layer_matmul_params(bare)


# --- training and export ----------------------------------------------------------------------------------------
def hub_folder(model_dir: Path, spec: ModelSpec) -> None:
    """A tiny random Llama 3.2 Vision folder as the hub ships it: MllamaForConditionalGeneration, tower included."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    from lorafit.train.demo import build_tokenizer, corpus

    tokenizer = build_tokenizer(corpus(), vocab_size=512)
    text = spec.to_hf_config()["text_config"] | {"vocab_size": len(tokenizer)}
    text |= {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    torch.manual_seed(0)
    model = MllamaForConditionalGeneration(MllamaConfig(text_config=text, vision_config=TINY_TOWER))
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


def test_train_runs_on_a_tiny_llama_3_2_vision_and_gguf_export_says_why_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hub_folder(tmp_path / "model", tiny())
    # the chunked loss runs the decoder (MllamaTextModel) and the head apart (train/savers.micro_batch_loss)
    flags = ("--method", "qlora", "--micro-batch", "4", "--max-steps", "2", "--loss", "chunked")
    run = run_train(tmp_path, word_rows(16), capsys, *flags)
    names = adapter_names(run)
    assert names and not any(".layers.1." in name for name in names)  # the cross-attention layer has none
    err = refused(["export", str(run), "--to", "gguf", "-o", str(tmp_path / "gguf")], capsys)
    assert "llama.cpp" in err and "Llama 3.2 Vision" in err and "--to merged" in err
    assert not (tmp_path / "gguf").exists()
    randomize_lora_b(run)  # a real update for the merge to show
    # the merged folder is the whole checkpoint again: the self-attention layers updated, the rest as they were
    out, changed = merged_changes(tmp_path, capsys, "--json")
    report = json.loads(out)
    assert report["verify"]["merged"]["max_abs_logit_diff"] <= report["verify"]["merged"]["tolerance"]
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in changed
    assert not any(".layers.1." in name or "vision_model" in name for name in changed)
