"""`lorafit plan --stack all`: the plan for the default stack, and the same job under every offered stack, each row
as `lorafit plan --stack NAME` plans it alone."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.testclient import TestClient

from conftest import run_cli
from lorafit import web

# README's 8 GB answer: Llama-3.1-8B QLoRA fits, tightly, with lorafit's own trainer and with no other stack
EIGHT_GB = ["plan", "--model", "llama-3.1-8b", "--vram", "8", "--method", "qlora"]


def as_json(args: list[str], capsys: pytest.CaptureFixture[str]) -> Any:
    code, out, err = run_cli([*args, "--json"], capsys)
    assert code == 0, err
    return json.loads(out)


def offered(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [stack["name"] for stack in as_json(["stacks"], capsys) if stack["offered"]]


def test_each_row_is_the_plan_of_that_stack_alone(capsys: pytest.CaptureFixture[str]) -> None:
    together = as_json([*EIGHT_GB, "--stack", "all"], capsys)
    rows = {row["stack"]: row for row in together["stacks"]}
    assert list(rows) == offered(capsys)  # one row per offered stack, in the catalog's order
    for name, row in rows.items():
        alone = as_json([*EIGHT_GB, "--stack", name], capsys)
        assert row["settings"] == alone["settings"], name
        assert row["peak_device_gib"] == alone["estimate"]["peak_device_gib"], name
        assert row["verdict"] == alone["verdict"] and row["fits"] == alone["estimate"]["fits"], name
        if alone["verdict"] == "no":
            assert row["tokens_per_s"] is None and row["hours"] is None
            assert row["smallest_change"]["change"] == alone["suggestions"][0]["change"]
        else:
            assert (row["tokens_per_s"], row["hours"]) == (alone["tokens_per_s"], alone["hours"]), name
    # the plan itself is the default stack's, as plan without --stack makes it
    default = as_json(EIGHT_GB, capsys)
    assert {key: value for key, value in together.items() if key != "stacks"} == default
    # and the rows say what the plan's trainers line says of each other stack
    assert {t["stack"]: t["peak_device_gib"] for t in default["trainers"]} == {
        name: row["peak_device_gib"] for name, row in rows.items() if name != "lorafit"
    }


def test_on_8_gb_the_stacks_disagree_and_the_table_says_which_fit(capsys: pytest.CaptureFixture[str]) -> None:
    rows = as_json([*EIGHT_GB, "--stack", "all"], capsys)["stacks"]
    verdicts = {row["stack"]: row["verdict"] for row in rows}
    assert verdicts["lorafit"] in ("fits", "tight") and verdicts["trl"] == "no"
    code, out, _ = run_cli([*EIGHT_GB, "--stack", "all"], capsys)
    assert code == 0 and "the same job under each stack" in out
    table = out[out.index("the same job under each stack") :]
    for row in rows:  # one line opens each stack's row: its name, its peak and its verdict
        line = next(line for line in table.splitlines() if line.startswith(f"│ {row['stack']} "))
        assert f" {row['peak_device_gib']:.2f} " in line and f" {row['verdict']} " in line
    assert table.count("does not fit at these settings") == sum(row["verdict"] == "no" for row in rows)
    assert "  - trl: does not fit at these settings" in table


def test_a_stack_that_cannot_run_the_job_says_why_in_its_row(capsys: pytest.CaptureFixture[str]) -> None:
    job = ["plan", "--model", "llama-3.1-8b", "--gpu", "RTX 4090", "--method", "qlora", "--quant", "int8"]
    rows = {row["stack"]: row for row in as_json([*job, "--stack", "all"], capsys)["stacks"]}
    code, _, err = run_cli([*job, "--stack", "unsloth"], capsys)
    assert code == 2
    assert rows["unsloth"]["verdict"] == "refused" and rows["unsloth"]["peak_device_gib"] is None
    assert err.strip() == f"lorafit: error: {rows['unsloth']['refused']}"
    assert rows["trl"]["verdict"] in ("fits", "tight")  # the others run it


def test_the_stacks_own_search_shows_in_what_it_chose_otherwise(capsys: pytest.CaptureFixture[str]) -> None:
    job = ["plan", "--model", "llama-3.1-8b", "--gpu", "RTX 4090", "--method", "qlora"]
    together = as_json([*job, "--stack", "all"], capsys)
    facets = {"stack", "autocast", "kbit_prep", "fused_optimizer", "torch_compile", "liger"}
    for row in together["stacks"][1:]:
        for name, value in row["settings"].items():
            if name in row["changes"]:
                assert row["changes"][name] == value != together["settings"][name]
            elif name not in facets and name not in row["lacks_savers"]:
                assert value == together["settings"][name], (row["stack"], name)
    unsloth = next(row for row in together["stacks"] if row["stack"] == "unsloth")
    assert unsloth["changes"].get("lora_dropout") == 0.0  # Unsloth's own default
    _, out, _ = run_cli([*job, "--stack", "all"], capsys)
    assert "--lora-dropout 0.0" in out


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["plan", "--stack", "all", "--liger"], "--liger is a switch of one stack's step"),
        (["plan", "--stack", "all", "--no-autocast"], "--autocast is a switch of one stack's step"),
        (["plan", "--stack", "all", "--compare"], "--compare compares the GPUs for one stack"),
        (["plan", "--stack", "all", "--from", "run.yaml"], "--from reads one trainer's config"),
        (["train", "--stack", "all"], "lorafit train runs its own trainer"),
    ],
)
def test_stack_all_with_what_needs_one_stack_is_refused_in_one_line(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli([*args, "--model", "llama-3.1-8b"], capsys)
    assert code == 2 and out == ""
    assert err.startswith("lorafit: error: ") and says in err and err.count("\n") == 1


def test_plan_help_offers_all(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["plan", "--help"], capsys)
    assert code == 0 and "|unsloth|all" in out and "every offered stack" in " ".join(out.split())


def test_lorafit_stacks_points_to_the_comparison_for_one_job(capsys: pytest.CaptureFixture[str]) -> None:
    for args in (["stacks"], ["stacks", "--help"]):
        code, out, _ = run_cli(args, capsys)
        assert code == 0 and "plan --model MODEL --gpu GPU --stack all" in " ".join(out.split())
    assert isinstance(as_json(["stacks"], capsys), list)  # the JSON stays the catalog, for programs


# --- the page: /api/plan serves the same rows ---------------------------------------------------------------------
SERVED_AT = "http://127.0.0.1:8765"  # as `lorafit serve` listens by default
EIGHT_GB_QUERY = {"model": "llama-3.1-8b", "vram": "8", "method": "qlora"}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    return TestClient(web.create_app(tmp_path_factory.mktemp("uploads")), base_url=SERVED_AT)


def test_the_api_serves_stack_all_as_the_cli_prints_it(client: TestClient, capsys: pytest.CaptureFixture[str]) -> None:
    response = client.get("/api/plan", params=EIGHT_GB_QUERY | {"stack": "all"})
    assert response.status_code == 200, response.text
    assert response.json() == as_json([*EIGHT_GB, "--stack", "all"], capsys)


def test_the_page_table_of_trainers_is_each_stack_planned_alone(client: TestClient) -> None:
    """The page's table of trainers: the plan's own stack and its `trainers`, each the peak and the fit that
    /api/plan with that stack pinned answers."""
    plan = client.get("/api/plan", params=EIGHT_GB_QUERY).json()
    table = {plan["settings"]["stack"]: (plan["estimate"]["peak_device_gib"], plan["estimate"]["fits"])}
    table |= {row["stack"]: (row["peak_device_gib"], row["fits"]) for row in plan["trainers"]}
    for stack, (peak, fits) in table.items():
        alone = client.get("/api/plan", params=EIGHT_GB_QUERY | {"stack": stack}).json()
        assert (alone["estimate"]["peak_device_gib"], alone["estimate"]["fits"]) == (peak, fits), stack
    assert [name for name, (_, fits) in table.items() if fits] == ["lorafit"]


def test_a_run_takes_one_stack(client: TestClient) -> None:
    response = client.get("/api/run", params=EIGHT_GB_QUERY | {"stack": "all"})
    assert response.status_code == 400 and "stack" in response.json()["error"]


def test_several_gpus_are_suggested_only_with_a_shard_the_stack_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """Unsloth runs several GPUs only under DDP (each holds the whole step), so a plan that does not fit one
    card suggests no FSDP or ZeRO split of it; lorafit's trainer, on the same job, does suggest one."""
    job = ["plan", "--model", "qwen3-32b", "--gpu", "T4", "--method", "qlora"]
    unsloth = as_json([*job, "--stack", "unsloth"], capsys)
    own = as_json([*job, "--stack", "lorafit"], capsys)
    assert {s["settings"]["shard"] for s in unsloth["suggestions"]} <= {"none", "ddp"}
    assert any(s["settings"]["n_gpus"] > 1 and s["settings"]["shard"] != "ddp" for s in own["suggestions"])
