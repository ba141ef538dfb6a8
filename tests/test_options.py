"""One declaration of every setting (lorafit.options): each reaches every surface it names, and a combination is
accepted or refused the same way, with the same one-line message, from flags and from a YAML file."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Annotated, get_type_hints

import pytest
import typer
import yaml
from pydantic import Field

from conftest import refused, run_cli
from lorafit import hardware, models, options, schema
from lorafit.errors import InvalidConfig
from lorafit.options import OPTIONS, About, Settings, TrainConfig


def click_commands() -> dict[str, object]:
    from lorafit.cli import _register_subcommands, app

    _register_subcommands()
    return typer.main.get_command(app).commands  # type: ignore[attr-defined]


# --- every setting reaches each surface -----------------------------------------------------------------------
def test_every_option_is_a_flag_of_each_of_its_commands_and_only_of_those() -> None:
    commands = click_commands()
    for command in ("estimate", "plan", "train", "chat", "gpus", "models", "detect"):
        params = {p.name: p for p in commands[command].params if p.opts[0].startswith("-")}  # type: ignore[attr-defined]
        declared = {o.name: o for o in OPTIONS if command in o.commands}
        assert set(params) == set(declared), command
        for name, option in declared.items():
            assert option.flag in params[name].opts, (command, name)
            assert set(option.flags) <= set(params[name].opts), (command, name)
            if option.is_bool and option.config:
                assert params[name].secondary_opts, (command, name)  # --x / --no-x


def test_every_train_option_is_a_key_of_the_config_and_of_the_starter_file() -> None:
    keys = {o.name for o in OPTIONS if "train" in o.commands and o.config}
    assert set(TrainConfig.model_fields) == keys
    starter = yaml.safe_load(options.starter_yaml("run.yaml"))
    assert set(starter) == keys
    assert TrainConfig.model_validate(starter) == TrainConfig()  # the starter holds the defaults


def test_every_step_option_is_a_field_of_settings_with_its_default() -> None:
    step = [o for o in OPTIONS if o.step]
    assert list(Settings.model_fields) == [o.name for o in step]
    defaults = Settings()
    for option in step:
        if option.default is not None:
            assert getattr(defaults, option.name) == option.default, option.name


def test_the_step_settings_are_a_class_written_out_field_by_field() -> None:
    """Settings is a class in the source, each setting a typed field that a reader and a type checker see."""
    source = inspect.getsource(Settings)
    hints = get_type_hints(Settings)
    for option in (o for o in OPTIONS if o.step):
        assert f"    {option.name}: Annotated[" in source, option.name
        assert hints[option.name] in (option.type, option.type | None), option.name
    assert "create_model" not in source


def test_the_plan_request_holds_its_settings_as_typed_fields_from_the_declaration() -> None:
    source = inspect.getsource(schema.PlanRequest)
    for name in schema.PLAN_REQUEST_KEYS:
        option = options.BY_NAME[name]
        annotation, field = option.field_info(optional=options.not_set_is_none(option))
        assert f"    {name}: " in source, name
        assert schema.PlanRequest.model_fields[name].annotation == annotation, name
        assert schema.PlanRequest.model_fields[name].default == field.default, name
    with pytest.raises(ValueError, match="less than or equal to 10000"):
        schema.PlanRequest(model=models.resolve("llama-2-7b"), epochs=20000)  # the declared bound holds here too


def test_the_step_settings_a_request_fixes_are_one_typed_settings() -> None:
    spec = models.resolve("llama-2-7b")
    request = schema.PlanRequest(model=spec, fixed={"method": "lora", "micro_batch": 4, "n_gpus": 2})
    assert set(schema.PlanRequest.model_fields) & set(options.STEP_KEYS) == set()  # no step setting beside `fixed`
    assert isinstance(request.fixed, Settings) and request.fixed.model_fields_set == {"method", "micro_batch", "n_gpus"}
    assert (request.method, request.n_gpus, request.seq_len) == ("lora", 2, None)  # seq_len: the planner's
    assert schema.PlanRequest.model_validate_json(request.model_dump_json()) == request  # what was fixed survives
    with pytest.raises(ValueError, match="greater than 0"):
        schema.PlanRequest(model=spec, fixed={"micro_batch": 0})
    with pytest.raises(ValueError, match="micro_btch is not a step setting"):
        schema.PlanRequest(model=spec, fixed={"micro_btch": 4})


class Extra:
    """A setting declared the way the table's are, for the tests below."""

    warmup_steps: Annotated[
        int | None, Field(gt=0, le=1000), About("steps spent warming up", ("plan",), "schedule", unit="steps")
    ] = None


def test_a_declared_field_is_a_table_row_with_its_bounds_and_help() -> None:
    (row,) = options.option_rows(Extra)
    assert (row.name, row.type, row.default, row.gt, row.le) == ("warmup_steps", int, None, 0, 1000)
    assert (
        row.flag == "--warmup-steps"
        and row.commands == ("plan",)
        and row.help_text() == "steps spent warming up, in steps"
    )


