"""The model catalog against published parameter counts and against the real transformers / peft modules.

Published counts are the ground truth for the full-size presets; the meta device lets us build the real
architectures at full size without memory, and tiny random copies check LoRA and quantisation counts.
transformers, peft and bitsandbytes are imported inside the tests, after the offline fixture has run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import build_on_meta, lora_trained, refused, run_cli
from lorafit import mla
from lorafit.errors import InvalidConfig, LorafitError, UnknownModel
from lorafit.families import MODEL_TYPES
from lorafit.models import (
    catalog,
    from_config_json,
    hub_index,
    resolve,
    unmodelled_families,
    variants,
)
from lorafit.schema import Settings

PRESETS = sorted(catalog())
# text models only: an image-text preset shares its language model's family (tests/test_vision.py covers it)
ONE_PER_ARCHITECTURE = sorted({spec.architecture: name for name, spec in catalog().items() if not spec.vision}.values())
TINY = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
)
# head_dim x heads != hidden_size, as in Gemma and Qwen3: catches a q/o projection sized by hidden_size
TINY_WIDE_HEADS = TINY | {"head_dim": 32}


def whole_groups(name: str) -> dict[str, int]:
    """A hybrid (Qwen3.5) has one full-attention layer in every 4: a tiny copy keeps one group of 4 layers."""
    block = catalog()[name].linear_attention
    return {"num_hidden_layers": block.full_attention_interval} if block else {}


def parameter_count(model) -> int:
    """Every parameter once: `parameters()` yields a tied embedding / LM head a single time."""
    return sum(parameter.numel() for parameter in model.parameters())


# --- the catalog ------------------------------------------------------------------------------------------
def test_catalog_has_the_models_people_fine_tune() -> None:
    wanted = {
        "llama-2-7b",
        "llama-2-13b",
        "llama-2-70b",
        "llama-3.1-8b",
        "llama-3.1-70b",
        "llama-3.2-1b",
        "llama-3.2-3b",
        "mistral-7b-v0.1",
        "mistral-7b-v0.3",
        "qwen2.5-0.5b",
        "qwen2.5-1.5b",
        "qwen2.5-3b",
        "qwen2.5-7b",
        "qwen2.5-14b",
        "qwen2.5-32b",
        "qwen2.5-72b",
        "gemma-2-2b",
        "gemma-2-9b",
        "gemma-2-27b",
        "gemma-7b",
        "phi-3-mini",
        "tinyllama-1.1b",
        "mixtral-8x7b",
        "qwen3-8b",
        # the families and sizes people fine-tune today on one or a few GPUs
        "llama-3-8b",
        "llama-3-70b",
        "llama-3.1-405b",
        "qwen3-0.6b",
        "qwen3-1.7b",
        "qwen3-4b",
        "qwen3-14b",
        "qwen3-32b",
        "gemma-2b",
        "mistral-nemo-12b",
        "mistral-small-22b",
        "mistral-small-24b",
        "phi-3-medium",
        "phi-4",
        "phi-4-mini",
        "smollm2-135m",
        "smollm2-360m",
        "smollm2-1.7b",
        "r1-distill-qwen-1.5b",
        "gemma-3-1b",
        # issue 27's second pass: the small sizes people fine-tune on one consumer card
        "gemma-3-270m",
        "qwen3.5-4b",
        "qwen3.5-9b",
    }
    assert wanted <= set(catalog())
    assert all(name == name.lower() for name in catalog())


@pytest.mark.parametrize("name", PRESETS)
def test_parameter_count_equals_the_published_count(name: str) -> None:
    spec = catalog()[name]
    assert spec.published_params is not None, f"{name} has no published_params"
    assert spec.num_params == spec.published_params


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_says_where_its_numbers_come_from(name: str) -> None:
    """The shapes name the file they were read from (the hub's config.json or a public copy of it) and when."""
    spec = catalog()[name]
    assert spec.hf_id and spec.source
    shapes, _, params = spec.source.partition("params:")
    assert shapes.startswith("config:") and "https://" in shapes and "read 20" in shapes
    assert params.strip(), f"{name}: the source does not say where its parameter count comes from"


def test_well_known_counts_written_out_by_hand() -> None:
    """Figures from the model cards / announcements, independent of the catalog file."""
    assert resolve("llama-2-7b").num_params == 6_738_415_616
    assert resolve("llama-3.1-8b").num_params == 8_030_261_248
    assert resolve("mistral-7b-v0.1").num_params == 7_241_732_096
    assert resolve("qwen2.5-7b").num_params == 7_615_616_512
    # Mistral: "Mixtral has 46.7B total parameters but only uses 12.9B parameters per token"
    mixtral = resolve("mixtral-8x7b")
    assert round(mixtral.num_params / 1e8) == 467
    assert round(mixtral.active_params / 1e8) == 129


def test_qwen2_5_0_5b_summed_by_hand() -> None:
    """The module shapes of Qwen2.5-0.5B (tied embedding, q/k/v biases), summed without ModelSpec."""
    hidden, inter, layers, heads, kv_heads, vocab = 896, 4864, 24, 14, 2, 151936
    head = hidden // heads
    attention = hidden * hidden + hidden + 2 * (hidden * kv_heads * head + kv_heads * head) + hidden * hidden
    mlp = 3 * hidden * inter
    norms = 2 * hidden
    total = vocab * hidden + layers * (attention + mlp + norms) + hidden
    assert total == 494_032_768 == resolve("qwen2.5-0.5b").num_params


# --- against the real modules -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", PRESETS)
def test_full_size_model_on_meta_device_has_the_same_count(name: str) -> None:
    spec = catalog()[name]
    model = build_on_meta(spec)
    assert parameter_count(model) == spec.num_params
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == spec.tie_word_embeddings


@pytest.mark.parametrize("shape", [TINY, TINY_WIDE_HEADS], ids=["tiny", "wide-heads"])
@pytest.mark.parametrize("name", ONE_PER_ARCHITECTURE)
def test_scaled_copy_matches_the_real_modules(name: str, shape: dict) -> None:
    """Names and shapes of one block's linears as transformers builds them, and the total count."""
    import torch

    spec = catalog()[name].scaled(**shape | whole_groups(name))
    if spec.latent:  # DeepSeek-V3 has 3 dense blocks first: one, as V2-Lite, so that the last block is an MoE one
        spec = spec.scaled(latent=spec.latent.model_dump() | {"first_k_dense_replace": 1})
    model = build_on_meta(spec)
    assert parameter_count(model) == spec.num_params
    # the last block (DeepSeek's first ones are dense, its per-block counts MoE); every block of a hybrid
    # (Qwen3.5), whose layers differ: each linear where it is
    parameters, modules = {}, {}
    for block in model.model.layers if spec.linear_attention else [model.model.layers[-1]]:
        parameters |= dict(block.named_parameters())
        modules |= dict(block.named_modules())
    for linear, in_features, out_features, copies in spec.layer_linears():
        named = [p for p in parameters if p.endswith(f".{linear}.weight") or p.endswith(f".{linear}")]
        # DeepSeek's shared_experts, the hybrid MoE's shared_expert: apart from the routed experts' fused ones
        (path,) = [p for p in named if ("shared_expert" in p) == ("shared_expert" in linear)]
        assert parameters[path].numel() == in_features * out_features * copies, path
        module = modules.get(path.removesuffix(".weight"))
        if isinstance(module, torch.nn.Linear):
            assert (module.in_features, module.out_features) == (in_features, out_features), path
    # every layer's weights against the per-layer counts (a hybrid's: their mean, each rounded down; DeepSeek's dense
    # first blocks differ by mla.dense_deltas, which the total above checks)
    layers, per_layer = model.model.layers, spec.layer_linear_params + spec.layer_other_params
    slack = 2 * len(layers) if spec.linear_attention else 1
    dense = sum(mla.dense_deltas(spec))
    assert 0 <= sum(p.numel() for p in layers.parameters()) - dense - len(layers) * per_layer < slack


@pytest.mark.parametrize("targets", ["all", "attn", "qv"])
@pytest.mark.parametrize("name", ONE_PER_ARCHITECTURE)
def test_lora_params_equal_the_trainable_count_of_a_peft_model(name: str, targets: str) -> None:
    spec = catalog()[name].scaled(**TINY_WIDE_HEADS | whole_groups(name))
    settings = Settings(method="lora", quant="none", attn="eager", lora_r=4, lora_targets=targets)
    trainable = sum(lora_trained(spec, settings).values())
    assert trainable == spec.lora_params(4, targets)
    assert trainable > 0


@pytest.mark.parametrize("name", ONE_PER_ARCHITECTURE)
def test_quantized_params_are_what_bitsandbytes_replaces(name: str) -> None:
    """QLoRA stores only nn.Linear weights in 4 bit: Mixtral's fused experts stay in 16 bit."""
    import bitsandbytes as bnb
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    spec = catalog()[name].scaled(**TINY | whole_groups(name))
    model = replace_with_bnb_linear(
        build_on_meta(spec),
        modules_to_not_convert=["lm_head"],
        quantization_config=BitsAndBytesConfig(load_in_4bit=True),
    )
    quantized = sum(
        module.in_features * module.out_features
        for module in model.model.layers.modules()
        if isinstance(module, bnb.nn.Linear4bit)
    )
    if spec.linear_attention:  # a hybrid's (Qwen3.5's) per-layer count is the mean, rounded down
        layers = spec.num_hidden_layers
        assert 0 <= quantized - layers * spec.layer_linear_params < layers
    else:
        assert quantized == spec.quantized_linear_params  # every block: DeepSeek's first ones are dense
    if spec.is_moe and not spec.linear_attention:  # a hybrid's rows list both kinds of layer's linears
        assert spec.layer_linear_params + spec.expert_params == sum(i * o * n for _, i, o, n in spec.layer_linears())


@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_written_as_config_json_reads_back_the_same(name: str, tmp_path: Path) -> None:
    spec = catalog()[name]
    (tmp_path / "config.json").write_text(json.dumps(spec.to_hf_config()))
    read = from_config_json(tmp_path)
    assert read.num_params == spec.num_params
    assert read.lora_params(16, "all") == spec.lora_params(16, "all")


# --- resolve() --------------------------------------------------------------------------------------------
def test_resolve_a_preset_name_in_any_case() -> None:
    assert resolve("llama-2-7b") is catalog()["llama-2-7b"]
    assert resolve("Qwen2.5-7B") is catalog()["qwen2.5-7b"]


def test_resolve_a_hub_id_or_a_mirror_of_it() -> None:
    assert resolve("meta-llama/Llama-2-7b-hf").name == "llama-2-7b"
    assert resolve("mistralai/mixtral-8x7b-v0.1").name == "mixtral-8x7b"
    assert resolve("unsloth/Qwen2.5-7B").name == "qwen2.5-7b"  # same repository name, other owner


QWEN2_5_0_5B_CONFIG = {  # Qwen/Qwen2.5-0.5B config.json as published (no key for the q/k/v biases)
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_resolve_a_local_model_directory(tmp_path: Path) -> None:
    model_dir = tmp_path / "my-finetune"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(QWEN2_5_0_5B_CONFIG))
    spec = resolve(str(model_dir))
    assert spec.name == "my-finetune"
    assert spec.architecture == "qwen2" and spec.attention_bias and spec.tie_word_embeddings
    assert spec.num_params == 494_032_768
    assert resolve(str(model_dir / "config.json")).num_params == 494_032_768


def test_a_gemma_config_without_a_tie_key_is_tied(tmp_path: Path) -> None:
    gemma_2_2b = {
        "model_type": "gemma2",
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
    }
    (tmp_path / "config.json").write_text(json.dumps(gemma_2_2b))
    assert from_config_json(tmp_path).num_params == 2_614_341_888


def test_a_multimodal_wrapper_is_read_through_its_text_config(tmp_path: Path) -> None:
    wrapper = {"model_type": "llava", "text_config": catalog()["llama-2-7b"].to_hf_config()}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    assert from_config_json(tmp_path).num_params == 6_738_415_616


def test_an_unknown_model_names_the_close_presets() -> None:
    with pytest.raises(UnknownModel) as error:
        resolve("lama-2-7b")
    message = str(error.value)
    assert "llama-2-7b" in message and "config.json" in message
    assert "\n" not in message
    assert isinstance(error.value, LorafitError) and error.value.exit_code == 2


@pytest.mark.parametrize(
    ("content", "complaint"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2, 3]", "JSON object"),
        (json.dumps({"model_type": "made_up_lm", "n_embd": 768}), "'made_up_lm' is not supported; supported: "),
        (json.dumps(QWEN2_5_0_5B_CONFIG | {"model_type": None}), "None is not supported"),
        (json.dumps({k: v for k, v in QWEN2_5_0_5B_CONFIG.items() if k != "hidden_size"}), "hidden_size"),
        (json.dumps(QWEN2_5_0_5B_CONFIG | {"num_hidden_layers": 0}), "num_hidden_layers"),
        (json.dumps(QWEN2_5_0_5B_CONFIG | {"vocab_size": "many"}), "vocab_size"),
    ],
    ids=[
        "bad-json",
        "not-an-object",
        "unknown-architecture",
        "no-model-type",
        "missing-field",
        "zero-layers",
        "not-a-number",
    ],
)
def test_a_malformed_config_is_one_clear_error(tmp_path: Path, content: str, complaint: str) -> None:
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(InvalidConfig, match=complaint) as error:
        resolve(str(tmp_path))
    assert "\n" not in str(error.value)


