"""The `lorafit` command as a user and a program see it: JSON fields, exit codes, one-line errors, no torch.

Most tests call `lorafit.cli.main` in-process; a few run the installed `lorafit` script, as a user would.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli, tiny_spec
from lorafit import hardware, models

LORAFIT = Path(sys.executable).with_name("lorafit")


run = run_cli


def run_json(args: list[str], capsys: pytest.CaptureFixture[str]) -> object:
    code, out, err = run([*args, "--json"], capsys)
    assert code == 0, err
    return json.loads(out)


@pytest.fixture
def no_local_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine where neither NVML nor torch finds a GPU, whatever the test machine has."""
    monkeypatch.setattr(hardware, "_nvml_gpus", lambda: None)
    monkeypatch.setattr(hardware, "_torch_gpus", lambda: [])


# --- estimate ------------------------------------------------------------------------------------------------
def test_estimate_json_has_the_three_peaks_the_breakdown_and_the_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(["estimate", "--model", "llama-2-7b", "--gpu", "RTX 4090", "--lora-r", "32"], capsys)
    for key in ("peak_allocated_gib", "peak_reserved_gib", "peak_device_gib", "breakdown_gib", "fits"):
        assert key in data
    assert data["peak_allocated_gib"] <= data["peak_reserved_gib"] <= data["peak_device_gib"]
    assert data["fits"] is True
    assert data["breakdown_gib"]["weights"] > 0
    # the inputs as resolved: the preset's shape, defaults filled in, the catalog GPU
    assert data["model"]["name"] == "llama-2-7b" and data["model"]["hidden_size"] == 4096
    settings = data["settings"]
    assert settings["method"] == "qlora" and settings["quant"] == "nf4"
    assert settings["lora_r"] == 32 and settings["lora_alpha"] == 64
    assert data["gpu"]["name"] == "RTX 4090"
    assert data["exact"] is False


def test_estimate_without_a_gpu_gives_no_verdict(capsys: pytest.CaptureFixture[str], no_local_gpu: None) -> None:
    data = run_json(["estimate", "--model", "llama-2-7b"], capsys)
    assert data["fits"] is None and data["gpu"] is None


def test_estimate_verdict_follows_the_card(capsys: pytest.CaptureFixture[str]) -> None:
    big = run_json(["estimate", "--model", "llama-2-7b", "--method", "full", "--gpu", "H100 SXM"], capsys)
    small = run_json(["estimate", "--model", "llama-2-7b", "--method", "full", "--vram", "24"], capsys)
    assert big["peak_device_gib"] == small["peak_device_gib"]
    assert big["fits"] is True and small["fits"] is False
    assert big["settings"]["quant"] == "none"


def test_estimate_for_people_prints_the_table_and_the_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["estimate", "--model", "llama-2-7b", "--gpu", "RTX 4090"], capsys)
    assert code == 0
    assert "device (nvidia-smi)" in out and "fits" in out and "RTX 4090" in out


# --- plan ---------------------------------------------------------------------------------------------------------
PLAN_KEYS = (
    "fits",
    "micro_batch",
    "grad_accum",
    "grad_ckpt",
    "seq_len",
    "optimizer",
    "method",
    "quant",
    "estimate",
    "tokens_per_s",
    "hours",
    "cost_cloud_usd",
    "cost_local_usd",
    "suggestions",
)


