"""The names people type for a model: hub ids of presets, their variants and mirrors, pre-quantised copies, the
2026 families and fine-tunes, each resolved to the catalog's shapes (or refused in one line).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import refused, run_cli
from lorafit.errors import InvalidConfig, UnknownModel
from lorafit.models import ModelSpec, Variant, catalog, from_config_json, hub_index, repo_name, resolve, variants


# --- hub ids people type: presets, variants, mirrors --------------------------------------------------------
def preset_of(spec: ModelSpec) -> str:
    """The catalog entry a resolved spec stands for (a variant names the preset whose shapes it shares)."""
    return spec.variant_of or spec.name


@pytest.mark.parametrize(
    ("typed", "preset"),
    [
        # the ids users reported as "not in the catalog"
        ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
        ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
        ("mistralai/Mistral-7B-Instruct-v0.3", "mistral-7b-v0.3"),
        ("Meta-Llama-3-8B", "llama-3-8b"),
        ("Qwen/Qwen3-4B", "qwen3-4b"),
        # with or without the owner, in any case
        ("meta-llama/Meta-Llama-3-8B-Instruct", "llama-3-8b"),
        ("Llama-3.1-8B-Instruct", "llama-3.1-8b"),
        ("Qwen2.5-7B-Instruct", "qwen2.5-7b"),
        ("QWEN/QWEN2.5-7B-INSTRUCT", "qwen2.5-7b"),
        ("unsloth/Llama-3.2-3B-Instruct", "llama-3.2-3b"),
        # a sample of every family's variants
        ("meta-llama/Llama-2-7b-chat-hf", "llama-2-7b"),
        ("meta-llama/Meta-Llama-3.1-8B-Instruct", "llama-3.1-8b"),
        ("meta-llama/Llama-3.3-70B-Instruct", "llama-3.1-70b"),
        ("meta-llama/Llama-3.1-405B-Instruct", "llama-3.1-405b"),
        ("meta-llama/Llama-3.2-1B-Instruct", "llama-3.2-1b"),
        ("TinyLlama/TinyLlama-1.1B-Chat-v1.0", "tinyllama-1.1b"),
        ("HuggingFaceTB/SmolLM2-1.7B-Instruct", "smollm2-1.7b"),
        ("mistralai/Mistral-7B-Instruct-v0.2", "mistral-7b-v0.1"),
        ("mistralai/Mistral-Nemo-Instruct-2407", "mistral-nemo-12b"),
        ("mistralai/Mistral-Small-24B-Instruct-2501", "mistral-small-24b"),
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b"),
        ("Qwen/Qwen2.5-Coder-7B-Instruct", "qwen2.5-7b"),
        ("Qwen/Qwen2.5-Coder-32B-Instruct", "qwen2.5-32b"),
        ("Qwen/Qwen2.5-0.5B-Instruct", "qwen2.5-0.5b"),
        ("Qwen/QwQ-32B", "qwen2.5-32b"),
        ("Qwen/Qwen3-8B-Base", "qwen3-8b"),
        ("Qwen/Qwen3-4B-Instruct-2507", "qwen3-4b"),
        ("google/gemma-2-9b-it", "gemma-2-9b"),
        ("google/gemma-2b-it", "gemma-2b"),
        ("microsoft/Phi-3.5-mini-instruct", "phi-3-mini"),
        ("microsoft/Phi-3-medium-128k-instruct", "phi-3-medium"),
        ("microsoft/Phi-4-reasoning-plus", "phi-4"),
        ("microsoft/Phi-4-mini-instruct", "phi-4-mini"),
        ("google/gemma-3-1b-it", "gemma-3-1b"),
        ("google/gemma-3-1b-pt", "gemma-3-1b"),
        # the DeepSeek-R1 distills, as variants or entries of the architectures they use
        ("deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "llama-3.1-8b"),
        ("deepseek-ai/DeepSeek-R1-Distill-Llama-70B", "llama-3.1-70b"),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "r1-distill-qwen-1.5b"),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "qwen2.5-7b"),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-14B", "qwen2.5-14b"),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", "qwen2.5-32b"),
    ],
)
def test_a_hub_id_resolves_to_the_preset_with_its_shapes(typed: str, preset: str) -> None:
    spec = resolve(typed)
    assert preset_of(spec) == preset
    assert spec.num_params == catalog()[preset].num_params
    assert spec.hf_id is not None and repo_name(spec.hf_id) == repo_name(typed)


def test_a_variant_keeps_its_own_name_and_context_length() -> None:
    """Qwen2.5-7B states 131072 positions, its -Instruct 32768: the variant refuses what the base allows."""
    instruct, base = resolve("Qwen/Qwen2.5-7B-Instruct"), resolve("Qwen/Qwen2.5-7B")
    assert (instruct.name, instruct.hf_id) == ("qwen2.5-7b-instruct", "Qwen/Qwen2.5-7B-Instruct")
    base.check_seq_len(65536)
    with pytest.raises(InvalidConfig, match="qwen2.5-7b-instruct's maximum of 32768"):
        instruct.check_seq_len(65536)
    assert resolve("meta-llama/Meta-Llama-3-8B-Instruct").max_position_embeddings == 8192
    assert resolve("meta-llama/Llama-3.1-8B-Instruct").max_position_embeddings == 131072


def test_every_hub_id_names_one_checkpoint() -> None:
    """A repository name reached under another owner (a mirror) must not be ambiguous, and no checkpoint
    is both a preset and a variant."""
    index = hub_index()
    names = [repo_name(hub_id) for hub_id in index]
    assert len(names) == len(set(names))
    own = {spec.hf_id.lower() for spec in catalog().values()}
    listed = [hub_id.lower() for name in catalog() for hub_id in variants(name)]
    assert len(listed) == len(set(listed)) and not own & set(listed)


def test_a_variant_differing_in_shapes_cannot_be_listed() -> None:
    """Only the context length may differ: a different vocabulary needs an entry of its own."""
    with pytest.raises(ValueError, match="vocab_size"):
        Variant.model_validate({"hf_id": "mistralai/Mistral-7B-Instruct-v0.3", "vocab_size": 32768})


PUBLISHED_CONFIGS = {  # config.json values of variant checkpoints, as published (see each preset's source)
    "Qwen/Qwen2.5-7B-Instruct": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "max_position_embeddings": 32768,
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
        "vocab_size": 152064,
    },
    "meta-llama/Meta-Llama-3-8B-Instruct": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 8192,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
        "vocab_size": 128256,
    },
    "Qwen/Qwen3-8B-Base": {
        "model_type": "qwen3",
        "head_dim": 128,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "max_position_embeddings": 32768,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
        "vocab_size": 151936,
    },
    "google/gemma-3-1b-it": {  # no tie_word_embeddings key: Gemma3TextConfig ties by default
        "model_type": "gemma3_text",
        "head_dim": 256,
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "max_position_embeddings": 32768,
        "num_attention_heads": 4,
        "num_hidden_layers": 26,
        "num_key_value_heads": 1,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "sliding_window": 512,
        "vocab_size": 262144,
    },
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": {  # the copy in ztxz16/fastllm (the qwen3-coder-30b-a3b preset's source)
        "model_type": "qwen3_moe",
        "decoder_sparse_step": 1,
        "head_dim": 128,
        "hidden_size": 2048,
        "intermediate_size": 5472,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
        "vocab_size": 151936,
    },
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "max_position_embeddings": 131072,
        "num_attention_heads": 12,
        "num_hidden_layers": 28,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "vocab_size": 151936,
    },
}


@pytest.mark.parametrize("hub_id", sorted(PUBLISHED_CONFIGS))
def test_a_published_config_reads_as_its_catalog_entry(hub_id: str, tmp_path: Path) -> None:
    """The same numbers whether the user names the hub id or points at the downloaded directory."""
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED_CONFIGS[hub_id]))
    local, listed = from_config_json(tmp_path), resolve(hub_id)
    assert local.num_params == listed.num_params
    assert local.lora_params(16, "all") == listed.lora_params(16, "all")
    assert local.max_position_embeddings == listed.max_position_embeddings
    assert local.tie_word_embeddings == listed.tie_word_embeddings


def test_close_names_are_suggested() -> None:
    with pytest.raises(UnknownModel, match=r"did you mean llama-3\.3-70b-instruct"):
        resolve("llama-3.3-70b")
    with pytest.raises(UnknownModel, match="did you mean .*mistral-7b-v0.3"):
        resolve("mistral-7b")


# --- names people type: Qwen2, Yi, CodeGemma, the 2026 families, fine-tunes ----------------------------------------
@pytest.mark.parametrize(
    ("typed", "preset", "positions"),
    [
        ("Qwen/Qwen2-0.5B", "qwen2.5-0.5b", 131072),
        ("Qwen/Qwen2-0.5B-Instruct", "qwen2.5-0.5b", 32768),
        ("Qwen/Qwen2-1.5B", "qwen2.5-1.5b", 131072),
        ("Qwen/Qwen2-1.5B-Instruct", "qwen2.5-1.5b", 32768),
        ("Qwen/Qwen2-7B", "qwen2.5-7b", 131072),
        ("Qwen/Qwen2-7B-Instruct", "qwen2.5-7b", 32768),
        ("Qwen/Qwen2-72B", "qwen2.5-72b", 131072),
        ("Qwen/Qwen2-72B-Instruct", "qwen2.5-72b", 32768),
        ("01-ai/Yi-6B", "yi-6b", 4096),
        ("01-ai/Yi-6B-Chat", "yi-6b", 4096),
        ("01-ai/Yi-1.5-6B-Chat", "yi-6b", 4096),
        ("01-ai/Yi-9B", "yi-9b", 4096),
        ("01-ai/Yi-1.5-9B-Chat", "yi-9b", 4096),
        ("01-ai/Yi-34B", "yi-34b", 4096),
        ("01-ai/Yi-34B-Chat", "yi-34b", 4096),
        ("01-ai/Yi-1.5-34B-Chat", "yi-34b", 4096),
        ("google/codegemma-2b", "gemma-2b", 8192),
        ("google/codegemma-7b", "gemma-7b", 8192),
        ("google/codegemma-7b-it", "gemma-7b", 8192),
        ("google/codegemma-1.1-7b-it", "gemma-7b", 8192),
        # the second pass of issue 27: the Qwen3.5 sizes fine-tuned on consumer cards, Qwen3-VL-2B
        ("Qwen/Qwen3.5-0.8B", "qwen3.5-0.8b", 262144),
        ("Qwen/Qwen3.5-2B", "qwen3.5-2b", 262144),
        ("Qwen/Qwen3.5-4B", "qwen3.5-4b", 262144),
        ("Qwen/Qwen3.5-9B", "qwen3.5-9b", 262144),
        ("Qwen/Qwen3-VL-2B-Instruct", "qwen3-vl-2b", 262144),
        ("Qwen/Qwen3-VL-2B-Thinking", "qwen3-vl-2b", 262144),
        # names from unsloth's mapper.py whose family was modelled but had no preset
        ("google/gemma-3-270m", "gemma-3-270m", 32768),
        ("google/gemma-3-270m-it", "gemma-3-270m", 32768),
        ("google/functiongemma-270m-it", "gemma-3-270m", 32768),
        ("codellama/CodeLlama-7b-hf", "codellama-7b", 16384),
        ("codellama/CodeLlama-7b-Instruct-hf", "codellama-7b", 16384),
        ("codellama/CodeLlama-13b-hf", "codellama-13b", 16384),
        ("HuggingFaceTB/SmolLM-135M", "smollm2-135m", 2048),
        ("HuggingFaceTB/SmolLM-360M-Instruct", "smollm2-360m", 2048),
        ("HuggingFaceTB/SmolLM-1.7B-Instruct", "smollm2-1.7b", 2048),
        ("google/gemma-1.1-2b-it", "gemma-2b", 8192),
        ("google/gemma-1.1-7b-it", "gemma-7b", 8192),
        ("Qwen/Qwen3-Coder-30B-A3B-Instruct", "qwen3-coder-30b-a3b", 262144),
    ],
)
def test_the_names_people_type_resolve_to_their_shapes(typed: str, preset: str, positions: int) -> None:
    spec = resolve(typed)
    assert preset_of(spec) == preset and spec.hf_id == typed
    assert spec.max_position_embeddings == positions
    assert spec.num_params == catalog()[preset].num_params


YI_1_5_6B_CONFIG = {  # Yi-1.5-6B's config.json as copied in Girafboy/pytorchKQI's demo.py (the source of yi-6b)
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "max_position_embeddings": 4096,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
    "vocab_size": 64000,
}
QWEN2_7B_INSTRUCT_CONFIG = {  # Qwen2-7B-Instruct's config.json as mlc-llm's qwen2_7b preset copies it
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
    "vocab_size": 152064,
}


@pytest.mark.parametrize(
    ("hub_id", "config"),
    [("01-ai/Yi-1.5-6B", YI_1_5_6B_CONFIG), ("Qwen/Qwen2-7B-Instruct", QWEN2_7B_INSTRUCT_CONFIG)],
)
def test_a_downloaded_qwen2_or_yi_reads_as_its_hub_id(hub_id: str, config: dict, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    local, listed = from_config_json(tmp_path), resolve(hub_id)
    assert (local.num_params, local.lora_params(16, "all")) == (listed.num_params, listed.lora_params(16, "all"))
    assert local.max_position_embeddings == listed.max_position_embeddings


# Qwen3.5-4B's config.json as a C++ engine's test copies it (the qwen3.5-4b preset's source), with the model_type
# keys of the hub's configs. The hub's Qwen3.5 configs state the tie twice, beside and inside text_config (the
# 0.8B's copy shows both): transformers 5.25 builds Qwen3_5ForCausalLM from text_config alone, so the inner one counts.
QWEN3_5_4B_CONFIG = {
    "model_type": "qwen3_5",
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_5_text",
        "tie_word_embeddings": True,
        "vocab_size": 248320,
        "hidden_size": 2560,
        "num_hidden_layers": 32,
        "full_attention_interval": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "intermediate_size": 9216,
        "max_position_embeddings": 262144,
    },
}


def test_a_downloaded_qwen3_5_4b_reads_as_its_hub_id(tmp_path: Path) -> None:
    """The folder and the name give the same model: one tied 248320 x 2560 embedding, the hybrid's layers."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_5_4B_CONFIG))
    local, listed = from_config_json(tmp_path), resolve("Qwen/Qwen3.5-4B")
    assert local.tie_word_embeddings and listed.tie_word_embeddings
    assert (local.num_params, local.lora_params(16, "all")) == (listed.num_params, listed.lora_params(16, "all"))
    assert local.linear_attention == listed.linear_attention
    assert local.max_position_embeddings == listed.max_position_embeddings


