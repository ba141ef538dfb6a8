"""The one atomic writer: whole files or nothing, readable by others as an ordinary write would make them."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lorafit.errors import LorafitError
from lorafit.files import atomic_writer, remove_stale_partials, write_atomic


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


# --- what the writer refuses: anything but a regular file, a name no file system holds ---------------------------
def symlinks(folder: Path) -> dict[str, Path]:
    """A link to a file, a dangling link and a link to itself, each with what it must still read afterwards."""
    (folder / "mine.txt").write_text("keep me")
    links = {"to a file": folder / "a.json", "dangling": folder / "b.json", "looping": folder / "c.json"}
    links["to a file"].symlink_to(folder / "mine.txt")
    links["dangling"].symlink_to(folder / "nowhere.json")
    links["looping"].symlink_to(links["looping"])
    return links


def test_a_symlink_is_refused_never_replaced_nor_written_through(tmp_path: Path) -> None:
    for kind, link in symlinks(tmp_path).items():
        before = os.readlink(link)
        with pytest.raises(LorafitError, match="is a symbolic link"):
            write_atomic(link, "new")
        assert link.is_symlink() and os.readlink(link) == before, kind
    assert (tmp_path / "mine.txt").read_text() == "keep me"
    assert not (tmp_path / "nowhere.json").exists()
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".")]


def test_a_pipe_is_refused_not_replaced(tmp_path: Path) -> None:
    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    with pytest.raises(LorafitError, match="is not a regular file"):
        write_atomic(fifo, "new")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_device_node_is_refused_not_replaced(tmp_path: Path) -> None:
    """As root, `init /dev/null --force` once replaced /dev/null: a node made in a temporary folder stands in."""
    node = tmp_path / "null"
    try:
        os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, AttributeError):
        pytest.skip("making a device node needs root (and a system that allows it)")
    with pytest.raises(LorafitError, match="is not a regular file"):
        write_atomic(node, "new")
    assert stat.S_ISCHR(os.lstat(node).st_mode)


@pytest.mark.parametrize("name", ["x" * 250 + ".json", "y" * 255, "é" * 124 + ".jsonl"])
def test_every_name_the_file_system_holds_can_be_written(tmp_path: Path, name: str) -> None:
    assert len(os.fsencode(name)) >= 250  # the temporary name once added ~14 characters to these
    write_atomic(tmp_path / name, "{}")
    assert (tmp_path / name).read_text() == "{}"
    assert [path.name for path in tmp_path.iterdir()] == [name]


@pytest.mark.parametrize("where", ["file", "folder"])
def test_a_name_too_long_is_one_line_not_an_os_error(tmp_path: Path, where: str) -> None:
    path = tmp_path / ("z" * 251 + ".json" if where == "file" else "z" * 256 + "/report.json")
    with pytest.raises(LorafitError) as raised:
        write_atomic(path, "{}")
    assert "256 bytes" in str(raised.value) and "at most 255" in str(raised.value)
    assert "\n" not in str(raised.value) and not list(tmp_path.iterdir())


# --- what a killed process leaves ----------------------------------------------------------------------------
def dead_pid() -> int:
    """The id of a process that has ended (and was reaped)."""
    process = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(process.stdout)


def test_the_next_write_removes_what_a_killed_writer_left(tmp_path: Path) -> None:
    killed_midway = (
        "import os, signal, sys\n"
        "from lorafit.files import atomic_writer\n"
        "with atomic_writer(sys.argv[1]) as handle:\n"
        "    handle.write('half'); handle.flush()\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    target = tmp_path / "train.jsonl"
    target.write_text("old\n")
    process = subprocess.run(
        [sys.executable, "-c", killed_midway, str(target)], env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    )
    assert process.returncode == -signal.SIGKILL
    left = [path for path in tmp_path.iterdir() if path != target]
    assert len(left) == 1 and left[0].read_text() == "half"  # what a kill leaves, as before
    look_alike = tmp_path / f".notes-{dead_pid()}.tmp"  # not the writer's own name: never touched
    look_alike.write_text("user's")
    write_atomic(target, "new\n")
    assert target.read_text() == "new\n"
    assert sorted(tmp_path.iterdir()) == sorted([target, look_alike])


def test_a_write_in_progress_is_never_removed(tmp_path: Path) -> None:
    """Another write into the same folder, by this process (alive), leaves the unfinished one alone."""
    with atomic_writer(tmp_path / "a.json") as handle:
        handle.write("a")
        write_atomic(tmp_path / "b.json", "b")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.json", "b.json"]


def test_stale_folders_of_dead_processes_go_and_the_living_ones_stay(tmp_path: Path) -> None:
    """The helper export reuses for its hidden `.NAME.partial-PID` folders."""
    import re

    pattern = re.compile(r"\.model\.partial-(?P<pid>[0-9]+)")
    dead, alive = tmp_path / f".model.partial-{dead_pid()}", tmp_path / f".model.partial-{os.getpid()}"
    for folder in (dead, alive):
        (folder / "sub").mkdir(parents=True)
        (folder / "sub" / "weights.bin").write_bytes(b"0" * 10)
    outside = tmp_path / "outside"
    outside.mkdir()
    linked = tmp_path / f".model.partial-{dead_pid()}"  # a link is removed, never followed
    linked.symlink_to(outside)
    (outside / "keep.txt").write_text("mine")
    assert sorted(remove_stale_partials(tmp_path, pattern)) == sorted([dead, linked])
    assert alive.is_dir() and not dead.exists() and not linked.is_symlink()
    assert (outside / "keep.txt").read_text() == "mine"


def test_a_temporary_from_another_machine_is_left_alone(tmp_path: Path) -> None:
    """A shared folder (several nodes of one run): a process id says nothing about another machine's processes."""
    from lorafit.files import host_tag

    other = "ffffffff" if host_tag() != "ffffffff" else "00000000"
    theirs = tmp_path / f".lorafit-{other}-{dead_pid()}-abcd1234.tmp"
    theirs.write_text("being written there")
    write_atomic(tmp_path / "plan.json", "{}")
    assert theirs.read_text() == "being written there"
