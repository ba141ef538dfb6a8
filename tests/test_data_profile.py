"""The token profile the planner reads, and the count of rows a sequence length truncates."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lorafit.data import CHAR_ESTIMATE_ERROR, length_profile, token_profile, truncated_rows
from lorafit.data.profile import profile_of_lengths
from lorafit.data.tokens import CharEstimate
from lorafit.errors import DataError
from lorafit.schema import TokenProfile


def text_rows(path: Path, char_counts: list[int]) -> Path:
    path.write_text("".join(json.dumps({"text": f"{i:04d}" + "x" * (n - 4)}) + "\n" for i, n in enumerate(char_counts)))
    return path


def test_token_profile_fields(tmp_path: Path) -> None:
    path = text_rows(tmp_path / "a.jsonl", [40, 80, 400])  # 10, 20, 100 tokens by the estimate
    profile = token_profile(path)
    assert isinstance(profile, TokenProfile)
    assert profile.source == str(path)
    assert (profile.rows, profile.total_tokens, profile.max) == (3, 130, 100)
    assert profile.p50 == 20 and profile.mean == pytest.approx(130 / 3)
    assert profile.tokenizer is None and profile.estimate_error == CHAR_ESTIMATE_ERROR
    assert profile.answer_token_share == pytest.approx(1.0)


def test_truncated_rows_is_exact_from_lengths(tmp_path: Path) -> None:
    lengths_profile = length_profile(text_rows(tmp_path / "a.jsonl", [40 * i for i in range(1, 101)]))
    # lengths 10, 20, ..., 1000: a seq_len of 512 cuts the rows of 520..1000 tokens, 49 of them.
    assert lengths_profile.truncated_rows(512) == 49
    assert truncated_rows(lengths_profile, 512) == 49
    assert truncated_rows([10, 600, 20, 900], 512) == 2
    assert truncated_rows(lengths_profile, 1000) == 0


def test_truncated_rows_from_a_bare_profile_is_an_estimate_from_its_quantiles(tmp_path: Path) -> None:
    profile = length_profile(text_rows(tmp_path / "a.jsonl", [40 * i for i in range(1, 101)])).profile
    assert truncated_rows(profile, profile.max) == 0
    assert truncated_rows(profile, profile.max - 1) >= 1
    estimate = truncated_rows(profile, 512)
    assert abs(estimate - 49) <= 5  # uniform lengths: the p50 - p95 interpolation is close
    assert truncated_rows(profile, 1) == pytest.approx(100, abs=1)


def test_data_with_errors_is_refused_like_the_trainer_would(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "fine"}\n{oops\n')
    with pytest.raises(DataError, match=r"a.jsonl:2 \(row 1\).*lorafit data check"):
        token_profile(path)


def test_bad_rows_skipped_on_request_are_counted_with_their_errors(tmp_path: Path) -> None:
    path = text_rows(tmp_path / "a.jsonl", [40, 80, 400])  # 10, 20, 100 tokens
    path.write_text(path.read_text() + "{broken\n" + json.dumps({"no_text": 1}) + "\n")
    with pytest.raises(DataError):
        length_profile(path)
    kept = length_profile(path, skip_bad_rows=True)
    assert (kept.profile.rows, kept.profile.total_tokens, kept.skipped_rows) == (3, 130, 2)
    assert [problem.row for problem in kept.skipped_because] == [3, 4]
    assert "invalid JSON" in kept.skipped_because[0].message
    only_bad = tmp_path / "b.jsonl"
    only_bad.write_text("{broken\n")
    with pytest.raises(DataError, match=r"b.jsonl:1 \(row 0\): invalid JSON"):  # nothing sound: refused even so
        length_profile(only_bad, skip_bad_rows=True)


def test_seq_len_is_passed_through(tmp_path: Path) -> None:
    profile = length_profile(text_rows(tmp_path / "a.jsonl", [40, 4000]), seq_len=64)
    assert profile.truncated_rows(64) == 1
    assert math.isclose(profile.profile.max, 1000)


def test_profile_of_lengths_by_hand() -> None:
    profile = profile_of_lengths([30, 10, 40, 20], "rows", answer_tokens=25, tokenizer="tok")
    # sorted 10 20 30 40: p50 at position 1.5 -> 25; p95 at 2.85 -> 38.5; p99 at 2.97 -> 39.7
    assert (profile.rows, profile.total_tokens, profile.max, profile.mean) == (4, 100, 40, 25.0)
    assert (profile.p50, profile.p95, profile.p99) == pytest.approx((25.0, 38.5, 39.7))
    assert profile.answer_token_share == 0.25 and profile.tokenizer == "tok" and profile.estimate_error is None
    with pytest.raises(DataError, match="no rows to profile"):
        profile_of_lengths([], "rows", answer_tokens=0, tokenizer=None)


def test_a_file_and_its_lengths_give_the_same_profile(tmp_path: Path) -> None:
    char_counts = [40, 80, 400, 44, 8, 1204]
    path = text_rows(tmp_path / "a.jsonl", char_counts)
    lengths = [math.ceil(n / 4) for n in char_counts]  # raw text: every token is an answer token
    from_file = token_profile(path)
    from_lengths = profile_of_lengths(
        lengths,
        str(path),
        answer_tokens=sum(lengths),
        tokenizer=None,
        estimate_error=CHAR_ESTIMATE_ERROR,
        basis=CharEstimate().basis,
    )
    assert from_lengths == from_file


def test_the_trainers_profile_is_this_one(tmp_path: Path) -> None:
    """train.examples.token_profile measures the tokens the trainer rendered; it is built by the same code."""
    from lorafit.train.examples import IGNORE_INDEX, Encoded
    from lorafit.train.examples import token_profile as trainer_profile

    encoded = Encoded(
        input_ids=[[1] * 30, [1] * 10, [1] * 40, [1] * 20],
        labels=[[IGNORE_INDEX] * 20 + [5] * 10, [5] * 10, [IGNORE_INDEX] * 40, [IGNORE_INDEX] * 15 + [5] * 5],
    )
    expected = profile_of_lengths([30, 10, 40, 20], "train.jsonl", answer_tokens=25, tokenizer="tiny")
    assert trainer_profile(encoded, "train.jsonl", "tiny") == expected
    assert expected.answer_token_share == 0.25 and expected.p95 == pytest.approx(38.5)