def test_yi_6b_summed_by_hand() -> None:
    """Llama blocks with 4 key/value heads of 128: q and o 4096x4096, k and v 4096x512, SwiGLU 3 x 4096x11008,
    two norms; untied 64000 x 4096 embedding and head; the final norm."""
    h, inter, layers, vocab, kv = 4096, 11008, 32, 64000, 4 * 128
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h
    assert layers * per_layer + 2 * vocab * h + h == 6_061_035_520 == resolve("01-ai/Yi-6B-Chat").num_params


@pytest.mark.parametrize(
    ("hub_id", "family"),
    [
        ("google/gemma-4-12B-it", "Gemma 4 12B"),  # the 31B, 26B-A4B, E2B and E4B are modelled: tests/test_gemma4.py
    ],
)
def test_a_2026_family_without_our_layers_is_one_line_naming_it(hub_id: str, family: str) -> None:
    with pytest.raises(UnknownModel) as error:
        resolve(hub_id)
    message = str(error.value)
    assert family in message and "not modelled yet; the nearest supported preset is " in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("config", "family"),
    [
        ({"model_type": "gemma4", "text_config": {"model_type": "gemma4_text", "hidden_size": 64}}, "Gemma 4"),
    ],
    ids=["gemma4"],
)
def test_a_2026_family_config_is_one_line_naming_it(tmp_path: Path, config: dict, family: str) -> None:
    """A Gemma 4 config.json without its shapes (the sizes themselves read: tests/test_gemma4.py)."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidConfig, match=f"{family} .* not usable") as error:
        resolve(str(tmp_path))
    assert "\n" not in str(error.value)


def test_a_fine_tune_not_in_the_catalog_is_pointed_to_its_config_json(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(["plan", "--model", "someone/my-llama-3-8b-finetune", "--gpu", "4090"], capsys)
    assert "not in the catalog" in err and "for a fine-tune" in err
    assert "pass its downloaded folder or its config.json as --model" in err


def test_a_fine_tune_plans_from_its_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What the hint says works: a fine-tune's config.json (a Llama 3 8B with a longer context) plans."""
    config = catalog()["llama-3-8b"].to_hf_config() | {"max_position_embeddings": 16384}
    folder = tmp_path / "my-llama-3-8b-finetune"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    code, out, _ = run_cli(["plan", "--model", str(folder), "--gpu", "4090", "--json"], capsys)
    assert code == 0
    plan = json.loads(out)
    assert plan["model"]["name"] == "my-llama-3-8b-finetune" and plan["estimate"]["total_params"] == 8_030_261_248
