"""`make bench-startup`: how long `lorafit plan` takes to answer, imports included, beside the bare import.

Planning must feel instant, so the planner's modules never import torch or transformers and `lorafit plan`
(the default plan, printed to /dev/null) stays under 0.3 s in-process. Each run is a fresh interpreter: the
time is taken inside it with time.perf_counter from the first line of the program (imports and the plan
included, the interpreter's own start-up left out, as a user's shell adds that to any Python program), and the
process reports which heavy libraries it imported. The median of the runs is printed for the plan and for a
bare `import lorafit`, with the target; the exit code is 1 when torch or transformers was imported.

    python bench/startup.py [--runs 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

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


def time_once(body: str) -> dict:
    """One fresh interpreter running `body`: its seconds and the heavy libraries it imported."""
    program = TIMED.format(body=body, heavy=HEAVY)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"startup bench: the timed program failed:\n{done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(runs: int) -> dict[str, dict]:
    """Median seconds of each program over `runs` fresh interpreters, taking turns, and what they imported."""
    times: dict[str, list[float]] = {name: [] for name in BODIES}
    heavy: dict[str, set[str]] = {name: set() for name in BODIES}
    for _ in range(runs):
        for name, body in BODIES.items():
            result = time_once(body)
            times[name].append(result["seconds"])
            heavy[name] |= set(result["heavy"])
    return {
        name: {"median_s": statistics.median(times[name]), "runs": len(times[name]), "heavy": sorted(heavy[name])}
        for name in BODIES
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh interpreters per program (median)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    results = measure(max(args.runs, 1))
    imported = sorted({name for result in results.values() for name in result["heavy"]})
    if args.json:
        print(json.dumps({"target_s": TARGET_SECONDS, "results": results, "heavy_imported": imported}))
    else:
        for name, result in results.items():
            print(f"{name:<16} {result['median_s']:.3f} s  (median of {result['runs']} fresh processes)")
        plan = results["lorafit plan"]["median_s"]
        verdict = "within" if plan < TARGET_SECONDS else "OVER"
        print(f"target: lorafit plan < {TARGET_SECONDS} s in-process: {verdict}")
        print(f"torch/transformers imported: {', '.join(imported) if imported else 'no'}")
    return 1 if imported else 0


if __name__ == "__main__":
    raise SystemExit(main())