def test_a_field_added_to_the_declaration_is_a_flag_a_form_row_and_validated(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = OPTIONS + options.option_rows(Extra)
    monkeypatch.setattr(options, "OPTIONS", rows)
    monkeypatch.setattr(options, "BY_NAME", {row.name: row for row in rows})
    options.command_model.cache_clear()
    try:
        assert "warmup_steps" in {row["name"] for row in options.as_dicts()}
        assert options.validate("plan", {"warmup_steps": 10}).warmup_steps == 10
        with pytest.raises(InvalidConfig, match="warmup_steps 0: must be greater than 0"):
            options.validate("plan", {"warmup_steps": 0})
        from lorafit import cli

        @cli.derived_options("plan")
        def command(**values: object) -> None: ...

        assert "warmup_steps" in inspect.signature(command).parameters
    finally:
        options.command_model.cache_clear()


def test_the_declaration_is_plain_data_for_a_form() -> None:
    rows = options.as_dicts()
    assert json.loads(json.dumps(rows)) == rows
    by_name = {row["name"]: row for row in rows}
    assert by_name["method"]["choices"] == ["qlora", "lora", "full"]
    assert by_name["lora_r"]["bounds"] == {"gt": 0, "le": 4096}
    assert by_name["vram"]["unit"] == "GB as sold"


def test_help_names_every_choice_and_default(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["estimate", "--help"], capsys)
    assert code == 0
    assert "qlora|lora|full" in out and "[default: 16]" in out and "2 x lora_r" in out


# --- the same refusal everywhere --------------------------------------------------------------------------------
# (flags, the same as YAML, the problem both must name)
REFUSED = [
    (["--lora-r", "-1"], {"lora_r": -1}, "-1: must be greater than 0"),
    (["--lora-alpha", "0"], {"lora_alpha": 0}, "0: must be greater than 0"),
    (["--method", "qlorra"], {"method": "qlorra"}, "qlorra: must be one of qlora, lora, full"),
    (["--method", "lora", "--quant", "int8"], {"method": "lora", "quant": "int8"}, "quant must be none"),
    (["--method", "qlora", "--quant", "none"], {"method": "qlora", "quant": "none"}, "needs a quantised base"),
    (["--lora-dropout", "1"], {"lora_dropout": 1}, "1: must be less than 1"),
    (["--headroom", "nan"], {"headroom": float("nan")}, "nan: must be a finite number"),
    (["--seq-len", "abc"], {"seq_len": "abc"}, "abc: must be a whole number"),
    (["--optimizer", "lion"], {"optimizer": "lion"}, "must be one of adamw, adamw_8bit"),
]


@pytest.mark.parametrize(("flags", "keys", "problem"), REFUSED)
def test_a_refused_value_gets_the_same_message_from_flags_and_yaml(
    flags: list[str], keys: dict[str, object], problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def problem_of(err: str, source: str = "") -> str:
        """The message less the setting's spelling (--lora-r / lora_r) and the file it came from."""
        message = err.strip().removeprefix("lorafit: error: ").removeprefix(source)
        first, rest = message.split(" ", 1)
        return rest if first.startswith("--") or first in keys else message

    seen = set()
    for command in (["estimate"], ["plan", "--gpu", "RTX 4090"], ["train"]):
        err = refused([*command, *flags], capsys)
        assert problem in err, (command, err)
        seen.add(problem_of(err))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(keys))
    code, out, err = run_cli(["train", str(config)], capsys)
    assert code == 2 and err.count("\n") == 1 and problem in err, err
    assert f"{config}: " in err  # a key from a file is named with the file
    seen.add(problem_of(err, f"{config}: "))
    assert len(seen) == 1, seen  # the same problem from every surface


def test_a_rule_over_several_settings_is_the_same_one_line_everywhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    message = "micro_batch 3 does not divide batch_size 16: use micro_batch 1, 2, 4, 8, 16, or another batch_size"
    config = tmp_path / "run.yaml"
    config.write_text("micro_batch: 3\nbatch_size: 16\n")
    for args in (
        ["plan", "--gpu", "RTX 4090", "--micro-batch", "3"],
        ["train", "--micro-batch", "3"],
        ["train", str(config)],
    ):
        code, _, err = run_cli(args, capsys)
        assert code == 2 and message in err and err.count("\n") == 1, (args, err)


def test_lora_over_an_int8_base_is_refused_by_every_model() -> None:
    for build in (lambda: Settings(method="lora", quant="int8"), lambda: TrainConfig(method="lora", quant="int8")):
        with pytest.raises(ValueError, match="quant must be none"):
            build()
    assert Settings(method="qlora", quant="int8").quant == "int8"


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"batch_size": 16, "micro_batch": 3}, "micro_batch 3 does not divide batch_size 16"),
        ({"batch_size": 16, "micro_batch": 2, "grad_accum": 4}, "is 8, not batch_size 16"),
        ({"batch_size": 16, "n_gpus": 3}, "n_gpus 3 does not divide batch_size 16"),
        ({"batch_size": 16, "n_gpus": 2, "micro_batch": 3}, "micro_batch 3 does not divide batch_size 16 over 2"),
        ({"n_gpus": 1, "shard": "zero3"}, "shard zero3 needs n_gpus > 1"),
    ],
)
def test_batch_rules(values: dict[str, int | str], problem: str) -> None:
    with pytest.raises(InvalidConfig, match=problem):
        options.validate("plan", values)


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--attn", "flash", "--precision", "fp32"], "attn flash: flash attention has no fp32 kernel; use precision"),
        (["--fused-optimizer", "--optimizer", "sgd"], "optimizer sgd has none"),
    ],
)
def test_settings_no_kernel_runs_together_are_refused_everywhere(
    flags: list[str], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for command in (["estimate"], ["plan", "--gpu", "RTX 4090"]):
        err = refused([*command, *flags], capsys)
        assert problem in err, (command, err)
    for command in (["estimate"], ["plan", "--gpu", "RTX 4090"]):  # each alone is fine
        for alone in (flags[:-2], flags[-2:]):
            code, _, err = run_cli([*command, *alone], capsys)
            assert code == 0, (command, alone, err)


def test_flash_attention_and_fp32_are_refused_in_a_train_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("attn: flash\nprecision: fp32\n")
    code, _, err = run_cli(["train", str(config)], capsys)
    assert code == 2 and err.count("\n") == 1 and f"{config}: attn flash: flash attention has no fp32" in err, err


def test_flash_attention_is_refused_on_the_cpu() -> None:
    """Training on the CPU runs in fp32, which flash attention has no kernel for."""
    with pytest.raises(InvalidConfig, match="attn flash: flash attention runs on CUDA GPUs only"):
        options.check_against({"attn": "flash"}, on_cpu=True)
    options.check_against({"attn": "flash"})


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (
            ["plan", "--gpu", "RTX 4090", "--tokens", str(10**20)],
            f"--tokens-per-epoch {10**20}: must be at most 10000000000000",
        ),
        (["train", "--max-steps", "99999999999"], "--max-steps 99999999999: must be at most 1000000000"),
    ],
)
def test_a_job_beyond_any_real_one_is_refused_in_one_line(
    args: list[str], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(args, capsys)
    assert code == 2 and out == "" and err == f"lorafit: error: {problem}\n"


def test_the_effective_batch_is_the_product_when_only_micro_batch_and_accumulation_are_set() -> None:
    config = TrainConfig(micro_batch=2, grad_accum=4)
    assert config.effective_batch_size == 8
    assert TrainConfig().effective_batch_size == 16


# --- defaults that follow from other settings, the model and the GPU -----------------------------------------
def test_defaults_that_follow_from_other_settings() -> None:
    assert Settings(lora_r=8).lora_alpha == 16  # alpha = 2 r unless set
    assert Settings(lora_r=8, lora_alpha=8).lora_alpha == 8
    assert Settings(method="full").quant == "none" and Settings(method="lora").quant == "none"
    assert Settings().quant == "nf4"


def test_defaults_that_follow_from_the_model_and_the_gpu() -> None:
    gemma = models.resolve("gemma-2-9b")
    t4 = hardware.resolve("T4")
    assert options.settings_from({}, gemma).attn == "eager"
    assert options.settings_from({}, models.resolve("llama-2-7b"), t4).precision == "fp16"
    assert options.settings_from({}, models.resolve("llama-2-7b"), on_cpu=True).precision == "fp32"
    with pytest.raises(InvalidConfig, match="the T4 has no bf16; use precision fp16"):
        options.settings_from({"precision": "bf16"}, models.resolve("llama-2-7b"), t4)
    with pytest.raises(InvalidConfig, match="has no sdpa attention"):
        options.settings_from({"attn": "sdpa"}, gemma)


def test_estimate_and_plan_choose_gemma2s_kernel_the_same_way(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["estimate", "--model", "gemma-2-9b", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["settings"]["attn"] == "eager"
    code, out, err = run_cli(["plan", "--model", "gemma-2-9b", "--gpu", "RTX 4090", "--json"], capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["settings"]["attn"] == "eager"
    assert any("attention eager" in reason for reason in plan["reasons"])


def test_a_t4_plans_in_fp16_and_refuses_bf16(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["plan", "--model", "llama-3.2-1b", "--gpu", "T4", "--json"], capsys)
    assert code == 0 and json.loads(out)["settings"]["precision"] == "fp16"
    code, _, err = run_cli(["plan", "--model", "llama-3.2-1b", "--gpu", "T4", "--precision", "bf16"], capsys)
    assert code == 2 and "the T4 has no bf16" in err
