"""Gemma 4: the dense 31B, the 26B-A4B (the 31B's layers with an MoE block beside the dense MLP) and the E2B / E4B
(per-layer input embeddings, shared-KV layers, an audio tower) modelled (global layers' own head size and KV heads,
keys as values, their own vision tower; the 26B-A4B's experts, router and norms), counted as transformers builds
them, traced and trained; the gemma4_unified 12B refused in one line.

The shapes are transformers' converter's (convert_gemma4_weights.py _VARIANT_GEMMA_4_31B, _VARIANT_GEMMA_4_26B_A4B,
_VARIANT_GEMMA_4_E2B, _VARIANT_GEMMA_4_E4B, _LARGE_MODEL_VISION_CONFIG, _ON_DEVICE_VISION_CONFIG,
https://github.com/huggingface/transformers/blob/0f3f0632a38798af2adf264adc752130ecc5fa66, read 2026-12), written
here from that file, not from the catalog.
"""

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
from lorafit import timing
from lorafit.models import ModelSpec, from_config_json, resolve
from lorafit.schema import Settings

torch = pytest.importorskip("torch")

CONVERTER_31B_TEXT = dict(
    hidden_size=5376,
    hidden_size_per_layer_input=0,
    intermediate_size=4 * 5376,
    num_hidden_layers=60,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10,
    num_attention_heads=32,
    num_key_value_heads=16,
    num_global_key_value_heads=4,
    attention_k_eq_v=True,
    use_bidirectional_attention="vision",
    num_kv_shared_layers=0,
    sliding_window=1024,
    final_logit_softcapping=30.0,
    max_position_embeddings=262_144,
)
CONVERTER_26B_A4B_TEXT = dict(
    hidden_size=2816,
    hidden_size_per_layer_input=0,
    intermediate_size=2112,
    num_hidden_layers=30,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5,
    num_attention_heads=16,
    num_key_value_heads=8,
    num_global_key_value_heads=2,
    attention_k_eq_v=True,
    use_bidirectional_attention="vision",
    num_kv_shared_layers=0,
    enable_moe_block=True,
    num_experts=128,
    moe_intermediate_size=704,
    top_k_experts=8,
    sliding_window=1024,
    final_logit_softcapping=30.0,
    max_position_embeddings=262_144,
)
CONVERTER_LARGE_VISION = dict(
    hidden_size=1152,
    intermediate_size=4304,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=72,
    global_head_dim=72,
    default_output_length=280,
    pooling_kernel_size=3,
    use_clipped_linears=False,
    standardize=True,
)
CONVERTER_E2B_TEXT = dict(
    hidden_size=1536,
    hidden_size_per_layer_input=256,
    intermediate_size=4 * 1536,
    num_hidden_layers=35,
    layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
    num_attention_heads=8,
    num_key_value_heads=1,
    num_global_key_value_heads=None,
    attention_k_eq_v=False,
    use_bidirectional_attention=None,
    num_kv_shared_layers=20,
    use_double_wide_mlp=True,
    final_logit_softcapping=30.0,
)
CONVERTER_E4B_TEXT = dict(
    hidden_size=2560,
    hidden_size_per_layer_input=256,
    intermediate_size=4 * 2560,
    num_hidden_layers=42,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 7,
    num_attention_heads=8,
    num_key_value_heads=2,
    num_global_key_value_heads=None,
    global_head_dim=512,
    attention_k_eq_v=False,
    use_bidirectional_attention=None,
    num_kv_shared_layers=18,
    final_logit_softcapping=30.0,
)
CONVERTER_ON_DEVICE_VISION = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=16,
    num_attention_heads=12,
    num_key_value_heads=12,
    head_dim=64,
    global_head_dim=64,
    default_output_length=280,
    pooling_kernel_size=3,
    use_clipped_linears=True,
)
# the 31B's layout at toy sizes: five sliding layers then a global one with wider heads, fewer KV heads, no v_proj
TINY_TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    hidden_size_per_layer_input=0,
    vocab_size=512,
    final_logit_softcapping=30.0,
)
# the 26B-A4B's MoE block at toy sizes: 4 experts of 32, 2 per token, beside the dense MLP
TINY_MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=16)
# the E2B's features at toy sizes: per-layer inputs of 8, the last 6 of 12 layers reading earlier layers' keys and
# values, their MLP twice as wide (global layers with their own v_proj, as the E sizes have them)
TINY_E = dict(
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=512,
    num_kv_shared_layers=6,
    use_double_wide_mlp=True,
    attention_k_eq_v=False,
    num_global_key_value_heads=None,
)
LAYOUTS = {"31b-layout": {}, "26b-a4b-layout": TINY_MOE, "e2b-layout": TINY_E}


