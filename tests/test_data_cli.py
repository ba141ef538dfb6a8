"""`lorafit data check` and `lorafit data convert` as a user runs them: output, files and exit codes."""

from __future__ import annotations

import json
import os
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


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_output_gets_its_missing_parent_folders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [GOOD])
    report, png, out = tmp_path / "r" / "x" / "check.json", tmp_path / "p" / "x" / "l.png", tmp_path / "c" / "x.jsonl"
    code, text, _ = run_main(["data", "check", str(path), "--report", str(report), "--plot", str(png)], capsys)
    assert code == 0 and f"report written to {report}" in text and f"histogram written to {png}" in text
    assert json.loads(report.read_text())["valid_rows"] == 1 and is_png(png)
    assert run_main(["data", "convert", str(path), str(out)], capsys)[0] == 0
    assert load_jsonl(out) == [
        {"messages": [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "Blue"}]}
    ]


def load_jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_directory_gets_a_file_named_after_the_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", [GOOD])
    folder = tmp_path / "out"
    folder.mkdir()
    code, text, _ = run_main(["data", "check", str(path), "--plot", str(folder), "--report", str(folder)], capsys)
    assert code == 0
    assert f"histogram written to {folder / 'train-lengths.png'}" in text and is_png(folder / "train-lengths.png")
    assert f"report written to {folder / 'train-check.json'}" in text
    assert run_main(["data", "convert", str(path), str(folder), "--to", "sharegpt"], capsys)[0] == 0
    assert sorted(p.name for p in folder.iterdir()) == ["train-check.json", "train-lengths.png", "train-sharegpt.jsonl"]
    assert not (tmp_path / "out.png").exists()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--plot", "{tmp}/lengths.jpg"], "--plot {tmp}/lengths.jpg: the histogram is a PNG; name a .png file"),
        (["--plot", "{tmp}/lengths.txt"], "--plot {tmp}/lengths.txt: the histogram is a PNG"),
        (["--plot", "{tmp}/lengths"], "--plot {tmp}/lengths: the histogram is a PNG"),
        (["--report", "{tmp}/report.txt"], "--report {tmp}/report.txt: the report is JSON; name a .json file"),
        (["--report", "{tmp}/a.jsonl/r.json"], "--report {tmp}/a.jsonl/r.json: {tmp}/a.jsonl is a file, not a folder"),
    ],
)
def test_an_output_path_of_the_wrong_kind_is_refused_before_the_data_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [GOOD])
    code, out, err = run_main(["data", "check", str(path), *[a.format(tmp=tmp_path) for a in args]], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"lorafit: error: {words.format(tmp=tmp_path)}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]


def test_convert_writes_json_lines_under_a_json_lines_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [GOOD])
    code, _, err = run_main(["data", "convert", str(path), str(tmp_path / "a.csv")], capsys)
    assert code == 2 and "convert writes JSON Lines; name a .jsonl, .ndjson or .json file" in err
    assert not (tmp_path / "a.csv").exists()


def test_the_report_never_replaces_the_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "a.json"
    path.write_text(json.dumps([GOOD]))
    before = path.read_bytes()
    code, _, err = run_main(["data", "check", str(path), "--report", str(path)], capsys)
    assert code == 2 and f"--report {path} is the input" in err
    assert path.read_bytes() == before
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "b.jsonl", [GOOD])
    code, _, err = run_main(["data", "check", str(folder), "--report", str(folder)], capsys)
    assert code == 2 and "inside the input directory" in err and "would be read as data" in err
    code, out, _ = run_main(["data", "check", str(folder), "--plot", str(folder)], capsys)  # a PNG is not data
    assert code == 0 and is_png(folder / "data-lengths.png")


