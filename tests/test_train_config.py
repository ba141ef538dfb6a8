"""The `lorafit train` config file and `lorafit init`: validated with one-line errors, flags = keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import run_cli
from lorafit import options
from lorafit.errors import InvalidConfig
from lorafit.train.config import SETTINGS_KEYS, TrainConfig, load_config, starter_config


def test_init_writes_a_commented_config_that_loads_as_the_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.yaml"
    code, out, _ = run_cli(["init", str(path)], capsys)
    assert code == 0 and "lorafit train" in out
    text = path.read_text()
    assert text.count("#") > 40  # every key is explained
    assert load_config(path, {}) == TrainConfig()
    keys = set(yaml.safe_load(text))
    assert keys == set(TrainConfig.model_fields)  # no key missing from the starter, none made up


def test_init_does_not_replace_a_file_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("model: mine\n")
    code, _, err = run_cli(["init", str(path)], capsys)
    assert code == 2 and "--force" in err
    assert path.read_text() == "model: mine\n"
    code, _, _ = run_cli(["init", str(path), "--force"], capsys)
    assert code == 0 and path.read_text() == starter_config("mine.yaml")


def test_every_config_key_is_a_flag_and_every_flag_but_the_switches_a_key() -> None:
    import typer

    from lorafit.cli import _register_subcommands, app

    _register_subcommands()
    train = typer.main.get_command(app).commands["train"]  # type: ignore[attr-defined]
    flags = {param.name: param.opts for param in train.params if param.opts[0].startswith("--")}
    switches = {o.name for o in options.OPTIONS if not o.config and "train" in o.commands}
    assert set(flags) == set(TrainConfig.model_fields) | switches
    for key, spellings in flags.items():
        assert "--" + key.replace("_", "-") in spellings
    assert set(SETTINGS_KEYS) <= set(TrainConfig.model_fields)  # every Settings field a single device has


def test_flags_win_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("lora_r: 8\nlearning_rate: 0.001\n")
    config = load_config(path, {"lora_r": 32, "seed": None})
    assert (config.lora_r, config.learning_rate, config.seed) == (32, 0.001, 42)
    pinned = config.pinned_settings()
    assert pinned["lora_r"] == 32
    assert not {"micro_batch", "grad_accum", "grad_ckpt", "optimizer", "seq_len"} & set(pinned)  # the plan's


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lora_rank: 8\n", "unknown key 'lora_rank'; did you mean lora_r?"),
        ("lora_r: -1\n", "bad.yaml: lora_r -1: must be greater than 0"),
        ("method: qlorra\n", "bad.yaml: method qlorra: must be one of qlora, lora, full"),
        ("method: lora\nquant: int8\n", "method lora trains on 16-bit weights: quant must be none"),
        ("micro_batch: 3\n", "micro_batch 3 does not divide batch_size 16"),
        ("eval_split: 2.5\n", "eval_split 2.5: a share below 1 or a whole number of rows"),
        ("output_dir: ''\n", "output_dir '': must not be empty"),
        ("lora_alpha: 0\n", "lora_alpha 0: must be greater than 0"),
        ("learning_rate: .nan\n", "learning_rate nan: must be a finite number"),
        ("method: qlora\nquant: none\n", "qlora needs a quantised base"),
        ("eval_data: x.jsonl\neval_split: 0.1\n", "give eval_data or eval_split, not both"),
        ("seed: 1\nmodel: a: b\n", "line 2: not valid YAML"),
        ("- a list\n", "must hold a mapping"),
    ],
)
def test_a_bad_config_is_one_line_naming_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(InvalidConfig) as error:
        load_config(path, {})
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_a_bad_config_exits_2_from_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("lora_rank: 8\n")
    code, _, err = run_cli(["train", str(path)], capsys)
    assert code == 2 and err.count("\n") == 1 and "did you mean lora_r" in err
    code, _, err = run_cli(["train", str(tmp_path / "missing.yaml")], capsys)
    assert code == 2 and "lorafit init" in err


# files that ended in a RecursionError, a ValueError or exhausted memory; each is refused at the line it is at
HOSTILE = {
    "deep.yaml": ("seed: " + "[" * 20_000 + "]" * 20_000 + "\n", "line 1: not valid YAML (nested more than 100 deep)"),
    "deep.json": ('{"seed": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested more than 100 deep"),
    "alias.yaml": ("seed: 1\ndata_mapping: &m {a: *m}\n", "line 2: not valid YAML (the alias *m is inside its own"),
    "long.yaml": ("seed: " + "9" * 5000 + "\n", "a number of 5000 digits"),
    "laughs.yaml": (
        'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
        + "".join(f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True)),
        "values once aliases expand",
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_config_is_one_line_from_train_dry_run(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text, message = HOSTILE[name]
    path = tmp_path / name
    path.write_text(text)
    code, out, err = run_cli(["train", str(path), "--dry-run"], capsys)
    assert (code, out, err.count("\n")) == (2, "", 1) and message in err and str(path) in err, err


@pytest.mark.parametrize("name", ["deep.json", "long.yaml", "laughs.yaml"])
def test_a_hostile_plan_file_is_one_line(tmp_path: Path, name: str) -> None:
    from lorafit.schema import Plan

    text, message = HOSTILE[name]
    path = tmp_path / name
    path.write_text(text.replace('"seed"', '"schema_version"').replace("seed:", "schema_version:"))
    with pytest.raises(InvalidConfig) as refused:
        Plan.load(path)
    assert message in str(refused.value) and str(path) in str(refused.value) and "\n" not in str(refused.value)


def test_a_plan_is_a_config_with_every_setting_pinned(tmp_path: Path) -> None:
    from lorafit import hardware
    from lorafit.models import catalog
    from lorafit.plan import make_plan
    from lorafit.schema import PlanRequest

    plan = make_plan(
        PlanRequest(model=catalog()["llama-3.1-8b"], gpu=hardware.resolve("RTX 4090"), batch_size=32, epochs=2)
    )
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    config = load_config(path, {"model": "some/dir"})
    settings = plan.settings.model_dump()
    assert config.pinned_settings() == {key: settings[key] for key in SETTINGS_KEYS}
    assert (config.method, config.batch_size, config.epochs, config.model) == (plan.settings.method, 32, 2, "some/dir")


def test_an_eval_file_alone_replaces_the_held_out_share(tmp_path: Path) -> None:
    """eval_split has a default (0.05); only both given are two sources of eval rows."""
    for flags, path_text in (({"eval_data": "held.jsonl"}, ""), ({}, "eval_data: held.jsonl\n")):
        path = tmp_path / "run.yaml"
        path.write_text(path_text)
        config = load_config(path, flags)
        assert (config.eval_data, config.eval_split) == ("held.jsonl", 0)
    with pytest.raises(InvalidConfig, match="give eval_data or eval_split, not both"):
        load_config(None, {"eval_data": "held.jsonl", "eval_split": 0.1})


@pytest.mark.parametrize(
    ("holds", "advice"),
    [
        ("config.yaml", "to train its run again pass {dir}/config.yaml"),
        ("config.json", "to train this model pass --model {dir}"),
        ("notes.txt", "`lorafit init {dir}/lorafit.yaml` writes a starter config"),
    ],
)
def test_a_folder_given_as_the_config_gets_the_command_that_takes_it(
    holds: str, advice: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "thing"
    folder.mkdir()
    (folder / holds).write_text("{}")
    code, _, err = run_cli(["train", str(folder)], capsys)
    assert code == 2 and err.count("\n") == 1
    assert f"{folder} is a folder, not a config file" in err and advice.format(dir=folder) in err
    assert f"lorafit init {folder};" not in err  # init refuses a folder
