"""`lorafit data check` and `lorafit data convert` as a user runs them: output, files and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lorafit.cli import _register_subcommands, app, main

GOOD = {"instruction": "Name a colour", "input": "", "output": "Blue"}


@pytest.fixture(scope="module", autouse=True)
def registered() -> None:
    _register_subcommands()


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as raised:
        main(args)
    out, err = capsys.readouterr()
    return raised.value.code or 0, out, err


def test_clean_data_exits_0_with_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [{**GOOD, "output": f"Blue {i}"} for i in range(3)])
    code, out, _ = run_main(["data", "check", str(path)], capsys)
    assert code == 0
    assert "format alpaca (detected), 3 rows, 3 valid, 0 rejected" in out
    assert "Tokens per row (estimated from characters" in out
    assert "suggested --seq-len 64 (p99" in out and "multiple of 64" in out
    assert "Length histogram" in out


def test_warnings_exit_0_or_1_with_strict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [GOOD, GOOD])
    assert run_main(["data", "check", str(path)], capsys)[0] == 0
    code, out, _ = run_main(["data", "check", str(path), "--strict"], capsys)
    assert code == 1 and "duplicate of row 0" in out


def test_errors_print_the_report_then_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [GOOD, "{nope", {"instruction": "x", "output": ""}])
    code, out, _ = run_main(["data", "check", str(path)], capsys)
    assert code == 2
    assert "invalid JSON" in out and "empty 'output'" in out
    assert "Tokens per row" in out  # the valid row is still profiled


def test_json_output_and_full_report_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [GOOD] + ["{broken"] * 30
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    report_file = tmp_path / "reports" / "check.json"
    code, out, _ = run_main(["data", "check", str(path), "--json", "--report", str(report_file)], capsys)
    data = json.loads(out)
    assert code == 2
    assert (data["format"], data["rows"], data["valid_rows"]) == ("alpaca", 31, 1)
    assert len(data["problems"]) == 30
    assert data["problems"][0] == {
        "message": data["problems"][0]["message"],
        "severity": "error",
        "file": str(path),
        "line": 2,
        "row": 1,
        "field": None,
    }
    assert json.loads(report_file.read_text()) == data


def test_the_table_shows_20_problems_and_says_where_the_rest_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [GOOD] + ["{broken"] * 30)
    _, out, _ = run_main(["data", "check", str(path)], capsys)
    assert out.count("invalid JSON") == 20
    assert "... and 10 more problems (all of them: --json or --report FILE)" in out


def test_seq_len_format_and_map_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [{"q": "Say hi " * 40, "a": "hi"}, {"q": "Short?", "a": "Yes"}])
    args = ["data", "check", str(path), "--format", "alpaca", "--map", "instruction=q", "--map", "output=a"]
    code, out, _ = run_main([*args, "--seq-len", "32", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["format"] == "alpaca" and data["valid_rows"] == 2
    assert data["truncated_rows"] == 1
    assert [p["row"] for p in data["problems"]] == [0] and "would be truncated" in data["problems"][0]["message"]


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [{**GOOD, "output": "Blue " * i} for i in range(1, 30)])
    png = tmp_path / "lengths.png"
    code, out, _ = run_main(["data", "check", str(path), "--plot", str(png)], capsys)
    assert code == 0 and f"histogram written to {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_is_one_line_on_stderr_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for args in (
        ["data", "check", str(tmp_path / "missing.jsonl")],
        ["data", "check", str(write_jsonl(tmp_path / "a.jsonl", [{"question": "q"}]))],
        ["data", "check", str(tmp_path / "a.jsonl"), "--format", "chatml"],
        ["data", "check", str(tmp_path / "a.jsonl"), "--map", "nonsense"],
        ["data", "check", str(tmp_path / "a.jsonl"), "--tokenizer", "no-such-thing"],
    ):
        code, out, err = run_main(args, capsys)
        assert code == 2, args
        assert err.startswith("lorafit: error: ") and err.count("\n") == 1, err
        assert "Traceback" not in out + err


def test_convert_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [GOOD, {"instruction": "", "output": "x"}])
    out_file = tmp_path / "out.jsonl"
    code, out, _ = run_main(["data", "convert", str(source), str(out_file), "--to", "sharegpt"], capsys)
    assert code == 1  # one row was left out, and said so
    assert "1 of 2 rows written, 1 rejected" in out and "empty 'instruction'" in out
    assert json.loads(out_file.read_text())["conversations"][1] == {"from": "gpt", "value": "Blue"}
    code, _, err = run_main(["data", "convert", str(source), str(out_file)], capsys)
    assert code == 2 and "--overwrite" in err
    code, out, _ = run_main(["data", "convert", str(source), str(out_file), "--overwrite", "--json"], capsys)
    assert code == 1 and json.loads(out)["written"] == 1


def test_convert_of_an_empty_file_is_refused_as_check_refuses_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    check_code, check_out, _ = run_main(["data", "check", str(empty)], capsys)
    code, out, err = run_main(["data", "convert", str(empty), str(tmp_path / "out.jsonl")], capsys)
    assert check_code == code == 2 and "the dataset is empty" in check_out
    assert out == "" and err.startswith("lorafit: error: ") and err.count("\n") == 1
    assert "the dataset is empty; nothing written" in err
    assert not (tmp_path / "out.jsonl").exists()


def test_cli_runner_sees_the_same_exit_codes(tmp_path: Path) -> None:
    runner = CliRunner()
    clean = write_jsonl(tmp_path / "clean.jsonl", [GOOD])
    result = runner.invoke(app, ["data", "check", str(clean), "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["valid_rows"] == 1
    broken = write_jsonl(tmp_path / "broken.jsonl", ["{"])
    assert runner.invoke(app, ["data", "check", str(broken)]).exit_code == 2


def test_markup_in_the_data_is_printed_not_interpreted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "[/bold] [red]x", "content": "y"}]}])
    code, out, _ = run_main(["data", "check", str(path)], capsys)
    assert code == 2 and "'[/bold] [red]x'" in out


def test_the_installed_command(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [GOOD, "{nope"])
    command = Path(sys.executable).with_name("lorafit")
    result = subprocess.run([str(command), "data", "check", str(path), "--json"], capture_output=True, text=True)
    assert result.returncode == 2
    assert json.loads(result.stdout)["problems"][0]["line"] == 2
    missing = subprocess.run(
        [str(command), "data", "check", str(tmp_path / "nope.csv")], capture_output=True, text=True
    )
    assert missing.returncode == 2 and missing.stderr.startswith("lorafit: error: no such file")