def test_a_directory_without_config_json_is_an_invalid_config(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfig, match="no config.json"):
        resolve(str(tmp_path))


def test_a_binary_config_is_an_invalid_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(InvalidConfig):
        resolve(str(tmp_path))


DIMENSIONS = [
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "num_local_experts",
    "num_experts_per_tok",
]


@pytest.mark.parametrize("value", [10**9, 10**18, 10**30])
@pytest.mark.parametrize("key", DIMENSIONS)
def test_a_dimension_no_real_model_has_is_refused_naming_key_value_and_limit(
    key: str, value: int, tmp_path: Path
) -> None:
    """A billion layers took the planner minutes and gigabytes; every dimension is bounded before planning."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_5_0_5B_CONFIG | {key: value}))
    with pytest.raises(InvalidConfig) as error:
        from_config_json(tmp_path)
    message = str(error.value)
    shown = str(value) if value < 10**20 else "1000... (31 digits)"
    assert f"{key} {shown} is past what any real model has (at most " in message and "\n" not in message


@pytest.mark.parametrize("value", ["896", 896.0, True, [896]])
def test_a_dimension_that_is_not_a_whole_number_is_refused(value: object, tmp_path: Path) -> None:
    """Read as 896 by the planner, "896" crashed transformers at train time: both now refuse it."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_5_0_5B_CONFIG | {"hidden_size": value}))
    with pytest.raises(InvalidConfig, match=r"hidden_size .* must be a whole number"):
        from_config_json(tmp_path)


