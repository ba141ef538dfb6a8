"""`make bench-data`: `lorafit data check` streams a large JSONL in flat memory, and how good the character
estimate is.

1. Generates a JSONL of --size-gb (default 1 GB) of chat rows built from English text every Python ships, with a
   few broken rows, in a temp dir.
2. Checks it, and its first eighth, each in a fresh subprocess: rows/s and peak RSS. Flat memory shows as the
   same peak for 1/8 and all of the file, far below the peak of simply loading the file whole (json.loads of
   every line into one list), measured the same way.
3. Counts the first eighth with a real tokenizer (the BPE of step 4) to show tokenizer throughput.
4. Trains a 32,000-token byte-level BPE on half of that English corpus and measures the ~4 chars/token estimate
   on the other half (the figure CHAR_ESTIMATE_ERROR in src/lorafit/data/tokens.py records).

    python bench/data_stream.py [--size-gb 1.0] [--estimate-only] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lorafit.data.estimate import english_corpus, measure_char_estimate, train_bpe
from lorafit.data.tokens import CHAR_ESTIMATE_ERROR, CHARS_PER_TOKEN

BROKEN_EVERY = 50_000  # one invalid-JSON line and one empty answer per this many rows
SEED = 0

# Each measurement runs in a child so its peak RSS is its own; the child prints one JSON line.
CHILD_CHECK = """
import json, resource, sys, time
from lorafit.data.check import check
from lorafit.data.tokens import load_counter
counter = load_counter(sys.argv[2] if len(sys.argv) > 2 else None)  # importing transformers is not counted
start = time.perf_counter()
report = check(sys.argv[1], tokenizer=counter)
seconds = time.perf_counter() - start
print(json.dumps({"rows": report.rows, "problems": len(report.problems), "seconds": seconds,
                  "tokens": report.tokens.total if report.tokens else 0,
                  "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""
CHILD_LOAD_WHOLE = """
import json, resource, sys, time
start = time.perf_counter()
rows = []
with open(sys.argv[1], "rb") as handle:
    for line in handle:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
seconds = time.perf_counter() - start
print(json.dumps({"rows": len(rows), "seconds": seconds,
                  "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""
CHILD_BASELINE = """
import json, resource
import numpy
import lorafit.data.check
print(json.dumps({"peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def generate(path: Path, size_bytes: int, corpus: list[str]) -> tuple[int, int]:
    """Unique messages-format rows until the file reaches size_bytes; returns (rows, broken rows)."""
    rng = random.Random(SEED)
    rows = broken = 0
    written = 0
    with path.open("w", encoding="utf-8") as out:
        while written < size_bytes:
            if rows % BROKEN_EVERY == BROKEN_EVERY - 1:
                line = '{"messages": [{"role": "user", "content": "cut off here\n'
                broken += 1
            else:
                messages = [
                    {"role": "user", "content": f"Question {rows}: explain this.\n\n{rng.choice(corpus)}"},
                    {"role": "assistant", "content": "" if rows % BROKEN_EVERY == 7 else rng.choice(corpus)},
                ]
                broken += rows % BROKEN_EVERY == 7
                if rows % 3 == 0:
                    messages.insert(0, {"role": "system", "content": "You are a patient Python tutor."})
                line = json.dumps({"messages": messages}, ensure_ascii=False) + "\n"
            out.write(line)
            written += len(line.encode("utf-8"))
            rows += 1
    return rows, broken


def head(source: Path, target: Path, fraction: float) -> None:
    """The first `fraction` of source's bytes, cut at a line end."""
    limit = int(source.stat().st_size * fraction)
    with source.open("rb") as src, target.open("wb") as out:
        copied = 0
        for line in src:
            if copied >= limit:
                break
            out.write(line)
            copied += len(line)


def child(code: str, *args: str) -> dict:
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"bench child failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def mib(kib: int) -> str:
    return f"{kib / 1024:,.0f} MiB"


def estimate_section(corpus: list[str], tokenizer_dir: Path | None) -> None:
    print(f"\n== the character estimate (~{CHARS_PER_TOKEN:.0f} chars/token) against a real BPE ==")
    start = time.perf_counter()
    counter = train_bpe(corpus[0::2], 32000)
    accuracy = measure_char_estimate(corpus[1::2], counter)
    print(f"corpus: {len(corpus):,} rows of English from Python {sys.version.split()[0]}'s standard library")
    print(
        f"byte-level BPE, 32,000 tokens, trained on the even rows, counted on {accuracy.rows:,} odd rows "
        f"({time.perf_counter() - start:.1f} s)"
    )
    print(f"  measured characters per token:          {accuracy.chars_per_token:.2f}")
    print(
        f"  per-row error, rows >= 64 tokens:      {accuracy.long_row_error:.1%}   "
        f"(CHAR_ESTIMATE_ERROR = {CHAR_ESTIMATE_ERROR:.0%})"
    )
    print(f"  per-row error, all rows (mean / p95):  {accuracy.mean_error:.1%} / {accuracy.p95_error:.1%}")
    print(f"  error of the total token count:        {accuracy.total_error:+.1%}")
    print(f"  error of the p99 row length:           {accuracy.p99_error:+.1%}")
    if tokenizer_dir is not None:
        counter.tokenizer.save_pretrained(tokenizer_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="size of the generated JSONL (default 1)")
    parser.add_argument("--estimate-only", action="store_true", help="only measure the character estimate")
    parser.add_argument("--keep", type=Path, help="generate into this folder and keep it")
    args = parser.parse_args()

    corpus = english_corpus()
    if args.estimate_only:
        estimate_section(corpus, None)
        return
    folder = args.keep or Path(tempfile.mkdtemp(prefix="lorafit-bench-data-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        big, small = folder / "chat.jsonl", folder / "chat-eighth.jsonl"
        start = time.perf_counter()
        rows, broken = generate(big, int(args.size_gb * 1024**3), corpus)
        head(big, small, 1 / 8)
        size = big.stat().st_size
        print(
            f"== streaming check: {big} ({size / 1024**3:.2f} GiB, {rows:,} rows, "
            f"generated in {time.perf_counter() - start:.0f} s) =="
        )
        baseline = child(CHILD_BASELINE)
        eighth = child(CHILD_CHECK, str(small))
        whole_check = child(CHILD_CHECK, str(big))
        whole_load = child(CHILD_LOAD_WHOLE, str(big))
        print(f"{'':34}{'rows':>12}{'rows/s':>12}{'MB/s':>8}{'peak RSS':>12}")
        print(f"{'python + lorafit.data imported':34}{'':>12}{'':>12}{'':>8}{mib(baseline['peak_rss_kib']):>12}")
        for label, run, nbytes in (
            ("check, first 1/8 of the file", eighth, small.stat().st_size),
            ("check, whole file", whole_check, size),
            ("json.loads every line into a list", whole_load, size),
        ):
            print(
                f"{label:34}{run['rows']:>12,}{run['rows'] / run['seconds']:>12,.0f}"
                f"{nbytes / 1e6 / run['seconds']:>8,.0f}{mib(run['peak_rss_kib']):>12}"
            )
        growth = whole_check["peak_rss_kib"] - eighth["peak_rss_kib"]
        print(
            f"check on 8x the data: peak RSS +{mib(growth)}; loading whole needs "
            f"{whole_load['peak_rss_kib'] / whole_check['peak_rss_kib']:.1f}x the check's peak"
        )
        print(
            f"problems found in the whole file: {whole_check['problems']:,} "
            f"(planted: {broken:,}; any others are duplicate rows)"
        )

        tokenizer_dir = folder / "bpe-32k"
        estimate_section(corpus, tokenizer_dir)
        print("\n== the same check with that tokenizer (first 1/8 of the file) ==")
        run = child(CHILD_CHECK, str(small), str(tokenizer_dir))
        print(
            f"{run['rows']:,} rows, {run['tokens']:,} tokens in {run['seconds']:.1f} s: "
            f"{run['rows'] / run['seconds']:,.0f} rows/s, {run['tokens'] / run['seconds']:,.0f} tokens/s, "
            f"peak RSS {mib(run['peak_rss_kib'])}"
        )
    finally:
        if args.keep is None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
