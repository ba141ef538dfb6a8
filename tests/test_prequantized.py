"""Pre-quantised checkpoints (unsloth's `*-bnb-4bit` repos, a folder saved from a 4-bit model): planned and
trained as QLoRA over the base as stored, every other method refused in one line naming the 16-bit base.

The trained folder is a tiny model quantised by bitsandbytes on the CPU and saved, as unsloth saves its repos.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import run_cli
from lorafit.models import from_config_json, resolve
from lorafit.schema import Plan

# the names of the issue, with the base whose shapes each has and the 16-bit checkpoint a refusal names
PREQUANTIZED = {
    "unsloth/llama-3-8b-bnb-4bit": ("llama-3-8b", "meta-llama/Meta-Llama-3-8B"),
    "unsloth/Qwen3-8B-unsloth-bnb-4bit": ("qwen3-8b", "Qwen/Qwen3-8B"),
    "unsloth/mistral-7b-instruct-v0.3-bnb-4bit": ("mistral-7b-v0.3", "mistralai/Mistral-7B-Instruct-v0.3"),
    "unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit": ("llama-3.1-8b", "meta-llama/Meta-Llama-3.1-8B-Instruct"),
    "unsloth/llama-3-8b-Instruct-bnb-4bit": ("llama-3-8b", "meta-llama/Meta-Llama-3-8B-Instruct"),
    "someone/Qwen2.5-7B-Instruct-bnb-4bit": ("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct"),
}


@pytest.mark.parametrize("name", sorted(PREQUANTIZED))
def test_a_prequantized_repo_has_its_base_shapes_stored_in_nf4(name: str) -> None:
    preset, base = PREQUANTIZED[name]
    spec = resolve(name)
    assert spec.num_params == resolve(preset).num_params
    assert spec.variant_of == preset and spec.hf_id == name
    assert spec.prequantized is not None
    assert (spec.prequantized.quant, spec.prequantized.double_quant, spec.prequantized.base) == ("nf4", True, base)
    assert resolve(base).prequantized is None  # the 16-bit base itself is not


def test_a_prequantized_copy_of_an_unknown_model_names_what_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["plan", "--model", "someone/my-own-7b-bnb-4bit", "--gpu", "4090"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "pre-quantised copy of 'my-own-7b'" in err and "config.json" in err


def test_the_plan_of_a_prequantized_repo_is_qlora_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["plan", "--model", "unsloth/llama-3-8b-bnb-4bit", "--gpu", "4090", "--json"], capsys)
    assert code == 0
    plan = json.loads(out)
    assert (plan["method"], plan["quant"], plan["settings"]["double_quant"]) == ("qlora", "nf4", True)
    said = [reason for reason in plan["reasons"] if "pre-quantised" in reason]
    assert len(said) == 1 and "meta-llama/Meta-Llama-3-8B" in said[0]
    assert Plan.model_validate(plan).model.prequantized is not None  # the plan carries it to `train`


@pytest.mark.parametrize(
    "flags",
    [["--method", "lora"], ["--method", "full"], ["--quant", "int8"], ["--no-double-quant"]],
    ids=["lora", "full", "int8", "no-double-quant"],
)
@pytest.mark.parametrize("command", ["plan", "estimate"])
def test_another_method_on_a_prequantized_repo_is_one_line_naming_the_base(
    command: str, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli([command, "--model", "unsloth/Qwen3-8B-unsloth-bnb-4bit", "--gpu", "4090", *flags], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("lorafit: error:")
    assert "pre-quantised 4-bit checkpoint: only --method qlora --quant nf4 trains it" in err
    assert "use the 16-bit base Qwen/Qwen3-8B" in err


def test_sharding_the_stored_weights_is_refused_and_not_suggested(capsys: pytest.CaptureFixture[str]) -> None:
    model = ["--model", "unsloth/Meta-Llama-3.1-70B-Instruct-bnb-4bit", "--gpu", "4090"]
    code, _, err = run_cli(["plan", *model, "--n-gpus", "2", "--shard", "fsdp"], capsys)
    assert code == 2 and err.count("\n") == 1 and "stores its 4-bit weights as uint8" in err
    code, out, _ = run_cli(["plan", *model, "--json"], capsys)
    assert code == 0
    shards = {suggestion["shard"] for suggestion in json.loads(out)["suggestions"]}
    assert not shards & {"zero3", "fsdp"}


# --- a folder saved 4-bit --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_4bit(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny model quantised to NF4 (double-quantised, computing in bf16) by bitsandbytes and saved with its
    tokenizer: what a pre-quantised repo's download holds."""
    from lorafit.schema import Settings
    from lorafit.train import build
    from lorafit.train.demo import build_model, build_tokenizer, corpus, tiny_spec
    from test_train import write_alpaca

    root = tmp_path_factory.mktemp("prequantized")
    tokenizer = build_tokenizer(corpus(), vocab_size=512)
    build_model(root / "base", tokenizer, tiny_spec(len(tokenizer), hidden_size=64), seed=0)
    model = build.load_model(root / "base", Settings(method="qlora", precision="bf16"))
    model.save_pretrained(root / "model")
    for file in (root / "base").iterdir():
        if "token" in file.name:
            shutil.copy(file, root / "model")
    return {"model": root / "model", "data": write_alpaca(root / "data.jsonl", 24)}


