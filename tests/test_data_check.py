"""`check()`: every problem located, token statistics, the histogram and the suggested sequence length."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from lorafit.data.check import check


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def text_rows(tmp_path: Path, char_counts: list[int]) -> Path:
    """Raw-text rows of known length: with the character estimate a row of n characters is ceil(n / 4) tokens."""
    return write_jsonl(
        tmp_path / "text.jsonl", [{"text": f"{i:04d}" + "x" * (n - 4)} for i, n in enumerate(char_counts)]
    )


def test_a_clean_file(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(5)])
    report = check(path)
    assert (report.format, report.rows, report.valid_rows, report.problems) == ("prompt_completion", 5, 5, [])
    assert report.exit_code() == 0 and report.exit_code(strict=True) == 0


def test_every_kind_of_problem_is_located(tmp_path: Path) -> None:
    good = {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]}
    rows = [
        good,
        "{broken",
        {"messages": [{"role": "user", "content": "x"}]},
        {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "assistant", "content": "y"}, {"role": "user", "content": "x"}]},
        good,
    ]
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    report = check(path)
    found: dict[tuple, str] = {}
    for p in report.problems:
        found[(p.line, p.row, p.severity)] = found.get((p.line, p.row, p.severity), "") + p.message + "; "
    assert report.rows == 7 and report.valid_rows == 2 and report.rejected_rows == 5
    assert "invalid JSON" in found[(2, 1, "error")]
    assert "last turn is user" in found[(3, 2, "error")]
    assert "unknown role 'wizard'" in found[(4, 3, "error")]
    assert "wrong type" in found[(5, 4, "error")]
    assert "starts with assistant" in found[(6, 5, "error")]
    assert found[(7, 6, "warning")] == "duplicate of row 0, line 1; "
    assert [p.row for p in report.problems] == sorted(p.row for p in report.problems)
    assert report.exit_code() == 2


def test_duplicates_are_warnings_and_strict_makes_them_fail(tmp_path: Path) -> None:
    row = {"text": "the same words"}
    report = check(write_jsonl(tmp_path / "a.jsonl", [row, {"text": "other"}, row, row]))
    assert [(p.row, p.message) for p in report.problems] == [
        (2, "duplicate of row 0, line 1"),
        (3, "duplicate of row 0, line 1"),
    ]
    assert report.valid_rows == 4
    assert report.exit_code() == 0 and report.exit_code(strict=True) == 1


def test_token_statistics_from_the_character_estimate(tmp_path: Path) -> None:
    char_counts = [40, 80, 120, 400, 4000]
    report = check(text_rows(tmp_path, char_counts))
    lengths = [math.ceil(n / 4) for n in char_counts]  # 10, 20, 30, 100, 1000
    tokens = report.tokens
    assert tokens.tokenizer is None and tokens.estimate_error is not None
    assert tokens.total == 1160 and tokens.max == 1000
    assert tokens.mean == pytest.approx(232.0)
    for name, q in (("p50", 50), ("p95", 95), ("p99", 99)):
        assert getattr(tokens, name) == pytest.approx(np.percentile(lengths, q))
    assert tokens.answer_token_share == pytest.approx(1.0)  # raw text: every token is trained on


def test_answer_share_counts_only_the_assistant(tmp_path: Path) -> None:
    # 'user: ' + 36 chars, '\n\n', 'assistant: ' + 12 chars = 42 + 2 + 23 = 67 chars -> 17 tokens; answer 3.
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "q" * 36, "completion": "a" * 12}])
    tokens = check(path).tokens
    assert tokens.total == 17
    assert tokens.answer_token_share == pytest.approx(3 / 17)


def test_rows_longer_than_seq_len_are_warned_about_and_counted(tmp_path: Path) -> None:
    report = check(text_rows(tmp_path, [40, 80, 120, 400, 4000]), seq_len=64)
    truncated = [p for p in report.problems if "truncated" in p.message]
    assert [(p.row, p.line) for p in truncated] == [(3, 4), (4, 5)]
    assert "100 tokens, longer than --seq-len 64" in truncated[0].message
    assert report.truncated_rows(64) == 2 and report.truncated_rows(1000) == 0
    assert report.to_json()["truncated_rows"] == 2


def test_suggested_seq_len_covers_p99_rounded_to_64(tmp_path: Path) -> None:
    # 100 rows of 10..1000 tokens: p99 = 990.1 -> 991 -> the next multiple of 64 is 1024; power of two 1024.
    report = check(text_rows(tmp_path, [40 * i for i in range(1, 101)]))
    suggestion = report.suggestion
    assert report.tokens.p99 == pytest.approx(990.1)
    assert suggestion.seq_len == 1024 and suggestion.seq_len % 64 == 0
    assert suggestion.power_of_two == 1024
    assert suggestion.truncated_rows == 0
    assert "multiple of 64" in suggestion.rule
    # 70 tokens max: the multiple of 64 (128) and the power of two (128) agree; 130 tokens: 192 vs 256.
    assert check(text_rows(tmp_path, [280])).suggestion.seq_len == 128
    small = check(text_rows(tmp_path, [520])).suggestion
    assert (small.seq_len, small.power_of_two) == (192, 256)


def test_histogram_counts_every_valid_row(tmp_path: Path) -> None:
    char_counts = [40 * i for i in range(1, 101)]
    report = check(text_rows(tmp_path, char_counts))
    edges, counts = report.histogram()
    assert sum(counts) == 100
    assert len(counts) <= 12 and len(edges) == len(counts) + 1
    lengths = [n // 4 for n in char_counts]
    for low, high, count in zip(edges, edges[1:], counts, strict=False):
        assert count == sum(low <= length < high for length in lengths)


def test_an_empty_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    report = check(path)
    assert report.rows == 0 and report.tokens is None
    assert report.problems[0].message.startswith("no rows")
    assert report.exit_code() == 2


def test_a_file_where_nothing_parses_is_reported_with_no_format(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", ["{", "nope", "[1,"])
    report = check(path)
    assert report.format is None
    assert [p.line for p in report.problems] == [1, 2, 3]
    assert report.to_json()["format"] is None


def test_json_report_has_the_promised_keys(tmp_path: Path) -> None:
    report = check(write_jsonl(tmp_path / "a.jsonl", [{"text": "hello there"}, "{bad"]))
    data = json.loads(report.dumps())
    assert data["format"] == "text" and data["rows"] == 2 and data["valid_rows"] == 1
    assert data["problems"] == [
        {
            "message": data["problems"][0]["message"],
            "severity": "error",
            "file": str(tmp_path / "a.jsonl"),
            "line": 2,
            "row": 1,
            "field": None,
        }
    ]
    assert set(data["tokens"]) >= {"total", "mean", "p50", "p95", "p99", "max"}
    assert data["tokens"]["total"] == 3  # "hello there": 11 characters -> 3 tokens


def test_a_system_turn_between_user_and_assistant_is_a_warning_not_an_error(tmp_path: Path) -> None:
    turns = [("user", "Hi"), ("system", "Answer in French."), ("assistant", "Bonjour")]
    path = write_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": r, "content": c} for r, c in turns]}])
    report = check(path)
    assert (report.valid_rows, report.errors, report.warnings) == (1, 0, 1)
    assert report.exit_code() == 0 and report.exit_code(strict=True) == 1
    assert "system turn at position 1" in report.problems[0].message
