"""The docs' examples: every `$ lorafit ...` block in docs/*.md shows what that command prints now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_lorafit_example_in_the_docs_prints_what_it_shows() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "refresh_docs.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, f"run `python tools/refresh_docs.py`:\n{done.stdout}{done.stderr}"