def test_a_pipe_or_device_is_never_replaced_by_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import os
    import stat

    path = write_jsonl(tmp_path / "a.jsonl", [GOOD])
    for name, args in (
        ("r.json", ["data", "check", str(path), "--report"]),
        ("p.png", ["data", "check", str(path), "--plot"]),
        ("o.jsonl", ["data", "convert", str(path), "--overwrite"]),
    ):
        fifo = tmp_path / name
        os.mkfifo(fifo)
        argv = [*args, str(fifo)] if args[1] == "check" else [*args[:3], str(fifo), *args[3:]]
        code, _, err = run_main(argv, capsys)
        assert code == 2 and "is not a regular file (a device, pipe or socket)" in err, name
        assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_a_folder_that_refuses_writes_is_one_line_for_every_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a user without write permission sees it (the tests may run as root, for whom chmod does not bite)."""
    import errno
    import tempfile

    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    path = write_jsonl(tmp_path / "a.jsonl", [GOOD])
    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    for target, args in (
        (tmp_path / "r.json", ["data", "check", str(path), "--report"]),
        (tmp_path / "p.png", ["data", "check", str(path), "--plot"]),
        (tmp_path / "o.jsonl", ["data", "convert", str(path)]),
    ):
        code, _, err = run_main([*args, str(target)], capsys)
        assert code == 2 and err == f"lorafit: error: cannot write {target}: Permission denied\n"
        assert not target.exists()


OUTPUTS = (  # (the option's name in messages, the arguments before the output path, those after it)
    ("--report", ["check"], ["--report"]),
    ("--plot", ["check"], ["--plot"]),
    ("output", ["convert"], []),
)
SUFFIXES = {"--report": ".json", "--plot": ".png", "output": ".jsonl"}  # each output's file name ending


def output_args(kind: list[str], option: list[str], source: Path, target: Path) -> list[str]:
    if kind == ["convert"]:
        return ["data", "convert", str(source), str(target), "--overwrite"]
    return ["data", "check", str(source), *option, str(target)]


@pytest.mark.parametrize(("label", "kind", "option"), OUTPUTS)
def test_a_symlink_output_is_refused_never_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], label: str, kind: list[str], option: list[str]
) -> None:
    """A link to a file, a dangling link, a link to itself: the writer's rename once replaced each of them."""
    source = write_jsonl(tmp_path / "a.jsonl", [GOOD])
    suffix = SUFFIXES[label]
    mine = tmp_path / f"mine{suffix}"
    mine.write_text("keep me")
    for name, points_to in (("to-a-file", mine), ("dangling", tmp_path / f"gone{suffix}"), ("loop", None)):
        link = tmp_path / f"{name}{suffix}"
        link.symlink_to(points_to or link)
        code, _, err = run_main(output_args(kind, option, source, link), capsys)
        assert (
            code == 2
            and err == f"lorafit: error: {label} {link} is a symbolic link; name the file itself, or a new name\n"
        )
        assert os.readlink(link) == str(points_to or link)
    assert mine.read_text() == "keep me" and not (tmp_path / f"gone{suffix}").exists()


@pytest.mark.parametrize(("label", "kind", "option"), OUTPUTS)
def test_any_legal_output_name_is_written_and_a_longer_one_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], label: str, kind: list[str], option: list[str]
) -> None:
    source = write_jsonl(tmp_path / "a.jsonl", [GOOD])
    suffix = SUFFIXES[label]
    longest = tmp_path / ("n" * (255 - len(suffix)) + suffix)
    code, _, err = run_main(output_args(kind, option, source, longest), capsys)
    assert code == 0, err
    assert longest.stat().st_size > 0
    for too_long in (tmp_path / ("n" * (256 - len(suffix)) + suffix), tmp_path / ("d" * 300) / f"x{suffix}"):
        code, out, err = run_main(output_args(kind, option, source, too_long), capsys)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in out + err
        assert err.startswith(f"lorafit: error: {label} {too_long} has a name of ")
        assert err.endswith("a file or folder name may have at most 255\n")


def test_an_input_name_too_long_to_exist_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / ("i" * 300 + ".jsonl")
    for args in (["data", "check", str(missing)], ["data", "convert", str(missing), str(tmp_path / "out.jsonl")]):
        code, _, err = run_main(args, capsys)
        assert code == 2 and err == f"lorafit: error: no such file or directory: {missing}\n"


def test_ctrl_c_in_convert_says_so_and_keeps_the_old_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    real = importlib.import_module("lorafit.data.convert").from_messages
    calls = {"n": 0}

    def interrupt_after_ten(messages: list, to: str) -> dict:
        calls["n"] += 1
        if calls["n"] > 10:
            raise KeyboardInterrupt  # what Ctrl-C raises, with the output half written
        return real(messages, to)

    source = write_jsonl(tmp_path / "a.jsonl", [GOOD] * 50)
    out_file = tmp_path / "out.jsonl"
    out_file.write_text("the old file\n")
    monkeypatch.setattr(importlib.import_module("lorafit.data.convert"), "from_messages", interrupt_after_ten)
    code, out, err = run_main(["data", "convert", str(source), str(out_file), "--overwrite"], capsys)
    assert code == 130 and err == "lorafit: interrupted\n" and out == ""
    assert out_file.read_text() == "the old file\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.jsonl", "out.jsonl"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_place_that_takes_no_files_is_cannot_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_jsonl(tmp_path / "a.jsonl", [GOOD])
    for target, args in (
        ("/proc/lorafit-x.jsonl", ["data", "convert", str(source)]),
        ("/proc/lorafit-x.json", ["data", "check", str(source), "--report"]),
        ("/proc/lorafit-x.png", ["data", "check", str(source), "--plot"]),
    ):
        code, _, err = run_main([*args, target], capsys)
        assert code == 2 and err.startswith(f"lorafit: error: cannot write {target}: ") and err.count("\n") == 1
