"""Gemma 4: asked for by the names people type, refused in one line that says why and names the closest preset.

Its sizes (transformers' converter _VARIANTS: E2B, E4B, 31B, 26B-A4B) mix block shapes within one model, which the
estimator's one-block-shape terms cannot count; the tests check that claim against the pinned transformers' own
modules, so the line stays true while the refusal does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli
from lorafit.models import resolve, size_in_name

WHY = "Gemma 4 (global layers of another head size, keys as values, shared-KV layers, per-layer embeddings)"
HUB_NAMES = [
    "google/gemma-4-E2B-it",
    "google/gemma-4-E4B-it",
    "google/gemma-4-31B-it",
    "google/gemma-4-26B-A4B-it",
    "google/gemma-4-31B",
    "unsloth/gemma-4-E4B-it-unsloth-bnb-4bit",
    "unsloth/gemma-4-31B-it-bnb-4bit",
]
# transformers' converter, _LARGE_MODEL_VISION_CONFIG: the tower of the 31B and the 26B-A4B (SigLIP's shape)
LARGE_VISION = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16}


def nearest_named(err: str) -> str:
    return err.split("the nearest supported preset is ", 1)[1].split(" ", 1)[0]


@pytest.mark.parametrize("hub_id", HUB_NAMES)
def test_every_gemma4_name_is_one_line_saying_why_and_naming_a_gemma3_image_text_preset(
    hub_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(["plan", "--model", hub_id, "--gpu", "h100"], capsys)
    assert code == 2 and not out
    assert err.startswith(f"lorafit: error: {hub_id}: {WHY} (gemma4) is not modelled yet")
    assert err.count("\n") == 1 and "Traceback" not in err
    stand_in = resolve(nearest_named(err))
    assert stand_in.architecture == "gemma3" and stand_in.vision is not None


@pytest.mark.parametrize("hub_id", ["google/gemma-4-31B-it", "google/gemma-4-26B-A4B-it"])
def test_the_large_sizes_stand_in_has_their_vision_tower_and_size(
    hub_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _, _, err = run_cli(["estimate", "--model", hub_id], capsys)
    stand_in = resolve(nearest_named(err))
    assert stand_in.vision is not None
    assert {key: getattr(stand_in.vision, key) for key in LARGE_VISION} == LARGE_VISION
    named = size_in_name(hub_id)
    assert named is not None and 0.75 < stand_in.num_params / named < 1.25


def tiny_gemma4(**text: object) -> dict:
    """A config.json as transformers writes one for a tiny Gemma 4 (the 31B's attention layout at toy sizes)."""
    from transformers import Gemma4Config, Gemma4TextConfig

    layout = dict(
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
        vocab_size=256,
    )
    return Gemma4Config(text_config=Gemma4TextConfig(**(layout | text)), vision_config=None).to_dict()


@pytest.mark.parametrize("wrapped", [True, False], ids=["gemma4", "gemma4_text"])
def test_a_gemma4_config_json_is_refused_in_one_line(
    tmp_path: Path, wrapped: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tiny_gemma4()
    (tmp_path / "config.json").write_text(json.dumps(config if wrapped else config["text_config"]))
    code, out, err = run_cli(["estimate", "--model", str(tmp_path)], capsys)
    assert code == 2 and not out and err.count("\n") == 1
    assert WHY in err and ("(gemma4)" if wrapped else "(gemma4_text)") in err


def test_gemma4_blocks_differ_in_shape_within_one_model() -> None:
    """The reason the line gives, read off the pinned transformers' modules: a global layer's keys have another
    head size and head count, and it has no v_proj (keys are its values); an E-size's last layers have no k/v."""
    import torch
    from transformers import Gemma4Config, Gemma4ForCausalLM

    def attention_shapes(config: dict) -> list[dict[str, tuple[int, ...]]]:
        with torch.device("meta"):
            model = Gemma4ForCausalLM(Gemma4Config.from_dict(config).text_config)
        layers = model.model.layers
        return [{n: tuple(p.shape) for n, p in layer.self_attn.named_parameters() if "proj" in n} for layer in layers]

    large = attention_shapes(tiny_gemma4())
    sliding, full = large[0], large[5]  # five sliding layers, then a global one
    assert sliding["k_proj.weight"] == (2 * 16, 64) and "v_proj.weight" in sliding
    assert full["k_proj.weight"] == (1 * 32, 64) and "v_proj.weight" not in full
    on_device = attention_shapes(tiny_gemma4(num_hidden_layers=12, num_kv_shared_layers=2, attention_k_eq_v=False))
    assert "k_proj.weight" in on_device[9] and "k_proj.weight" not in on_device[10]
