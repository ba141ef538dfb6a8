"""`convert()`: exactly the rows that pass, in the chosen format, written all or nothing."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from lorafit.data import convert, load_conversations
from lorafit.data import formats as formats_module
from lorafit.errors import DataError

ALPACA = [
    {"instruction": "Name a colour", "input": "", "output": "Blue"},
    {"instruction": "", "output": "no question"},
    {"instruction": "Add", "input": "2 and 3", "output": "5"},
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def read_jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("to", ["messages", "alpaca", "sharegpt"])
def test_converted_file_has_exactly_the_rows_that_passed(tmp_path: Path, to: str) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", ALPACA)
    before = source.read_bytes()
    report = convert(source, tmp_path / "out.jsonl", to)
    assert (report.rows, report.written, report.rejected) == (3, 2, 1)
    assert [p.row for p in report.problems] == [1]
    assert source.read_bytes() == before
    written = read_jsonl(tmp_path / "out.jsonl")
    assert len(written) == 2
    # Read back, the conversations are the ones the input held.
    assert load_conversations(tmp_path / "out.jsonl") == [
        [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "Blue"}],
        [{"role": "user", "content": "Add\n\n2 and 3"}, {"role": "assistant", "content": "5"}],
    ]


def test_sharegpt_output_uses_sharegpt_speakers(tmp_path: Path) -> None:
    convert(write_jsonl(tmp_path / "in.jsonl", ALPACA[:1]), tmp_path / "out.jsonl", "sharegpt")
    assert read_jsonl(tmp_path / "out.jsonl") == [
        {"conversations": [{"from": "human", "value": "Name a colour"}, {"from": "gpt", "value": "Blue"}]}
    ]


def test_rows_the_target_cannot_hold_are_counted_as_rejected(tmp_path: Path) -> None:
    turns = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    source = write_jsonl(tmp_path / "in.jsonl", [{"messages": turns}, {"messages": turns[:2]}])
    report = convert(source, tmp_path / "out.jsonl", "alpaca")
    assert (report.written, report.rejected) == (1, 1)
    assert "cannot be written as alpaca" in report.problems[0].message


def test_an_existing_output_is_kept_unless_overwrite(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", ALPACA)
    out = tmp_path / "out.jsonl"
    out.write_text("precious\n")
    with pytest.raises(DataError, match="--overwrite"):
        convert(source, out, "messages")
    assert out.read_text() == "precious\n"
    convert(source, out, "messages", overwrite=True)
    assert len(read_jsonl(out)) == 2


def test_the_input_is_never_the_output(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", ALPACA)
    with pytest.raises(DataError, match="is the input"):
        convert(source, source, "messages", overwrite=True)
    with pytest.raises(DataError, match="inside the input directory"):
        convert(tmp_path, tmp_path / "out.jsonl", "messages", overwrite=True)


def test_a_crash_midway_leaves_no_half_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", ALPACA * 50)
    out = tmp_path / "out.jsonl"
    out.write_text("the old file\n")
    real = formats_module.from_messages
    calls = {"n": 0}

    def crash_after_ten(messages: list, to: str) -> dict:
        calls["n"] += 1
        if calls["n"] > 10:
            raise KeyboardInterrupt
        return real(messages, to)

    monkeypatch.setattr(importlib.import_module("lorafit.data.convert"), "from_messages", crash_after_ten)
    with pytest.raises(KeyboardInterrupt):
        convert(source, out, "messages", overwrite=True)
    assert out.read_text() == "the old file\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


def test_raw_text_and_unknown_targets_are_refused(tmp_path: Path) -> None:
    text = tmp_path / "in.txt"
    text.write_text("just words\n")
    with pytest.raises(DataError, match="raw text"):
        convert(text, tmp_path / "out.jsonl", "messages")
    with pytest.raises(DataError, match="--to chatml"):
        convert(write_jsonl(tmp_path / "in.jsonl", ALPACA), tmp_path / "out.jsonl", "chatml")


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("", "has no rows: the dataset is empty"),
        ("\n\n", "has no rows: the dataset is empty"),
        ('{"instruction": "", "output": "x"}\n{oops\n', "none of its 2 rows can be written as messages"),
    ],
)
def test_nothing_is_written_when_no_row_passes(tmp_path: Path, content: str, words: str) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(content)
    with pytest.raises(DataError, match=words) as raised:
        convert(source, tmp_path / "out.jsonl", "messages")
    assert "nothing written" in str(raised.value) and "\n" not in str(raised.value)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.jsonl"]


def test_an_old_output_survives_a_conversion_with_no_rows(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": "a"}] * 2}])
    out = tmp_path / "out.jsonl"
    out.write_text("the old file\n")
    with pytest.raises(DataError, match="its one row cannot be written as alpaca"):
        convert(source, out, "alpaca", overwrite=True)
    assert out.read_text() == "the old file\n"


def test_rows_only_the_target_cannot_hold_do_not_send_the_user_to_data_check(tmp_path: Path) -> None:
    turns = [{"role": r, "content": r} for r in ("user", "assistant", "user", "assistant")]
    source = write_jsonl(tmp_path / "in.jsonl", [{"messages": turns}])
    with pytest.raises(DataError, match="cannot be written as alpaca") as raised:
        convert(source, tmp_path / "out.jsonl", "alpaca")
    assert "data check" not in str(raised.value)
