"""Loaders for every file type, with line numbers and per-line errors, and directories of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorafit.data import Dataset, detect, load_conversations
from lorafit.errors import DataError

ROWS = [
    {"instruction": "Name a colour", "input": "", "output": "Blue"},
    {"instruction": "Add", "input": "2 and 3", "output": "5"},
]
EXPECTED = [
    [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "Blue"}],
    [{"role": "user", "content": "Add\n\n2 and 3"}, {"role": "assistant", "content": "5"}],
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def problems_of(path: Path, **kwargs: object) -> list:
    return [problem for record in Dataset(path, **kwargs) for problem in record.problems]


def test_jsonl(tmp_path: Path) -> None:
    rows = load_conversations(write_jsonl(tmp_path / "a.jsonl", ROWS))
    assert rows == EXPECTED
    assert rows.format == "alpaca"


def test_json_array_and_json_lines_named_json(tmp_path: Path) -> None:
    array = tmp_path / "array.json"
    array.write_text(json.dumps(ROWS, indent=2))
    assert load_conversations(array) == EXPECTED
    lines = write_jsonl(tmp_path / "lines.json", ROWS)
    assert load_conversations(lines) == EXPECTED


def test_a_single_json_object_is_explained(tmp_path: Path) -> None:
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"data": ROWS}, indent=2))
    problems = problems_of(path)
    assert len(problems) == 1
    assert "one JSON object" in problems[0].message and "'data'" in problems[0].message


def test_csv_with_a_quoted_newline_keeps_true_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text(
        'instruction,input,output\n"Write a poem\nin two lines",,"Roses\nare red"\nAdd,2 and 3,5\nBroken,row\n',
        encoding="utf-8",
    )
    records = list(Dataset(path))
    assert [record.line for record in records] == [2, 5, 6]  # row 0 spans lines 2-4
    assert records[0].messages == [
        {"role": "user", "content": "Write a poem\nin two lines"},
        {"role": "assistant", "content": "Roses\nare red"},
    ]
    assert records[2].messages is None
    assert "2 fields, the header has 3" in records[2].problems[0].message


def test_tsv(tmp_path: Path) -> None:
    path = tmp_path / "a.tsv"
    path.write_text("prompt\tcompletion\nSay hi\thi\n")
    assert load_conversations(path) == [[{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]]


def test_parquet_streams_nested_conversations(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "a.parquet"
    conversations = [[{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}] for i in range(2500)]
    pq.write_table(pa.table({"conversations": conversations}), path, row_group_size=1000)
    rows = load_conversations(path)
    assert rows.format == "sharegpt"
    assert len(rows) == 2500
    assert rows[2499] == [{"role": "user", "content": "q2499"}, {"role": "assistant", "content": "a2499"}]
    assert all(record.line is None for record in Dataset(path))


def test_text_is_one_row_per_non_blank_line(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_text("first line\n\nthird line\n")
    records = list(Dataset(path))
    assert [(record.line, record.row) for record in records] == [(1, 0), (3, 1)]
    assert records[1].messages == [{"role": "assistant", "content": "third line"}]


def test_jsonl_line_numbers_skip_blank_lines_but_count_them(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n{not json\n" + json.dumps(ROWS[1]) + "\n")
    records = list(Dataset(path))
    assert [(record.line, record.row, record.ok) for record in records] == [(1, 0, True), (3, 1, False), (4, 2, True)]
    assert records[1].problems[0].message.startswith("invalid JSON")


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".txt"])
def test_non_utf8_bytes_are_pinned_to_their_line(tmp_path: Path, suffix: str) -> None:
    header = b"text\n" if suffix == ".csv" else b""
    good = b'{"text": "fine"}\n' if suffix == ".jsonl" else b"fine\n"
    bad = b'{"text": "caf\xe9"}\n' if suffix == ".jsonl" else b"caf\xe9\n"
    path = tmp_path / f"a{suffix}"
    path.write_bytes(header + good + bad + good)
    records = list(Dataset(path))
    offset = 1 if header else 0
    assert [record.ok for record in records] == [True, False, True]
    assert records[1].line == 2 + offset
    assert "non-UTF-8" in records[1].problems[0].message and "0xe9" in records[1].problems[0].message


def test_a_byte_order_mark_is_not_an_error(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(ROWS[0]).encode() + b"\n")
    assert load_conversations(path) == EXPECTED[:1]


def test_lone_surrogates_are_rejected_not_crashed_on(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "bad \\ud800 half"}\n{"text": "ok \\ud83d\\ude00"}\n')
    records = list(Dataset(path))
    assert [record.ok for record in records] == [False, True]
    assert "surrogate" in records[0].problems[0].message


def test_a_directory_is_read_in_order_with_rows_numbered_across_files(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "b.jsonl", ROWS[1:])
    write_jsonl(tmp_path / "a.jsonl", ROWS[:1])
    (tmp_path / ".hidden.jsonl").write_text("garbage\n")
    (tmp_path / "notes.md").write_text("not data")
    records = list(Dataset(tmp_path))
    assert [(Path(record.file).name, record.row) for record in records] == [("a.jsonl", 0), ("b.jsonl", 1)]
    assert load_conversations(tmp_path) == EXPECTED


def test_a_directory_mixing_formats_is_refused(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", ROWS)
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": "p", "completion": "c"}])
    with pytest.raises(DataError, match="mixes formats"):
        detect(tmp_path)


def test_format_override_and_mapping(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [{"question": "Say hi", "answer": "hi", "text": "ignored"}])
    assert detect(path) == "text"
    rows = load_conversations(path, format="alpaca", mapping=["instruction=question", "output=answer"])
    assert rows == [[{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]]
    with pytest.raises(DataError, match="unknown format"):
        load_conversations(path, format="chatml")


@pytest.mark.parametrize(
    ("name", "words"),
    [("missing.jsonl", "no such file"), ("data.xlsx", "unknown file type"), ("empty_dir", "no data files")],
)
def test_unreadable_inputs_are_one_line_errors(tmp_path: Path, name: str, words: str) -> None:
    path = tmp_path / name
    if name == "data.xlsx":
        path.write_bytes(b"PK")
    if name == "empty_dir":
        path.mkdir()
    with pytest.raises(DataError, match=words):
        load_conversations(path)


def test_a_corrupt_parquet_file_is_a_reported_problem(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    path.write_bytes(b"PAR1 this is not parquet PAR1")
    problems = problems_of(path)
    assert len(problems) == 1 and "cannot read Parquet" in problems[0].message
    with pytest.raises(DataError, match="cannot read Parquet"):
        load_conversations(path)


def test_load_conversations_names_the_first_error_and_the_command(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [ROWS[0], {"instruction": "x", "output": ""}, {"instruction": 1}])
    with pytest.raises(DataError) as raised:
        load_conversations(path)
    message = str(raised.value)
    assert "\n" not in message
    assert "a.jsonl:2 (row 1)" in message and "empty 'output'" in message
    assert "1 more rows with errors" in message
    assert f"lorafit data check {path}" in message


def test_warnings_do_not_stop_loading(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [ROWS[0], ROWS[0]])
    rows = load_conversations(path)
    assert len(rows) == 2  # duplicates are the check's warning, not the trainer's business


def test_a_pipe_is_not_called_missing(tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="is not a regular file or a directory"):
        load_conversations(fifo)


LINE = '{"instruction": "Name a colour", "output": "Blue"}\n'


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (LINE.encode("utf-16"), "UTF-16 text; lorafit reads UTF-8: convert it, e.g. iconv -f UTF-16 -t UTF-8"),
        ((LINE * 3).encode("utf-16-le"), "UTF-16LE text; lorafit reads UTF-8: convert it, e.g. iconv -f UTF-16LE"),
        ((LINE * 3).encode("utf-16-be"), "UTF-16BE text"),
        (LINE.encode("utf-32"), "UTF-32 text"),
        (__import__("gzip").compress(LINE.encode() * 3), "gzip-compressed, not .jsonl text"),
        (b"\x7fELF\x02\x01\x01" + bytes(200) + b"\x3e\x00\x01", "a binary file (NUL bytes), not text"),
    ],
)
def test_a_file_that_is_not_utf8_text_is_one_problem_not_one_per_line(
    tmp_path: Path, content: bytes, words: str
) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    problems = problems_of(path)
    assert len(problems) == 1 and problems[0].row is None
    assert problems[0].message.startswith(words)


def test_utf8_text_with_a_byte_order_mark_or_accents_is_not_mistaken_for_utf16(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_bytes(b"\xef\xbb\xbfinstruction,output\n" + "Nommez une couleur,Bleu é\n".encode() * 50)
    assert problems_of(path) == []


def test_compressed_files_and_arrow_folders_are_named_for_what_they_are(tmp_path: Path) -> None:
    import gzip

    packed = tmp_path / "packed"
    packed.mkdir()
    (packed / "train.jsonl.gz").write_bytes(gzip.compress(LINE.encode()))
    with pytest.raises(DataError, match=r"train.jsonl.gz: a gzip file; lorafit reads data uncompressed"):
        load_conversations(packed / "train.jsonl.gz")
    with pytest.raises(DataError, match=r"no data files in .*packed .*compressed files \(.gz\): extract them first"):
        load_conversations(packed)
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "data-00000-of-00001.arrow").write_bytes(b"ARROW1")
    (saved / "state.json").write_text('{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}')
    with pytest.raises(DataError, match=r"holds Arrow files .*load_from_disk"):
        load_conversations(saved)


@pytest.mark.parametrize(
    ("rows", "mapping", "words"),
    [
        (ROWS, ["instruction=question"], "--map instruction=question: no record of .* has a column 'question'"),
        ([{"q": "a", "output": "b"}], ["instruction=question"], r"its columns: 'output', 'q'"),
        (ROWS, ["role=speaker"], r"has no turns \(role names a key inside each turn\)"),
        (
            [{"messages": [{"speaker": "user", "text": "a"}, {"speaker": "assistant", "text": "b"}]}],
            ["role=speaker", "content=txt"],
            r"--map content=txt: no turn of .* has a key 'txt' \(its keys: 'speaker', 'text'\)",
        ),
    ],
)
def test_a_mapping_that_matches_no_column_is_refused(
    tmp_path: Path, rows: list, mapping: list[str], words: str
) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    with pytest.raises(DataError, match=words):
        Dataset(path, mapping=mapping)
    with pytest.raises(DataError, match=words):
        Dataset(path, format="alpaca", mapping=mapping)  # a forced format does not skip the check


def test_a_mapping_that_matches_is_used(tmp_path: Path) -> None:
    rows = [{"messages": [{"speaker": "user", "text": "a"}, {"speaker": "assistant", "text": "b"}]}]
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    assert load_conversations(path, mapping=["role=speaker", "content=text"]) == [
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    ]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('[1, "x", null]', r"its records are not objects with columns \(they are a number, a string, null\)"),
        ("null\n", r"its records are not objects with columns \(they are null\)"),
        ("{}\n", r"columns seen: none \(every record is \{\}\)"),
    ],
)
def test_records_that_are_not_objects_are_called_that(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "a.json"
    path.write_text(text)
    with pytest.raises(DataError, match=words):
        detect(path)