def test_a_switch_that_is_not_true_or_false_is_refused(tmp_path: Path) -> None:
    """transformers reads the text "false" as true: the planner must not read it as false."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_5_0_5B_CONFIG | {"tie_word_embeddings": "false"}))
    with pytest.raises(InvalidConfig, match="tie_word_embeddings .* must be true or false"):
        from_config_json(tmp_path)


UNREADABLE_CONFIGS = {
    "a billion layers": (json.dumps(QWEN2_5_0_5B_CONFIG | {"num_hidden_layers": 10**9}), "num_hidden_layers"),
    "hidden_size as text": (json.dumps(QWEN2_5_0_5B_CONFIG | {"hidden_size": "128"}), "hidden_size"),
    "100,000-deep JSON": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "a 5,000-digit integer": ('{"model_type": "qwen2", "hidden_size": ' + "7" * 5000 + "}", "digits"),
}


@pytest.mark.parametrize("case", list(UNREADABLE_CONFIGS))
def test_the_cli_refuses_an_unreadable_config_in_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    content, expected = UNREADABLE_CONFIGS[case]
    (tmp_path / "config.json").write_text(content)
    code, out, err = run_cli(["plan", "--model", str(tmp_path), "--gpu", "rtx-4090"], capsys)
    assert code == 2 and not out and err.startswith("lorafit: error: ") and err.count("\n") == 1, err
    assert expected in err


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux's /proc")
def test_a_config_that_cannot_be_read_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(["plan", "--model", "/proc/self/mem"], capsys)
    assert "cannot read /proc/self/mem" in err, err


def test_the_largest_real_shapes_are_planned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Llama 3.1 405B's shapes with Gemma 3's vocabulary and a 10M-token context stay inside the bounds."""
    largest = QWEN2_5_0_5B_CONFIG | {
        "model_type": "llama",
        "num_hidden_layers": 126,
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_attention_heads": 128,
        "num_key_value_heads": 8,
        "vocab_size": 262208,
        "max_position_embeddings": 10_485_760,
    }
    (tmp_path / "config.json").write_text(json.dumps(largest))
    code, _, err = run_cli(["plan", "--model", str(tmp_path), "--gpu", "h100-sxm", "--json"], capsys)
    assert code == 0, err


