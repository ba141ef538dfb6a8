"""The model catalog against published parameter counts and against the real transformers / peft modules.

Published counts are the ground truth for the full-size presets; the meta device lets us build the real
architectures at full size without memory, and tiny random copies check LoRA and quantisation counts.
transformers, peft and bitsandbytes are imported inside the tests, after the offline fixture has run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorafit.errors import InvalidConfig, LorafitError, UnknownModel
from lorafit.models import ModelSpec, catalog, from_config_json, resolve
from lorafit.schema import Settings

PRESETS = sorted(catalog())
ONE_PER_ARCHITECTURE = sorted({spec.architecture: name for name, spec in catalog().items()}.values())
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


def build_on_meta(spec: ModelSpec):
    """The real transformers model for `spec`, with no memory behind its tensors."""
    import torch
    from transformers import AutoModelForCausalLM

    from lorafit.train.build import hf_config

    # Parameter shapes do not depend on the attention kernel; eager is the one every architecture has
    # (transformers 5 has no SDPA path for Gemma-2).
    settings = Settings(method="lora", quant="none", attn="eager")
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(spec, settings))


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
    spec = catalog()[name]
    assert spec.hf_id and spec.source
    assert f"https://huggingface.co/{spec.hf_id}/blob/main/config.json" in spec.source
    assert "read 20" in spec.source and "params:" in spec.source


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

    spec = catalog()[name].scaled(**shape)
    model = build_on_meta(spec)
    assert parameter_count(model) == spec.num_params
    block = model.model.layers[0]
    parameters = dict(block.named_parameters())
    modules = dict(block.named_modules())
    for linear, in_features, out_features, copies in spec.layer_linears():
        (path,) = [p for p in parameters if p.endswith(f".{linear}.weight") or p.endswith(f".{linear}")]
        assert parameters[path].numel() == in_features * out_features * copies, path
        module = modules.get(path.removesuffix(".weight"))
        if isinstance(module, torch.nn.Linear):
            assert (module.in_features, module.out_features) == (in_features, out_features), path
    assert sum(p.numel() for p in parameters.values()) == spec.layer_linear_params + spec.layer_other_params


@pytest.mark.parametrize("targets", ["all", "attn", "qv"])
@pytest.mark.parametrize("name", ONE_PER_ARCHITECTURE)
def test_lora_params_equal_the_trainable_count_of_a_peft_model(name: str, targets: str) -> None:
    from peft import get_peft_model

    from lorafit.train.build import lora_config

    spec = catalog()[name].scaled(**TINY_WIDE_HEADS)
    settings = Settings(method="lora", quant="none", attn="eager", lora_r=4, lora_targets=targets)
    model = get_peft_model(build_on_meta(spec), lora_config(spec, settings))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == spec.lora_params(4, targets)
    assert trainable > 0


@pytest.mark.parametrize("name", ONE_PER_ARCHITECTURE)
def test_quantized_params_are_what_bitsandbytes_replaces(name: str) -> None:
    """QLoRA stores only nn.Linear weights in 4 bit: Mixtral's fused experts stay in 16 bit."""
    import bitsandbytes as bnb
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    spec = catalog()[name].scaled(**TINY)
    model = replace_with_bnb_linear(
        build_on_meta(spec),
        modules_to_not_convert=["lm_head"],
        quantization_config=BitsAndBytesConfig(load_in_4bit=True),
    )
    quantized = sum(
        module.in_features * module.out_features
        for module in model.model.layers[0].modules()
        if isinstance(module, bnb.nn.Linear4bit)
    )
    assert quantized == spec.layer_linear_params
    if spec.is_moe:
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
        (json.dumps({"model_type": "gpt2", "n_embd": 768}), "'gpt2' is not supported"),
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
