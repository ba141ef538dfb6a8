"""`make bench-serve`: how fast `lorafit serve` answers a plan, server-side, against the planner called directly.

Starts the server in this process, asks /api/plan for the two headline cases (7B QLoRA on an RTX 4090 and on an
RTX 4060 Ti 16 GB), the 8 GB plan with the savers and the GPU comparison, and reads each answer's server time from
its Server-Timing header; beside it, the same answers from `lorafit.answers.plan` called directly, taking turns.
Every request starts cold: the memo caches of the model shapes and per-layer activations are emptied first, so a
repeat is timed as a first request would be. The goal: a plan request
under 50 ms server-side (median and p95); the ratio says what the web layer adds.

    python bench/serve.py [--repeats 40] [--out bench/results/serve.json]
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

from lorafit import answers, memory, models

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "results" / "serve.json"
GOAL_MS = 50.0
CASES = {
    "7b qlora, RTX 4090": {"model": "llama-2-7b", "gpu": "RTX 4090"},
    "7b qlora, RTX 4060 Ti 16GB": {"model": "llama-2-7b", "gpu": "RTX 4060 Ti 16GB"},
    "8b qlora, 8 GB (savers)": {"model": "llama-3.1-8b", "vram": "8"},
}
COMPARE = {"model": "llama-2-7b", "compare": "true"}


def start_server() -> tuple[str, object]:
    import uvicorn

    from lorafit.web import create_app

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


def cold() -> None:
    models._memoised.cache_clear()
    memory.activation_bytes_per_layer.cache_clear()


def served_ms(base: str, query: dict[str, str]) -> tuple[float, float]:
    """(server-side ms from Server-Timing, round trip ms)."""
    cold()
    started = time.perf_counter()
    with urllib.request.urlopen(f"{base}/api/plan?{urllib.parse.urlencode(query)}") as response:
        response.read()
        timing = response.headers["Server-Timing"]
    round_trip = (time.perf_counter() - started) * 1000
    return float(re.search(r"dur=([0-9.]+)", timing).group(1)), round_trip


def direct_ms(query: dict[str, str]) -> float:
    given = {k: v for k, v in query.items() if k != "compare"}
    cold()
    started = time.perf_counter()
    answers.plan(given, compare="compare" in query).to_json()
    return (time.perf_counter() - started) * 1000


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median_ms": round(statistics.median(ordered), 2),
        "p95_ms": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    base, server = start_server()
    rows = []
    print(f"{'request':<30} {'served p50':>10} {'p95':>8} {'direct p50':>10} {'ratio':>6} {'round trip':>10} goal")
    for label, query in [*CASES.items(), ("GPU comparison (every card)", COMPARE)]:
        repeats = args.repeats if "compare" not in query else max(3, args.repeats // 10)
        served_ms(base, query), direct_ms(query)  # warm both paths
        served, trips, direct = [], [], []
        for _ in range(repeats):  # taking turns, so both see the same machine
            server_side, trip = served_ms(base, query)
            served.append(server_side)
            trips.append(trip)
            direct.append(direct_ms(query))
        row = {
            "request": label,
            "query": query,
            "repeats": repeats,
            "served": summary(served),
            "direct": summary(direct),
            "round_trip": summary(trips),
            "ratio_served_to_direct": round(statistics.median(served) / statistics.median(direct), 3),
        }
        is_plan = "compare" not in query
        row["goal_met"] = row["served"]["p95_ms"] < GOAL_MS if is_plan else None
        rows.append(row)
        goal = ("yes" if row["goal_met"] else "no") if is_plan else "-"
        print(
            f"{label:<30} {row['served']['median_ms']:10.1f} {row['served']['p95_ms']:8.1f} "
            f"{row['direct']['median_ms']:10.1f} {row['ratio_served_to_direct']:6.2f} "
            f"{row['round_trip']['median_ms']:10.1f} {goal}"
        )
    server.should_exit = True
    print(f"\nms; goal: a plan request under {GOAL_MS:.0f} ms server-side at p95 (the comparison has no goal)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"goal_ms": GOAL_MS, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