def gemma4_config(text: dict, vision: dict | None = None, audio: bool = False) -> dict:
    """A config.json as transformers writes one for these shapes (with the default audio tower)."""
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig

    tower = Gemma4VisionConfig(**vision) if vision else None
    sound = Gemma4AudioConfig() if audio else None
    return Gemma4Config(text_config=Gemma4TextConfig(**text), vision_config=tower, audio_config=sound).to_dict()


def write_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def tiny_spec(tmp_path: Path, audio: bool = False, **text: object) -> ModelSpec:
    return from_config_json(write_config(tmp_path / "tiny", gemma4_config(TINY_TEXT | text, TINY_VISION, audio)))


# preset -> the converter's text config, vision config and whether it has the audio tower
CONVERTER = {
    "gemma-4-31b": (CONVERTER_31B_TEXT, CONVERTER_LARGE_VISION, False),
    "gemma-4-26b-a4b": (CONVERTER_26B_A4B_TEXT, CONVERTER_LARGE_VISION, False),
    "gemma-4-e2b": (CONVERTER_E2B_TEXT, CONVERTER_ON_DEVICE_VISION, True),
    "gemma-4-e4b": (CONVERTER_E4B_TEXT, CONVERTER_ON_DEVICE_VISION, True),
}


# --- the 31B and the 26B-A4B: names, counts -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("hub_id", "preset"),
    [
        ("google/gemma-4-31B-it", "gemma-4-31b"),
        ("google/gemma-4-31B", "gemma-4-31b"),
        ("gemma-4-31b", "gemma-4-31b"),
        ("unsloth/gemma-4-31B-it-unsloth-bnb-4bit", "gemma-4-31b"),
        ("google/gemma-4-26B-A4B-it", "gemma-4-26b-a4b"),
        ("google/gemma-4-26B-A4B", "gemma-4-26b-a4b"),
        ("gemma-4-26b-a4b", "gemma-4-26b-a4b"),
        ("google/gemma-4-E2B-it", "gemma-4-e2b"),
        ("google/gemma-4-E2B", "gemma-4-e2b"),
        ("unsloth/gemma-4-E4B-it-unsloth-bnb-4bit", "gemma-4-e4b"),
        ("google/gemma-4-E4B-it", "gemma-4-e4b"),
    ],
)
def test_the_modelled_names_resolve_to_their_shapes(hub_id: str, preset: str) -> None:
    spec = resolve(hub_id)
    expected = resolve(preset)
    assert spec.num_params == expected.num_params and spec.global_layers == expected.global_layers
    assert spec.num_local_experts == (128 if "26b" in preset else 0)
    assert (spec.prequantized is not None) == hub_id.endswith("bnb-4bit")


@pytest.mark.parametrize("preset", sorted(CONVERTER))
def test_the_preset_is_the_model_transformers_builds_from_the_converters_config(preset: str) -> None:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    config = Gemma4Config(**gemma4_config(*CONVERTER[preset]))
    with torch.device("meta"):
        model = Gemma4ForConditionalGeneration(config)
    spec = resolve(preset)
    assert model.num_parameters() == spec.num_params
    text_params = sum(p.numel() for n, p in model.named_parameters() if "language_model" in n)
    assert text_params == spec.num_params - spec.vision_params
    # what a token runs through: all but the experts it is not routed to (the 26B-A4B's "A4B": 3.8B)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    idle = experts * (spec.num_local_experts - spec.num_experts_per_tok) // max(spec.num_local_experts, 1)
    assert spec.active_params == text_params - idle
    if not spec.is_moe:  # the time model's matmuls: the language model's Linears (the per-layer table is looked up)
        linears = (m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "language_model" in n)
        assert timing.layer_matmul_params(spec) == pytest.approx(sum(m.weight.numel() for m in linears), rel=1e-3)
    # what bitsandbytes packs (the E sizes' per-layer table, an nn.Embedding, stays 16-bit)
    assert sum(packed_4bit(model).values()) == spec.quantized_linear_params