def test_plan_json_has_the_flat_fields(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(["plan", "--model", "llama-2-7b", "--gpu", "RTX 4090"], capsys)
    for key in PLAN_KEYS:
        assert key in data, key
    assert data["fits"] is True and data["suggestions"] == []
    assert data["micro_batch"] == data["settings"]["micro_batch"]
    assert data["micro_batch"] * data["grad_accum"] == 16
    assert data["estimate"]["fits"] is True
    assert data["cost_cloud_usd"] > 0 and data["hours"] > 0 and data["tokens_per_s"] > 0


def test_plan_json_suggests_changes_when_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(["plan", "--model", "llama-2-7b", "--gpu", "RTX 4090", "--method", "full"], capsys)
    assert data["fits"] is False
    assert data["suggestions"]
    for suggestion in data["suggestions"]:
        assert suggestion["change"] and suggestion["estimate"]["fits"] is True


def test_plan_pins_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(
        [
            "plan",
            "--model",
            "llama-2-7b",
            "--gpu",
            "RTX 4090",
            "--micro-batch",
            "2",
            "--no-grad-ckpt",
            "--optimizer",
            "paged_adamw_8bit",
            "--lora-r",
            "8",
            "--seq-len",
            "512",
        ],
        capsys,
    )
    assert (data["micro_batch"], data["grad_ckpt"], data["optimizer"], data["seq_len"]) == (
        2,
        False,
        "paged_adamw_8bit",
        512,
    )
    assert data["settings"]["lora_r"] == 8 and data["settings"]["lora_alpha"] == 16


def test_plan_with_nothing_given_plans_the_embedded_cards(
    capsys: pytest.CaptureFixture[str], no_local_gpu: None
) -> None:
    data = run_json(["plan"], capsys)
    assert [plan["gpu"]["name"] for plan in data] == ["RTX 4090", "RTX 4060 Ti 16GB"]
    for plan in data:
        assert plan["model"]["name"] == "llama-2-7b"
        for key in PLAN_KEYS:
            assert key in plan, key


@pytest.mark.parametrize(
    ("args", "optimizer"),
    [
        (["--gpu", "A40", "--optimizer", "adamw_8bit"], "adamw_8bit"),
        (["--method", "full", "--optimizer", "sgd"], "sgd"),
    ],
)
def test_a_pinned_optimizer_outside_the_search_is_planned(
    args: list[str], optimizer: str, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = run_json(["plan", "--model", "llama-2-7b", *args], capsys)
    assert plan["settings"]["optimizer"] == optimizer


def test_compare_names_the_hourly_price_and_the_cost_of_the_run_apart(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["plan", "--model", "llama-2-7b", "--compare", "--max-price-hour", "1"], capsys)
    assert code == 0
    line = next(line for line in out.splitlines() if line.startswith("cheapest at most $1/GPU-hour"))
    assert "/hour," in line and "for the whole run" in " ".join(out.split())


def test_plan_compare_json_names_the_cheapest(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(["plan", "--model", "llama-2-7b", "--compare", "--max-price-hour", "0.3"], capsys)
    rented = [p for p in data["plans"] if p["fits"] and p["cost_cloud_usd"] is not None]
    cheapest = min(rented, key=lambda p: p["cost_cloud_usd"])
    under = min((p for p in rented if p["gpu"]["rent_usd_per_hour"] <= 0.3), key=lambda p: p["cost_cloud_usd"])
    assert data["cheapest"] == cheapest["gpu"]["name"]
    assert data["cheapest_under_price"] == under["gpu"]["name"]
    assert data["max_price_hour"] == 0.3


@pytest.mark.parametrize("flags", [["--gpu", "RTX 4090"], ["--vram", "24"]])
def test_compare_refuses_one_gpu_rather_than_ignore_it(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["plan", "--model", "llama-2-7b", "--compare", *flags], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert f"--compare plans on every catalog GPU; drop {flags[0]}" in err


def test_plan_for_people(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["plan", "--model", "llama-2-70b", "--gpu", "RTX 4090"], capsys)
    assert code == 0
    assert "does not fit" in out and "smallest changes that fit" in out


# --- bad input: one line, exit 2 -----------------------------------------------------------------------------------
def write_config(folder: Path, text: str) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(text)
    return str(folder)


BAD_INPUT = {
    "unknown model": (["plan", "--model", "lama-2-7b", "--gpu", "RTX 4090"], "did you mean llama-2-7b"),
    "unknown model estimate": (["estimate", "--model", "mistral-7"], "mistral-7b"),
    "unknown GPU": (["plan", "--model", "llama-2-7b", "--gpu", "RTX 9999"], "no GPU 'RTX 9999'"),
    "zero micro-batch estimate": (["estimate", "--micro-batch", "0"], "--micro-batch 0: must be greater than 0"),
    "zero micro-batch plan": (
        ["plan", "--model", "llama-2-7b", "--gpu", "RTX 4090", "--micro-batch", "0"],
        "--micro-batch",
    ),
    "negative sequence estimate": (["estimate", "--seq-len", "-5"], "--seq-len -5"),
    "negative sequence plan": (["plan", "--model", "llama-2-7b", "--gpu", "RTX 4090", "--seq-len", "-5"], "--seq-len"),
    "zero vram": (["plan", "--model", "llama-2-7b", "--vram", "0"], "--vram"),
    "zero vram estimate": (["estimate", "--vram", "0"], "--vram"),
    "past the model's maximum": (["estimate", "--model", "llama-2-7b", "--seq-len", "8192"], "4096"),
    "past the model's maximum plan": (
        ["plan", "--model", "llama-2-7b", "--gpu", "RTX 4090", "--seq-len", "8192"],
        "4096",
    ),
    "bad method": (["plan", "--model", "llama-2-7b", "--gpu", "RTX 4090", "--method", "qlorra"], "method"),
    "bad method estimate": (["estimate", "--method", "dora"], "method"),
    "zero lora rank": (["plan", "--model", "llama-2-7b", "--gpu", "RTX 4090", "--lora-r", "0"], "--lora-r 0"),
    "zero tokens": (["plan", "--model", "llama-2-7b", "--gpu", "RTX 4090", "--tokens", "0"], "--tokens"),
    "headroom of 1": (["estimate", "--headroom", "1"], "--headroom"),
    "gpu and vram": (["estimate", "--gpu", "RTX 4090", "--vram", "24"], "not both"),
    "vram nan": (["plan", "--model", "llama-2-7b", "--vram", "nan"], "--vram nan: must be a finite number"),
    "vram inf": (["estimate", "--vram", "inf"], "--vram inf: must be a finite number"),
    "a million GPUs": (["plan", "--model", "llama-2-7b", "--n-gpus", "1000000"], "--n-gpus 1000000: must be at most"),
    "more GPUs than sequences": (
        ["plan", "--model", "llama-2-7b", "--gpu", "RTX 4090", "--n-gpus", "8", "--nodes", "4"],
        "n_gpus 8 x nodes 4 = 32 GPUs do not divide batch_size 16",
    ),
    "micro-batch that does not divide the batch": (
        ["plan", "--model", "llama-2-7b", "--gpu", "RTX 4090", "--micro-batch", "3"],
        "micro_batch 3 does not divide batch_size 16",
    ),
    "train batch of 3 in micro-batches of 2": (
        ["train", "--batch-size", "3", "--micro-batch", "2"],
        "micro_batch 2 does not divide batch_size 3",
    ),
    "alpha 0 is not silently 2r": (["estimate", "--lora-alpha", "0"], "--lora-alpha 0: must be greater than 0"),
    "empty output dir": (["train", "--output-dir", ""], "--output-dir '': must not be empty"),
    "bf16 on a T4": (["estimate", "--gpu", "T4", "--precision", "bf16"], "the T4 has no bf16"),
    "unknown flag": (["plan", "--lora-rank", "3"], "No such option: --lora-rank"),
    "flag without its value": (["plan", "--gpu"], "'--gpu' requires an argument"),
    "lora over int8": (["estimate", "--method", "lora", "--quant", "int8"], "quant must be none"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_one_line_and_exit_2(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    args, mentioned = BAD_INPUT[case]
    code, out, err = run(args, capsys)
    assert code == 2
    assert out == ""
    assert err.startswith("lorafit: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert mentioned in err


@pytest.mark.parametrize(
    "text, mentioned",
    [
        ('{"model_type": "bert", "hidden_size": 64}', "model_type 'bert' is not supported"),
        ('{"model_type": "llama", "hidden_size": 64,', "not valid JSON"),
        ('["llama"]', "must hold a JSON object"),
        ('{"model_type": "llama", "hidden_size": 64}', "intermediate_size"),
    ],
)
def test_bad_config_json_is_one_line_and_exit_2(
    text: str, mentioned: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_config(tmp_path / "model", text)
    for command in (["estimate", "--model", folder], ["plan", "--model", folder, "--gpu", "RTX 4090"]):
        code, out, err = run(command, capsys)
        assert code == 2 and out == ""
        assert err.startswith("lorafit: error: ") and err.count("\n") == 1, err
        assert mentioned in err


def test_a_local_config_json_is_planned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tiny_spec(
        hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=4, vocab_size=2048
    )
    folder = write_config(tmp_path / "tiny-llama", json.dumps(spec.to_hf_config()))
    data = run_json(
        ["estimate", "--model", folder, "--method", "lora", "--gpu", "RTX 4090", "--seq-len", "256"], capsys
    )
    assert data["model"]["name"] == "tiny-llama" and data["model"]["num_hidden_layers"] == 2
    assert data["total_params"] == spec.num_params
    assert data["fits"] is True


# --- the other listings --------------------------------------------------------------------------------------------
def test_gpus_filtered_by_memory(capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_json(["gpus", "--min-vram", "40"], capsys)
    names = {row["name"] for row in rows}
    assert {"A100 80GB", "H100 SXM", "A40"} <= names and "RTX 4090" not in names
    assert all(row["memory_gib"] * row["usable_fraction"] >= 40 for row in rows)
    assert all(row["source"] and row["as_of"] for row in rows)


def test_gpus_filtered_by_rent(capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_json(["gpus", "--max-price-hour", "0.4"], capsys)
    assert "RTX 4090" in {row["name"] for row in rows}
    assert all(row["rent_usd_per_hour"] is not None and row["rent_usd_per_hour"] <= 0.4 for row in rows)
    everything = run_json(["gpus"], capsys)
    assert len(everything) == len(hardware.catalog()) > len(rows)


def test_models_json_lists_every_preset_with_its_size(capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_json(["models"], capsys)
    assert {row["name"] for row in rows} == {spec.name for spec in models.catalog().values()}
    seven = next(row for row in rows if row["name"] == "llama-2-7b")
    assert seven["num_params"] == models.resolve("llama-2-7b").num_params
    assert seven["hf_id"] == "meta-llama/Llama-2-7b-hf"


def test_detect_without_a_gpu_is_an_empty_list(capsys: pytest.CaptureFixture[str], no_local_gpu: None) -> None:
    data = run_json(["detect"], capsys)
    assert data["gpus"] == []
    assert data["cpu_cores"] >= 1


# --- the installed command ------------------------------------------------------------------------------------------
def lorafit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LORAFIT), *args], capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("command", ["models", "gpus"])
def test_the_catalogs_fit_an_80_column_terminal(command: str) -> None:
    """Each preset or card on one line, none wider than the terminal (hub ids used to wrap over four lines)."""
    entries = len(models.catalog()) if command == "models" else len(hardware.gpus())
    done = subprocess.run(
        [str(LORAFIT), command],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=os.environ | {"COLUMNS": "80"},
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert len([line for line in lines if line.startswith("│")]) == entries  # a wrapped row takes two
    assert "…" not in done.stdout  # what is shown is shown whole
    assert "left out to fit 80 columns" in done.stdout


def test_installed_command_plans_and_fails_cleanly() -> None:
    done = lorafit("plan", "--model", "llama-2-7b", "--gpu", "RTX 4090", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["fits"] is True
    bad = lorafit("plan", "--model", "no-such-model", "--gpu", "RTX 4090")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("lorafit: error: ") and bad.stderr.count("\n") == 1


def test_planning_never_imports_torch() -> None:
    script = (
        "import sys, json\n"
        "import lorafit.cli\n"
        "assert 'torch' not in sys.modules, 'import lorafit.cli'\n"
        "from lorafit.cli import main\n"
        "for args in (['plan', '--json', '--model', 'llama-2-7b', '--gpu', 'RTX 4090'],\n"
        "             ['plan', '--json', '--model', 'llama-2-70b', '--vram', '24'],\n"
        "             ['estimate', '--json', '--gpu', 'RTX 4090'], ['plan', '--json', '--compare']):\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit as exit_info:\n"
        "        assert exit_info.code == 0, args\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'datasets', 'peft'})\n"
        "print(json.dumps(heavy), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stderr.strip().splitlines()[-1]) == []


# --- --stack, its facets, and --from another trainer's config ---------------------------------------------------
CONFIGS = Path(__file__).parent / "data" / "configs"


def without_source(answer: dict) -> dict:
    return {key: value for key, value in answer.items() if key != "from"}


# Each config's run written out as flags by hand, from the file and the tool's documented defaults: axolotl's
# QLoRA example (its step is answered by peft-kbit, axolotl's own is not offered), and LLaMA-Factory's LoRA SFT
# example (finetuning_type lora with lora_rank 8, alpha 2 x rank, every linear layer, cutoff_len 2048, bf16,
# checkpointing on by LLaMA-Factory's default, AdamW as transformers' default optim).
AXOLOTL_QLORA = shlex.split(
    "--stack peft-kbit --model NousResearch/Meta-Llama-3-8B --method qlora --seq-len 4096 "
    "--micro-batch 2 --lora-r 32 --lora-alpha 16 --lora-dropout 0.05 --lora-targets all --optimizer "
    "paged_adamw_32bit --grad-ckpt --attn flash --grad-accum 4"
)
LLAMA_FACTORY_LORA = shlex.split(
    "--stack llama-factory --model meta-llama/Meta-Llama-3-8B-Instruct --method lora --seq-len 2048 "
    "--micro-batch 1 --lora-r 8 --lora-alpha 16 --lora-dropout 0 --lora-targets all --grad-ckpt "
    "--precision bf16 --autocast --grad-accum 8 --optimizer adamw"
)


@pytest.mark.parametrize(
    ("config", "flags", "plan_flags"),
    [
        ("axolotl_llama3_qlora.yml", AXOLOTL_QLORA, ["--epochs", "4"]),
        ("llama_factory_llama3_lora_sft.yaml", LLAMA_FACTORY_LORA, ["--epochs", "3"]),
    ],
)
def test_from_a_config_answers_as_the_same_run_given_as_flags(
    config: str, flags: list[str], plan_flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(CONFIGS / config)
    for command, extra in (("estimate", []), ("plan", plan_flags)):
        from_file = run_json([command, "--from", path, "--gpu", "RTX 4090"], capsys)
        as_flags = run_json([command, *flags, *extra, "--gpu", "RTX 4090"], capsys)
        assert without_source(from_file) == as_flags, command
        assert from_file["from"]["path"] == path
    assert from_file["fits"] is as_flags["fits"] is not None


def test_from_says_which_stack_answers_and_what_it_does_not_model(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        ["estimate", "--from", str(CONFIGS / "axolotl_llama3_lora_8b.yml"), "--gpu", "A100 80GB"], capsys
    )
    assert code == 0, err
    assert "read as a config of axolotl; answered for stack peft-kbit" in err
    assert "warning: stack axolotl is not offered" in err
    assert "deepspeed_configs/zero2.json" in err  # a DeepSpeed file is not read
    assert "stack peft-kbit" in out  # the settings line names the step that was estimated
    data = run_json(["estimate", "--from", str(CONFIGS / "axolotl_llama3_lora_8b.yml"), "--gpu", "A100 80GB"], capsys)
    assert data["from"]["kind"] == "axolotl" and data["from"]["stack"] == "peft-kbit"
    assert any("deepspeed" in line for line in data["from"]["warnings"])
    assert data["settings"]["train_embeddings"] is True  # lora_modules_to_save: [embed_tokens, lm_head]


def test_flags_override_the_config_file(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(CONFIGS / "llama_factory_llama3_lora_sft.yaml")
    data = run_json(["estimate", "--from", path, "--seq-len", "1024", "--stack", "lorafit"], capsys)
    assert data["settings"]["seq_len"] == 1024 and data["settings"]["stack"] == "lorafit"
    assert data["settings"]["lora_r"] == 8  # the rest still from the file


def test_the_stack_and_its_facets_change_the_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["estimate", "--model", "llama-2-7b", "--method", "qlora", "--gpu", "RTX 4090"]
    peaks = {
        name: run_json([*base, *flags], capsys)["peak_allocated_gib"]
        for name, flags in {
            "lorafit": [],
            "peft-kbit": ["--stack", "peft-kbit"],
            "lorafit, kbit prep": ["--kbit-prep"],
            "peft-kbit, no kbit prep": ["--stack", "peft-kbit", "--no-kbit-prep"],
        }.items()
    }
    # peft's preparation upcasts the embeddings, the head and the norms to fp32: more memory, whichever stack
    assert peaks["peft-kbit"] > peaks["lorafit"]
    assert peaks["lorafit, kbit prep"] > peaks["lorafit"]
    assert peaks["peft-kbit, no kbit prep"] < peaks["peft-kbit"]
    code, out, _ = run([*base, "--stack", "trl", "--no-autocast"], capsys)
    assert code == 0 and "stack trl (no autocast): qlora nf4" in out


def test_lorafit_stacks_lists_every_stack_and_says_which_are_not_offered(capsys: pytest.CaptureFixture[str]) -> None:
    listed = run_json(["stacks"], capsys)
    by_name = {stack["name"]: stack for stack in listed}
    assert set(by_name) == {"lorafit", "trl", "peft-kbit", "axolotl", "llama-factory", "litgpt", "torchtune", "unsloth"}
    assert by_name["unsloth"]["offered"] is True and "unsloth 2026.8.19" in by_name["unsloth"]["pinned"]
    assert all(stack["pinned"] and stack["traced"] for stack in listed)
    for name in ("axolotl", "torchtune"):
        assert by_name[name]["offered"] is False and by_name[name]["not_offered_because"]
    code, out, _ = run(["stacks"], capsys)
    assert code == 0 and "[not offered:" in out and "trl 1.16.0" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stack", "deepspeed-chat"], "stack"),
        (["--stack", "torchtune"], "stack torchtune: not offered"),
        (["--stack", "axolotl"], "stack axolotl: not offered"),
        (["--stack", "trl", "--loss", "chunked"], "loss: stack trl has no such switch"),
        (["--stack", "litgpt", "--kbit-prep"], "kbit_prep: stack litgpt does not build its adapters with peft"),
        (["--stack", "litgpt", "--no-fp32-adapters"], "fp32_adapters: stack litgpt does not build its adapters"),
        (["--method", "lora", "--kbit-prep"], "kbit_prep prepares a quantised base"),
        (["--stack", "trl", "--exact"], "--exact traces lorafit's own training step"),
        (["--autocast", "maybe"], ""),
    ],
)
def test_a_stack_it_cannot_run_is_refused_in_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(["estimate", "--model", "llama-2-7b", "--gpu", "RTX 4090", *args], capsys)
    assert code == 2 and out == ""
    assert err.startswith("lorafit: error: ") and err.count("\n") == 1, err
    assert message in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("name: my run\nnotes: nothing a trainer reads\n", "cannot tell which trainer this config is for"),
        ("base_model: [unclosed\n", "config.yaml"),
        ("- just\n- a list\n", "config.yaml"),
        ("base_model: NousResearch/Meta-Llama-3-8B\nadapter: lora\nmicro_batch_size: many\n", "micro_batch"),
        (None, "config.yaml"),  # no such file
    ],
)
@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_a_config_file_that_cannot_be_used_is_refused_in_one_line(
    command: str, content: str | None, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.yaml"
    if content is not None:
        path.write_text(content)
    code, out, err = run([command, "--from", str(path), "--gpu", "RTX 4090"], capsys)
    assert code == 2 and out == ""
    assert err.startswith("lorafit: error: ") and err.count("\n") == 1, err
    assert message in err


def test_a_torchtune_config_is_refused_while_its_stack_is_not_offered(capsys: pytest.CaptureFixture[str]) -> None:
    path = CONFIGS / "torchtune_llama2_7b_qlora_single_device.yaml"
    code, _, err = run(["plan", "--from", str(path), "--gpu", "RTX 4090"], capsys)
    assert code == 2 and "stack torchtune: not offered" in err and err.count("\n") == 1


# --- Ctrl-C, for every command ----------------------------------------------------------------------------------
def test_ctrl_c_in_any_command_is_one_line_and_exit_130(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lorafit import answers

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(answers, "plan", interrupted)
    code, out, err = run(["plan", "--model", "llama-2-7b"], capsys)
    assert (code, out, err) == (130, "", "lorafit: interrupted\n")


def test_sigint_while_a_command_runs_is_one_line_and_exit_130() -> None:
    """The real signal, sent once the command is running (it waits in place of planning)."""
    import os
    import signal

    script = (
        "import signal, time\n"
        "from lorafit import answers, cli\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even started in the background\n"
        "def wait(*args, **kwargs):\n"
        "    print('running', flush=True)\n"
        "    time.sleep(60)\n"
        "answers.plan = wait\n"
        "cli.main(['plan', '--model', 'llama-2-7b'])\n"
    )
    environment = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}  # this lorafit, wherever it is installed
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment
    )
    assert process.stdout is not None and process.stdout.readline() == "running\n"
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert (process.returncode, out, err) == (130, "", "lorafit: interrupted\n")


# --- init: a regular file or nothing ----------------------------------------------------------------------------
def test_init_force_never_replaces_a_pipe_or_a_symlink(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import os
    import stat

    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    code, _, err = run(["init", str(fifo), "--force"], capsys)
    assert (
        code == 2 and err == f"lorafit: error: {fifo} is not a regular file (a device, pipe or socket); name a file\n"
    )
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    mine = tmp_path / "mine.yaml"
    mine.write_text("model: mine\n")
    for name, points_to in (("link", mine), ("dangling", tmp_path / "gone.yaml"), ("loop", None)):
        link = tmp_path / f"{name}.yaml"
        link.symlink_to(points_to or link)
        code, _, err = run(["init", str(link), "--force"], capsys)
        assert code == 2 and err == f"lorafit: error: {link} is a symbolic link; name the file itself, or a new name\n"
        assert os.readlink(link) == str(points_to or link)
    assert mine.read_text() == "model: mine\n" and not (tmp_path / "gone.yaml").exists()


def test_init_force_never_replaces_a_device_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As root, `init /dev/null --force` once replaced /dev/null; a node made in a temporary folder stands in."""
    import os
    import stat

    node = tmp_path / "null"
    try:
        os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, AttributeError):
        pytest.skip("making a device node needs root (and a system that allows it)")
    code, _, err = run(["init", str(node), "--force"], capsys)
    assert code == 2 and "is not a regular file" in err and err.count("\n") == 1
    assert stat.S_ISCHR(os.lstat(node).st_mode)


def test_init_writes_any_legal_name_and_refuses_a_longer_one_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    longest = tmp_path / ("c" * 250 + ".yaml")
    code, out, err = run(["init", str(longest)], capsys)
    assert code == 0 and "wrote" in out, err
    for too_long in (tmp_path / ("c" * 251 + ".yaml"), tmp_path / ("d" * 300) / "lorafit.yaml"):
        code, out, err = run(["init", str(too_long)], capsys)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in out + err
        assert err.startswith(f"lorafit: error: {too_long} has a name of ")
        assert err.endswith("a file or folder name may have at most 255\n")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_init_where_no_file_can_be_made_is_cannot_write(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["init", "/proc/lorafit.yaml", "--force"], capsys)
    assert code == 2 and err.startswith("lorafit: error: cannot write /proc/lorafit.yaml: ") and err.count("\n") == 1
