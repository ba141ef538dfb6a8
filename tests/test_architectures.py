"""The model families as data (catalog/architectures.toml): the table agrees with the names the code declares, and
a family added as one table, with no code change, is read from a config.json and estimated."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import get_args

import pytest

from conftest import run_cli
from lorafit import families, models
from lorafit.families import MODEL_TYPES, Architecture, architectures, model_types
from lorafit.models import catalog

SHIPPED = resources.files("lorafit").joinpath("catalog/architectures.toml").read_text()


def test_the_architecture_literal_lists_the_tables_families() -> None:
    assert set(get_args(Architecture)) == set(architectures())
    assert model_types() == MODEL_TYPES


def test_every_family_has_a_preset_so_the_count_tests_reach_it() -> None:
    assert {spec.architecture for spec in catalog().values()} == set(architectures())


def test_each_model_type_names_one_family() -> None:
    listed = [model_type for arch in architectures().values() for model_type in arch.model_types]
    assert len(listed) == len(set(listed))


def with_family(monkeypatch: pytest.MonkeyPatch, like: str, name: str, **changes: object) -> None:
    """Add family `name` to the table only: a copy of family `like`'s traits with `changes`, read from model_type
    `name`. Nothing else is patched."""
    traits = architectures()[like].model_dump(exclude={"name", "source"})
    traits |= {"model_types": [name], "source": "a test"} | changes
    rows = [f"{key} = {json.dumps(value)}" for key, value in traits.items() if value is not None]
    text = SHIPPED + f"\n[architecture.{name}]\n" + "\n".join(rows) + "\n"
    monkeypatch.setattr(families, "architectures", lambda: families.load_architectures(text))


def write_config(folder: Path, preset: str, model_type: str) -> Path:
    """A config.json of `preset`'s shape under another model_type, in its own `model` folder."""
    (folder / "model").mkdir(parents=True)
    config = catalog()[preset].to_hf_config() | {"model_type": model_type}
    (folder / "model" / "config.json").write_text(json.dumps(config))
    return folder / "model"


def estimate(folder: Path, capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    code, out, err = run_cli(["estimate", "--model", str(folder), "--gpu", "a100-80gb", *args, "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    del result["model"]["architecture"]
    return result


@pytest.mark.parametrize("args", [(), ("--method", "full", "--attn", "eager")])
def test_a_family_added_as_a_table_entry_is_estimated_like_the_family_it_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: tuple[str, ...]
) -> None:
    with_family(monkeypatch, "llama", "llamalike")
    spec = models.resolve(str(write_config(tmp_path / "new", "llama-2-7b", "llamalike")))
    assert spec.architecture == "llamalike"
    copied = estimate(write_config(tmp_path / "old", "llama-2-7b", "llama"), capsys, *args)
    assert estimate(tmp_path / "new" / "model", capsys, *args) == copied


def test_a_new_familys_traits_change_its_counts_and_estimate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Llama block with Phi-3's fused projections and Gemma-2's post norms, as data only."""
    with_family(monkeypatch, "llama", "fusedlike", fused_qkv=True, fused_gate_up=True, norms_per_layer=4)
    llama = catalog()["llama-2-7b"]
    spec = models.resolve(str(write_config(tmp_path / "new", "llama-2-7b", "fusedlike")))
    assert spec.lora_target_names("all") == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert spec.lora_target_names("qv") == ("qkv_proj",)
    # the same weights, fused, plus the two extra norms of every layer
    assert spec.num_params == llama.num_params + 2 * llama.hidden_size * llama.num_hidden_layers
    # every layer's activations are kept without checkpointing: the extra norms' saved inputs show
    new = estimate(tmp_path / "new" / "model", capsys, "--no-grad-ckpt")
    old = estimate(write_config(tmp_path / "old", "llama-2-7b", "llama"), capsys, "--no-grad-ckpt")
    assert new["total_params"] == spec.num_params
    assert new["breakdown_gib"]["activations"] > old["breakdown_gib"]["activations"]


def test_a_table_with_a_misspelt_trait_is_refused() -> None:
    with pytest.raises(ValueError, match="fused_qvk"):
        families.load_architectures(SHIPPED.replace("fused_qkv = true", "fused_qvk = true"))