@pytest.mark.parametrize("preset", sorted(CONVERTER))
def test_the_converters_config_json_reads_as_the_preset(preset: str, tmp_path: Path) -> None:
    config = gemma4_config(*CONVERTER[preset])
    spec = from_config_json(write_config(tmp_path, config))
    expected = resolve(preset)
    for targets in ("all", "experts" if spec.is_moe else "qv"):
        assert spec.lora_params(16, targets) == expected.lora_params(16, targets)
    assert spec.num_params == expected.num_params and spec.num_local_experts == expected.num_local_experts
    assert spec.global_layers == expected.global_layers and spec.vision == expected.vision
    assert spec.num_experts_per_tok == expected.num_experts_per_tok
    assert spec.moe_intermediate_size == expected.moe_intermediate_size


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_lora_and_4_bit_packing_count_what_peft_and_bitsandbytes_do(layout: str, tmp_path: Path) -> None:
    """peft wraps each kind of layer's projections (a global layer has no v_proj; the 26B-A4B's dense MLP too,
    its experts through target_parameters; the E sizes' shared-KV layers have no k_proj / v_proj, the E2B's MLP
    there is twice as wide, the per-layer input path is not a LoRA target); transformers' quantizer packs the
    language model's and the towers' linears (the 26B-A4B's router too), not the fused experts."""

    moe, e_size = layout == "26b-a4b-layout", layout == "e2b-layout"
    spec = tiny_spec(tmp_path, num_hidden_layers=12, audio=e_size, **LAYOUTS[layout])
    assert spec.is_moe == moe
    model = build_on_meta(spec)
    assert model.num_parameters() == spec.num_params
    for targets in ("all", "qv", "attn") + (("experts",) if moe else ()):
        dropout = 0.0 if targets == "experts" else 0.05
        settings = Settings(
            method="lora", quant="none", attn="eager", lora_r=4, lora_targets=targets, lora_dropout=dropout
        )
        trained = lora_trained(spec, settings)
        assert sum(trained.values()) == spec.lora_params(4, targets) > 0, targets
        assert all(".language_model." in name for name in trained)
        assert any(".mlp.down_proj." in name for name in trained) == (targets == "all")
        assert any(".experts." in name for name in trained) == (targets == "experts")
        assert not any(".layers.11.self_attn.k_proj" in name for name in trained) if e_size else True
    assert sum(packed_4bit(model).values()) == spec.quantized_linear_params


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_trace_extends_whole_periods_of_layers(layout: str, tmp_path: Path) -> None:
    """Traced at one and two periods of six layers and extended to 18, the step holds the 18-layer model's
    parameters and adapters exactly (traced at depths 2 and 3, it would hold one global layer instead of three);
    with shared-KV layers (the E sizes: unshared layers, then shared ones, no whole periods) it is traced at full
    depth. The estimate against the full-size trace is `make bench-image-text` (gemma-4-31b QLoRA and LoRA at
    2048, gemma-4-26b-a4b, gemma-4-e2b and gemma-4-e4b QLoRA at 2048) and `python bench/moe_trace.py --models
    gemma-4-26b-a4b`."""
    from lorafit.trace import trace_depth

    spec = tiny_spec(tmp_path, num_hidden_layers=18, **LAYOUTS[layout])
    settings = Settings(method="qlora", quant="nf4", micro_batch=1, seq_len=64, grad_ckpt=True)
    traced = trace_depth(spec, settings, device="cpu")
    assert [trace.num_layers for trace in traced.traces] == ([18] if layout == "e2b-layout" else [6, 12])
    assert traced.total_params == spec.num_params and traced.trainable_params == spec.lora_params(16, "all")


def test_the_26b_a4b_plan_says_what_is_16_bit_and_what_lora_adapts(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["plan", "--model", "google/gemma-4-26B-A4B-it", "--gpu", "h100"], capsys)
    said = " ".join(out.split())
    assert code == 0, err
    assert "128 experts a layer, 8 per token, held in 16 bit" in said
    assert "LoRA adapts the attention and the dense MLP" in said and "vision tower" in said


def test_the_e2b_plan_says_what_is_16_bit_and_what_is_shared(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["plan", "--model", "google/gemma-4-E2B-it", "--gpu", "h100"], capsys)
    said = " ".join(out.split())
    assert code == 0, err
    # 262144 tokens x 35 layers x 256 (the converter's E2B): 2.35B
    assert "per-layer embedding table (2.35B parameters) is held in 16 bit" in said
    assert "its last 20 layers reuse earlier layers' keys and values" in said and "vision tower" in said