# --- families the estimator does not model ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("hub_id", "family", "nearest"),
    [
        ("meta-llama/Llama-4-Scout-17B-16E-Instruct", "Llama 4", "llama-3.1-70b"),
        ("tiiuae/falcon-7b", "Falcon", "mistral-7b-v0.1"),
        ("openai-community/gpt2", "GPT-2 (gpt2)", "smollm2-135m"),
        ("ibm-granite/granite-3.1-8b-instruct", "IBM Granite", "llama-3.1-8b"),
        ("allenai/OLMo-2-1124-7B", "OLMo", "llama-3.1-8b"),
    ],
)
def test_an_unmodelled_hub_id_names_its_family_and_a_stand_in(hub_id: str, family: str, nearest: str) -> None:
    with pytest.raises(UnknownModel) as error:
        resolve(hub_id)
    message = str(error.value)
    assert family in message and "not modelled yet" in message
    assert f"nearest supported preset is {nearest} " in message
    assert "not in the catalog" not in message and "\n" not in message
    resolve(nearest)  # the stand-in it names is one lorafit has


def test_the_unmodelled_table_is_consistent_with_the_catalog() -> None:
    """No preset or variant is shadowed by a pattern, no table row names a supported model_type, and every
    stand-in is a preset."""
    for family in unmodelled_families():
        assert not set(family.model_types) & set(MODEL_TYPES), family.family
        assert set(family.nearest) <= set(catalog()), family.family
        assert not [hub_id for hub_id in hub_index() if family.matches_hub_id(hub_id)], family.family


GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768}


@pytest.mark.parametrize(
    ("config", "family"),
    [
        ({"model_type": "llava", "text_config": {"model_type": "phimoe", "hidden_size": 8}}, "(phimoe)"),
        ({"model_type": "phimoe", "hidden_size": 4096, "num_local_experts": 16}, "Phi-3.5-MoE (phimoe)"),
        (GPT2, "GPT-2 (gpt2)"),
    ],
    ids=["wrapped-phimoe", "phimoe", "gpt2"],
)
def test_a_local_config_of_an_unmodelled_family_names_it(tmp_path: Path, config: dict, family: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidConfig) as error:
        resolve(str(tmp_path))
    message = str(error.value)
    assert family in message and "not modelled yet; the nearest supported preset is " in message
    assert "\n" not in message


def test_the_cli_refuses_an_unmodelled_family_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["estimate", "--model", "openai-community/gpt2"], capsys)
    assert code == 2 and not out
    assert err.startswith("lorafit: error: openai-community/gpt2: GPT-2 (gpt2)")
    assert "the nearest supported preset is smollm2-135m " in err
    assert err.count("\n") == 1 and "Traceback" not in err
    (tmp_path / "config.json").write_text(json.dumps(GPT2))
    code, out, err = run_cli(["plan", "--model", str(tmp_path)], capsys)
    assert code == 2 and "GPT-2 (gpt2)" in err and err.count("\n") == 1


def test_the_cli_estimates_a_variant_by_its_hub_id(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["estimate", "--model", "Qwen/Qwen2.5-7B-Instruct", "--json"], capsys)
    assert code == 0
    estimate = json.loads(out)
    code, out, _ = run_cli(["estimate", "--model", "qwen2.5-7b", "--json"], capsys)
    assert code == 0 and json.loads(out)["peak_allocated_gib"] == estimate["peak_allocated_gib"]


def test_the_model_list_counts_each_presets_variants(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`lorafit models` keeps one row per preset; a preset's instruct/chat checkpoints show as a count."""
    import re

    from rich.console import Console

    from lorafit import render

    monkeypatch.setattr(render, "console", Console(width=200, highlight=False))  # one line per row
    render.show_models(list(catalog().values()))
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.startswith("│")}
    assert set(rows) == set(catalog())
    assert re.search(r"│\s+9 │", rows["qwen2.5-7b"]) and len(variants("qwen2.5-7b")) == 9
    assert re.search(r"│\s+│ 32\.76B", rows["qwen3-32b"])  # no variants: the cell is empty
    assert "│ 135M" in rows["smollm2-135m"]


def test_gemma3_text_counts_its_qk_norms_and_four_layer_norms() -> None:
    """gemma-3-1b by hand: per layer q 1152x1024, k and v 1152x256, o 1024x1152, GeGLU 3 x 1152x6912, four
    1152-wide norms and q/k norms of 256; a tied 262144 x 1152 embedding; the final norm. keras-hub publishes
    999,885,952 for gemma3_1b."""
    h, inter, layers, vocab, q, kv, head = 1152, 6912, 26, 262144, 4 * 256, 256, 256
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 4 * h + 2 * head
    assert layers * per_layer + vocab * h + h == 999_885_952 == resolve("gemma-3-1b").num_params
    spec = resolve("gemma-3-1b")
    assert "sdpa" in spec.attention_implementations and not spec.logit_softcapping
    assert spec.to_hf_config()["model_type"] == "gemma3_text"
