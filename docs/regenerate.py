"""Rerun every command shown in the docs and put its current output under it.

A docs code block that starts with `$ COMMAND` holds that command's output; `python docs/regenerate.py` (run from
the repository root, in the project's virtualenv) reruns each command at 100 columns and rewrites the block.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOCS = ["docs/plan.md", "docs/memory-model.md"]
BLOCK = re.compile(r"```\n\$ (?P<body>.*?)```", re.DOTALL)


def run(command: str) -> str:
    env = dict(os.environ, COLUMNS="100", PYTHONWARNINGS="ignore")
    done = subprocess.run(command, shell=True, capture_output=True, text=True, env=env, check=False)
    return done.stdout


def split_command(body: str) -> str:
    """The command is the first line, continued over the next ones while a double quote is open."""
    lines = body.splitlines(keepends=True)
    command = lines[0]
    for line in lines[1:]:
        if command.count('"') % 2 == 0:
            break
        command += line
    return command.rstrip("\n")


def regenerate(path: Path) -> int:
    text = path.read_text()
    count = 0

    def replace(match: re.Match[str]) -> str:
        nonlocal count
        count += 1
        command = split_command(match["body"])
        return f"```\n$ {command}\n{run(command)}```"

    path.write_text(BLOCK.sub(replace, text))
    return count


def main() -> None:
    for name in DOCS:
        print(f"{name}: {regenerate(Path(name))} commands rerun", file=sys.stderr)


if __name__ == "__main__":
    main()