def test_a_saved_4bit_folder_reads_as_prequantized(saved_4bit: dict[str, Path]) -> None:
    stored = json.loads((saved_4bit["model"] / "config.json").read_text())["quantization_config"]
    assert stored["bnb_4bit_compute_dtype"] == "bfloat16"  # what the check below overrides
    spec = from_config_json(saved_4bit["model"])
    assert spec.prequantized is not None
    assert (spec.prequantized.quant, spec.prequantized.double_quant) == ("nf4", True)


def test_a_folder_stored_in_fp4_reads_but_plans_in_one_line_naming_the_16_bit_base(
    saved_4bit: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bitsandbytes' default 4-bit type: the folder is read (an export merges into it), a plan refuses it."""
    folder = tmp_path / "fp4"
    shutil.copytree(saved_4bit["model"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["bnb_4bit_quant_type"] = "fp4"
    (folder / "config.json").write_text(json.dumps(config))
    stored = from_config_json(folder).prequantized
    assert stored is not None and stored.quant == "fp4"
    code, _, err = run_cli(["plan", "--model", str(folder), "--gpu", "RTX 4090"], capsys)
    assert code == 2 and err.count("\n") == 1 and "fp4" in err and "16-bit base" in err, err


def test_the_trainer_loads_the_stored_weights_as_they_are(saved_4bit: dict[str, Path]) -> None:
    """Not quantised again: the packed 4-bit weights are the file's bytes, and they compute in the plan's dtype
    (fp32 on the CPU), not in the bf16 the folder was saved with."""
    import torch
    from safetensors.torch import load_file

    from lorafit.schema import Settings
    from lorafit.train import build

    model = build.load_model(saved_4bit["model"], Settings(method="qlora", precision="fp32"))
    layer = model.model.layers[0].self_attn.q_proj
    stored = load_file(str(saved_4bit["model"] / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(layer.weight.data.flatten(), stored.flatten())
    assert layer.compute_dtype == torch.float32


def test_train_runs_qlora_on_a_prequantized_folder_and_refuses_lora(
    saved_4bit: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["train", "--model", str(saved_4bit["model"]), "--data", str(saved_4bit["data"]), "--max-steps", "2"]
    code, _, err = run_cli([*common, "--output-dir", str(tmp_path / "lora"), "--method", "lora"], capsys)
    assert code == 2 and err.count("\n") == 1 and "only --method qlora --quant nf4 trains it" in err
    assert not (tmp_path / "lora").exists()
    code, _, err = run_cli([*common, "--output-dir", str(tmp_path / "run"), "--micro-batch", "4"], capsys)
    assert code == 0, err
    plan = Plan.load(tmp_path / "run" / "plan.json")
    assert (plan.method, plan.quant) == ("qlora", "nf4") and plan.model.prequantized is not None
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()


def tiny_4bit_config(folder: Path, skip: list[str] | None) -> Path:
    """A config.json as Unsloth saves a dynamic 4-bit repo: nf4 with double quantisation and, where given, the
    modules it keeps 16-bit. 12 layers of width 256 (k and v 128 wide), MLP 512."""
    quantization = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}
    if skip is not None:
        quantization["llm_int8_skip_modules"] = skip
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 12,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
        "max_position_embeddings": 2048,
        "quantization_config": quantization,
    }
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_dynamic_4bit_config_counts_the_layers_it_keeps_16bit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """llm_int8_skip_modules, matched as transformers 5 matches it: from the start of the module's name up to a
    module boundary ("model.layers.1" is not "model.layers.11"), or as its suffix ("layers.5.mlp" is neither). The
    kept weights are 16-bit in the estimate, and the plan no longer says the estimate may be low."""
    from lorafit import memory
    from lorafit.schema import Settings

    skip = ["lm_head", "model.layers.1.self_attn", "model.layers.3.mlp.down_proj", "layers.5.mlp", "7.mlp.up_proj"]
    dynamic = from_config_json(tiny_4bit_config(tmp_path / "Tiny-unsloth-bnb-4bit", skip))
    plain = from_config_json(tiny_4bit_config(tmp_path / "plain", None))
    attention = 256 * 256 * 2 + 256 * 128 * 2  # q, o; k, v
    assert dynamic.prequantized is not None and plain.prequantized is not None
    assert dynamic.prequantized.kept_16bit_params == attention + 512 * 256 + 256 * 512  # + layer 7's up_proj
    assert plain.prequantized.kept_16bit_params == 0
    settings = Settings(method="qlora")
    runtime = memory.stack_runtime(settings)
    grown = memory.weights_bytes(dynamic, settings, runtime) - memory.weights_bytes(plain, settings, runtime)
    nf4 = 0.5 + 1 / 64 + 4 / (64 * 256)  # double-quantised nf4 bytes per weight
    assert grown == pytest.approx(dynamic.prequantized.kept_16bit_params * (2 - nf4))
    folder = str(tmp_path / "Tiny-unsloth-bnb-4bit")
    code, out, _ = run_cli(["plan", "--model", folder, "--gpu", "T4", "--json"], capsys)
    assert code == 0 and "dynamic 4-bit" not in " ".join(json.loads(out)["reasons"])


def test_a_catalogued_dynamic_repo_counts_its_16bit_weights_and_stack_unsloth_loads_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Named without its config.json, one of Unsloth's dynamic repos in catalog/unsloth_dynamic.toml counts the
    16-bit weights the catalog gives; planned by its 16-bit name under `--stack unsloth`, which loads that repo with
    load_in_4bit, the plan counts them too (the same weights as the repo's own plan) and says by how much they
    exceed all 4-bit; another stack plans the name as all 4-bit. A repo the catalog lacks still says only that the
    estimate may be low."""
    repo = "unsloth/Qwen3-14B-unsloth-bnb-4bit"
    stored = resolve(repo).prequantized
    assert stored is not None and stored.kept_16bit_params == 1_572_000_000
    job = ["plan", "--gpu", "A100 80GB", "--method", "qlora", "--micro-batch", "1", "--json"]
    plans = {
        (model, stack): json.loads(run_cli([*job, "--model", model, "--stack", stack], capsys)[1])
        for model in ("qwen3-14b", repo)
        for stack in ("unsloth", "trl")
    }
    weights = {key: plan["estimate"]["breakdown_gib"]["weights"] for key, plan in plans.items()}
    assert weights["qwen3-14b", "unsloth"] == weights[repo, "unsloth"]
    same = plans["qwen3-14b", "unsloth"]["settings"] == plans[repo, "unsloth"]["settings"]
    assert same and plans["qwen3-14b", "unsloth"]["tokens_per_s"] == plans[repo, "unsloth"]["tokens_per_s"]
    more = weights["qwen3-14b", "unsloth"] - weights["qwen3-14b", "trl"]
    assert more > 2 and weights[repo, "trl"] == weights[repo, "unsloth"]
    said = next(reason for reason in plans["qwen3-14b", "unsloth"]["reasons"] if repo in reason)
    assert f"counted here, {more:.2f} GiB more than all 4-bit" in said
    assert not any("may be low" in reason for plan in plans.values() for reason in plan["reasons"])
    code, out, _ = run_cli(["plan", "--model", "unsloth/Qwen3-8B-unsloth-bnb-4bit", "--gpu", "T4", "--json"], capsys)
    assert code == 0 and any("may be low" in reason for reason in json.loads(out)["reasons"])
