"""`make bench-startup`: how long `lorafit plan` takes to answer, imports included, beside the bare import.

Planning must feel instant, so the planner's modules never import torch or transformers and `lorafit plan`
(the default plan, printed to /dev/null) stays under 0.3 s in-process. Each run is a fresh interpreter: the
time is taken inside it with time.perf_counter from the first line of the program (imports and the plan
included, the interpreter's own start-up left out, as a user's shell adds that to any Python program), and the
process reports which heavy libraries it imported. The median of the runs is printed for the plan and for a
bare `import lorafit`, with the target; the exit code is 1 when torch or transformers was imported.

    python bench/startup.py [--runs 5] [--json] [--baseline OTHER/src]

`--baseline` times another source tree (the `src` of an older checkout, e.g. from `git worktree add`) in the same
run, taking turns, so that a change is judged by the ratio on the same (shared, noisy) machine. The byte-code
cache is used as an installed package uses it (PYTHONDONTWRITEBYTECODE is cleared; a first, untimed run writes it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

TARGET_SECONDS = 0.3
HEAVY = ("torch", "transformers")

# The program each fresh interpreter runs: the clock starts on its first line.
TIMED = """\
import time
start = time.perf_counter()
{body}
seconds = time.perf_counter() - start
import json, sys
print(json.dumps({{"seconds": seconds, "heavy": [name for name in {heavy!r} if name in sys.modules]}}))
"""
BODIES = {
    "import lorafit": "import lorafit",
    "lorafit plan": """\
import contextlib, os
from lorafit.cli import main
with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
    try:
        main(["plan"])
    except SystemExit as end:
        if end.code:
            raise""",
}


def time_once(body: str, src: Path | None = None) -> dict:
    """One fresh interpreter running `body` (lorafit from `src` when given): its seconds and the heavy libraries
    it imported."""
    program = TIMED.format(body=body, heavy=HEAVY)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    if src is not None:
        env["PYTHONPATH"] = str(src)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"startup bench: the timed program failed:\n{done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(runs: int, trees: dict[str, Path | None]) -> dict[str, dict]:
    """Median seconds of each program of each source tree over `runs` fresh interpreters, taking turns, and what
    they imported. Keys: the program's name, then ` (baseline)` for the other tree."""
    labels = {f"{name}{suffix}": (body, src) for suffix, src in trees.items() for name, body in BODIES.items()}
    times: dict[str, list[float]] = {label: [] for label in labels}
    heavy: dict[str, set[str]] = {label: set() for label in labels}
    for body, src in labels.values():
        time_once(body, src)  # writes the byte-code cache; not timed
    for _ in range(runs):
        for label, (body, src) in labels.items():
            result = time_once(body, src)
            times[label].append(result["seconds"])
            heavy[label] |= set(result["heavy"])
    return {
        label: {"median_s": statistics.median(times[label]), "runs": len(times[label]), "heavy": sorted(heavy[label])}
        for label in labels
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh interpreters per program (median)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--baseline", type=Path, help="the src folder of another checkout, timed in the same run")
    args = parser.parse_args(argv)
    trees: dict[str, Path | None] = {"": None} | ({" (baseline)": args.baseline} if args.baseline else {})
    results = measure(max(args.runs, 1), trees)
    ours = [result for label, result in results.items() if "baseline" not in label]
    imported = sorted({name for result in ours for name in result["heavy"]})
    if args.json:
        print(json.dumps({"target_s": TARGET_SECONDS, "results": results, "heavy_imported": imported}))
    else:
        for name, result in results.items():
            print(f"{name:<27} {result['median_s']:.3f} s  (median of {result['runs']} fresh processes)")
        plan = results["lorafit plan"]["median_s"]
        verdict = "within" if plan < TARGET_SECONDS else "OVER"
        print(f"target: lorafit plan < {TARGET_SECONDS} s in-process: {verdict}")
        if args.baseline:
            ratio = plan / results["lorafit plan (baseline)"]["median_s"]
            print(f"lorafit plan against the baseline: {ratio:.2f}x")
        print(f"torch/transformers imported: {', '.join(imported) if imported else 'no'}")
    return 1 if imported else 0


if __name__ == "__main__":
    raise SystemExit(main())
