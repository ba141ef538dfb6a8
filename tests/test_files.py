"""The one atomic writer: whole files or nothing, readable by others as an ordinary write would make them."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from lorafit.files import atomic_writer, write_atomic


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_written_file_has_the_mode_an_ordinary_write_gives_it(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "adapter_config.json", "{}")
        with open(tmp_path / "plain.txt", "w") as handle:
            handle.write("x")
        with atomic_writer(tmp_path / "loss.png", binary=True) as handle:
            handle.write(b"\x89PNG")
    finally:
        os.umask(old)
    assert mode(tmp_path / "adapter_config.json") == mode(tmp_path / "plain.txt") == 0o644  # was 0600
    assert mode(tmp_path / "loss.png") == 0o644
    assert (tmp_path / "loss.png").read_bytes() == b"\x89PNG"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_writer(target) as handle:
        handle.write("half")
        raise RuntimeError("disk full")
    assert target.read_text() == "old"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["plan.json"]


def test_missing_parent_folders_are_created(tmp_path: Path) -> None:
    write_atomic(tmp_path / "a" / "b" / "report.json", "{}")
    assert (tmp_path / "a" / "b" / "report.json").read_text() == "{}"
