"""`output_path`: the one rule for where convert's OUT, --report and --plot are written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorafit.data.outputs import output_path
from lorafit.errors import DataError


def report_path(path: Path, source: Path) -> Path:
    return output_path(
        path, source, label="--report", what="the report is JSON", suffixes=(".json",), name_suffix="-check"
    )


def test_a_directory_input_names_the_file_after_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "chats.v2"
    data.mkdir()
    (data / "a.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    assert report_path(tmp_path, data) == tmp_path / "chats.v2-check.json"
    monkeypatch.chdir(data)
    assert report_path(tmp_path, Path(".")) == tmp_path / "chats.v2-check.json"


def test_a_link_to_the_input_is_the_input(tmp_path: Path) -> None:
    source = tmp_path / "a.json"
    source.write_text("[]")
    link = tmp_path / "link.json"
    link.symlink_to(source)
    with pytest.raises(DataError, match="is the input"):
        report_path(link, source)
    assert report_path(tmp_path / "new.json", source) == tmp_path / "new.json"


def test_suffixes_are_compared_without_case(tmp_path: Path) -> None:
    source = tmp_path / "a.jsonl"
    source.write_text("")
    assert report_path(tmp_path / "R.JSON", source) == tmp_path / "R.JSON"