# --- what stays refused -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("hub_id", "words"),
    [
        ("google/gemma-4-12B-it", "Gemma 4 12B, another model class than the 31B's (gemma4_unified)"),
    ],
)
def test_the_sizes_not_modelled_are_one_line_naming_a_gemma3_image_text_preset(
    hub_id: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(["plan", "--model", hub_id, "--gpu", "h100"], capsys)
    assert "Traceback" not in err
    assert words in err and "is not modelled yet" in err
    stand_in = resolve(err.split("the nearest supported preset is ", 1)[1].split(" ", 1)[0])
    assert stand_in.architecture == "gemma3" and stand_in.vision is not None


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"enable_moe_block": True, "num_experts": 4, "moe_intermediate_size": 32}, "enable_moe_block needs"),
        (
            {
                "layer_types": ["sliding_attention", "full_attention", "full_attention"]
                + ["sliding_attention"] * 2
                + ["full_attention"]
            },
            "layer_types is not one full-attention",
        ),
    ],
    ids=["moe-without-top-k", "irregular-layers"],
)
def test_a_gemma4_config_json_lorafit_cannot_count_is_one_line(
    change: dict, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_config(tmp_path, gemma4_config(TINY_TEXT | change))
    err = refused(["estimate", "--model", str(folder)], capsys)
    assert words in err


# --- training -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("layout", "targets"),
    [("31b-layout", "all"), ("26b-a4b-layout", "all"), ("26b-a4b-layout", "experts"), ("e2b-layout", "all")],
    ids=["31b-layout", "26b-a4b-layout", "26b-a4b-experts", "e2b-layout"],
)
def test_train_runs_on_a_tiny_gemma4_and_merges(
    layout: str, targets: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Trained and merged; the E2B's layout (12 layers, the last 4 shared-KV) without its audio tower, whose
    default size (307M) is too big for a unit test: its eager attention is built in the 4-bit packing test."""
    from lorafit.train.demo import build_model, build_tokenizer, corpus

    tokenizer = build_tokenizer(corpus(), vocab_size=512)
    e_size = layout == "e2b-layout"
    text = LAYOUTS[layout] | ({"num_hidden_layers": 12, "vocab_size_per_layer_input": len(tokenizer)} if e_size else {})
    spec = tiny_spec(tmp_path, vocab_size=len(tokenizer), **text)
    build_model(tmp_path / "model", tokenizer, spec, seed=0)
    options = ["--method", "qlora", "--micro-batch", "4", "--max-steps", "2", "--lora-targets", targets]
    options += ["--lora-dropout", "0"] if targets == "experts" else []
    run = run_train(tmp_path, word_rows(16), capsys, *options)
    names = adapter_names(run)
    assert names and all(".language_model." in name for name in names)
    assert any(".layers.5.self_attn.k_proj" in name for name in names)  # the global layer is adapted too
    # a shared-KV layer has no k_proj of its own: its q_proj only
    assert not any(".layers.11.self_attn.k_proj" in name for name in names)
    assert any(".layers.11.self_attn.q_proj" in name for name in names) == e_size
    # the 26B-A4B's dense MLP under "all", its fused experts (peft's target_parameters) under "experts"
    assert any(".mlp.down_proj" in name for name in names) == (targets == "all")
    assert any(".experts." in name for name in names) == (targets == "experts")
    randomize_lora_b(run)  # a real update of every adapted weight, for the merge to show
    changed = {name.split(".layers.0.", 1)[-1] for name in merged_changes(tmp_path, capsys)[1]}
    assert {"self_attn.q_proj.weight", "self_attn.k_proj.weight"} <= changed
    assert ("mlp.down_proj.weight" in changed) == (targets == "all")
    assert (
        {"experts.gate_up_proj", "experts.down_proj"} <= changed
        if targets == "experts"
        else not any("experts" in name for name in changed)
    )
    # --to gguf (llama.cpp's gemma4): tests/test_export_gguf_gemma4.py


@pytest.mark.parametrize(
    ("model", "part"),
    [("google/gemma-4-31B-it", {"type": "image", "url": "heron.png"}), ("google/gemma-4-E2B-it", {"type": "audio"})],
    ids=["31b-image", "e2b-audio"],
)
def test_image_and_audio_rows_are_refused_in_one_line(
    model: str, part: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    turns = [
        {"role": "user", "content": [part | {"url": "heron.wav"}, {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": "A heron."},
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"messages": turns}) + "\n" for _ in range(3)))
    err = refused(["plan", "--model", model, "--gpu", "h100", "--data", str(data)], capsys)
    assert "image-text models on text only" in err and repr(part["type"]) in err
