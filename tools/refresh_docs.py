"""Rerun every `$ lorafit ...` example in docs/*.md and put its current output under it.

The docs show whole plans (hours, costs, peaks); each example is a command anyone can rerun, and this keeps the
printed output equal to what that command prints now. `--check` only reports the stale ones (exit 1), for tests.

    python tools/refresh_docs.py [--check]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a fenced block whose first line is a lorafit command; its output follows up to the closing fence
EXAMPLE = re.compile(r"```\n\$ (lorafit [^\n]*)\n(.*?)```", re.DOTALL)
COLUMNS = "100"  # the width the examples are printed at


def output_of(command: str) -> str:
    """What `command` prints at the docs' width, as the reader's terminal would show it."""
    args = [sys.executable, "-m", "lorafit.cli", *shlex.split(command)[1:]]
    env = os.environ | {"COLUMNS": COLUMNS, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    return done.stdout + done.stderr


def refresh(text: str) -> tuple[str, list[str]]:
    """The text with every example's output replaced by the current one, and the commands whose output changed."""
    stale: list[str] = []

    def rerun(match: re.Match[str]) -> str:
        command, shown = match.group(1), match.group(2)
        now = output_of(command)
        if now != shown:
            stale.append(command)
        return f"```\n$ {command}\n{now}```"

    return EXAMPLE.sub(rerun, text), stale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="report stale examples (exit 1), change nothing")
    check = parser.parse_args().check
    stale_anywhere = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        text = path.read_text()
        fresh, stale = refresh(text)
        stale_anywhere += [f"{path.relative_to(ROOT)}: $ {command}" for command in stale]
        if stale and not check:
            path.write_text(fresh)
    for line in stale_anywhere:
        print(("stale " if check else "refreshed ") + line)
    return 1 if check and stale_anywhere else 0


if __name__ == "__main__":
    sys.exit(main())
