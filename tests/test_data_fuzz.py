"""Random bytes and random JSON into every loader: a report or one clear DataError, never a traceback."""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from lorafit.data import check, convert, load_conversations
from lorafit.data.cli import render_check
from lorafit.errors import DataError

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
roles = st.sampled_from(["user", "assistant", "system", "tool", "human", "gpt", "wizard", "", "USER"])
turns = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": roles | json_values,
            "content": st.text(max_size=10) | json_values,
            "from": roles,
            "value": st.text(max_size=10) | json_values,
            "tool_calls": json_values,
        },
    ),
    max_size=5,
)
# Records that look like each format, with fields missing, empty, of the wrong type or unpaired surrogates.
records = (
    st.fixed_dictionaries(
        {},
        optional={
            "instruction": st.text(max_size=10) | json_values,
            "input": st.text(max_size=5) | json_values,
            "output": st.text(max_size=10) | json_values,
            "messages": turns | json_values,
            "conversations": turns | json_values,
            "prompt": st.text(max_size=10) | turns,
            "completion": st.text(max_size=10) | turns,
            "text": st.text(max_size=10) | json_values,
            "system": st.text(max_size=5) | json_values,
        },
    )
    | json_values
)


def exercise(path: Path) -> None:
    """Everything a user can run on a file: check (and render it), convert, load. Only DataError may escape."""
    try:
        report = check(path, seq_len=8)
    except DataError as error:
        assert str(error) and "\n" not in str(error)
        return
    assert report.rows >= report.valid_rows >= 0
    assert report.exit_code() in (0, 1, 2)
    json.loads(report.dumps())
    render_check(report, Console(file=io.StringIO(), width=100), False, None, None)
    for action in (
        lambda: convert(path, path.with_name("out.jsonl"), "messages", overwrite=True),
        lambda: load_conversations(path),
    ):
        try:
            action()
        except DataError as error:
            assert "\n" not in str(error)


@FUZZ
@given(data=st.binary(max_size=300), suffix=st.sampled_from([".jsonl", ".json", ".csv", ".tsv", ".txt", ".parquet"]))
def test_random_bytes(data: bytes, suffix: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"data{suffix}"
        path.write_bytes(data)
        exercise(path)


@FUZZ
@given(rows=st.lists(records, max_size=6), as_array=st.booleans())
def test_random_json_records(rows: list, as_array: bool) -> None:
    with tempfile.TemporaryDirectory() as folder:
        if as_array:
            path = Path(folder) / "data.json"
            path.write_text(json.dumps(rows))
        else:
            path = Path(folder) / "data.jsonl"
            path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        exercise(path)


@FUZZ
@given(rows=st.lists(st.lists(st.text(max_size=8), min_size=1, max_size=4), max_size=6))
def test_random_csv_cells(rows: list[list[str]]) -> None:
    import csv

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "data.csv"
        with path.open("w", newline="", encoding="utf-8", errors="surrogatepass") as handle:
            csv.writer(handle).writerows([["instruction", "input", "output"], *rows])
        exercise(path)
