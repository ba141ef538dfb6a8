"""bench/startup.py: it times `lorafit plan` and the bare import in fresh processes and reports that planning
imports neither torch nor transformers (no timing is asserted: this machine's speed is not the bench's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "startup.py"


def test_the_startup_bench_reports_both_programs_and_no_torch() -> None:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, str(BENCH), "--runs", "1", "--json"], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert set(report["results"]) == {"import lorafit", "lorafit plan"}
    assert all(result["runs"] == 1 and result["median_s"] > 0 for result in report["results"].values())
    assert report["heavy_imported"] == []
    assert report["target_s"] == 0.3
