"""`lorafit data check`: every problem of a dataset, its token statistics, and the sequence length it needs.

The file streams through once; no row's content is kept. Per valid row only its 64-bit hash (for duplicates),
its place and its token count stay, 22 bytes, in flat arrays: a 1 GB JSONL of 1.85 M rows peaks near 100 MiB
where loading it whole takes 3 GiB (`make bench-data` measures both).
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafit.data.dataset import Dataset, Record
from lorafit.data.formats import Format, Messages
from lorafit.data.problems import Problem
from lorafit.data.tokens import TokenCounter, load_counter
from lorafit.messages import say

TOKEN_BATCH_ROWS = 4096  # the Rust tokenizer runs a batch on all cores; 512 rows left it ~40% idle
SEQ_LEN_MULTIPLE = 64
HISTOGRAM_BINS = 12


@dataclass(frozen=True)
class TokenStats:
    total: int
    mean: float
    p50: float
    p95: float
    p99: float
    max: int
    answer_token_share: float | None
    tokenizer: str | None  # None: estimated from characters
    estimate_error: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "mean": round(self.mean, 2),
            "p50": self.p50,
            "p95": self.p95,
            "p99": self.p99,
            "max": self.max,
            "answer_token_share": None if self.answer_token_share is None else round(self.answer_token_share, 4),
            "tokenizer": self.tokenizer,
            "estimated": self.tokenizer is None,
            "estimate_error": self.estimate_error,
        }


@dataclass(frozen=True)
class SeqLenSuggestion:
    """The sequence length that covers the p99 row: a multiple of 64 (suggested) and the power of two."""

    seq_len: int
    power_of_two: int
    covers: float
    truncated_rows: int
    rule: str

    def to_json(self) -> dict[str, Any]:
        return {
            "seq_len": self.seq_len,
            "rule": self.rule,
            "power_of_two": self.power_of_two,
            "truncated_rows": self.truncated_rows,
        }


@dataclass
class CheckReport:
    source: str
    files: list[str]
    format: Format | None
    rows: int
    valid_rows: int
    problems: list[Problem]
    lengths: Sequence[int] = field(repr=False)  # sorted token counts of the valid rows (a numpy array)
    tokens: TokenStats | None = None
    seq_len: int | None = None
    suggestion: SeqLenSuggestion | None = None

    @property
    def rejected_rows(self) -> int:
        return self.rows - self.valid_rows

    @property
    def errors(self) -> int:
        return sum(problem.severity == "error" for problem in self.problems)

    @property
    def warnings(self) -> int:
        return sum(problem.severity == "warning" for problem in self.problems)

    def truncated_rows(self, seq_len: int) -> int:
        return truncated_rows(self.lengths, seq_len)

    def exit_code(self, strict: bool = False) -> int:
        """0 clean, 1 warnings only (with --strict), 2 errors."""
        if self.errors:
            return 2
        return 1 if strict and self.warnings else 0

    def histogram(self, bins: int = HISTOGRAM_BINS) -> tuple[list[int], list[int]]:
        """(edges, counts) of the token lengths, in at most `bins` bins of a round width (1, 2 or 5 x 10^k):
        bin i counts edges[i] <= length < edges[i + 1]."""
        if not len(self.lengths):
            return [], []
        import numpy as np

        low, high = int(self.lengths[0]), int(self.lengths[-1])
        step = _round_step(math.ceil((high - low + 1) / bins))
        while (high // step - low // step + 1) > bins:  # aligning the first edge can add one bin
            step = _round_step(step + 1)
        start = low // step * step
        edges = list(range(start, high + 1, step)) + [high // step * step + step]
        counts, _ = np.histogram(self.lengths, bins=np.asarray(edges) - 0.5)
        return edges, [int(count) for count in counts]

    def to_json(self) -> dict[str, Any]:
        edges, counts = self.histogram()
        return {
            "source": self.source,
            "files": self.files,
            "format": self.format,
            "rows": self.rows,
            "valid_rows": self.valid_rows,
            "rejected_rows": self.rejected_rows,
            "errors": self.errors,
            "warnings": self.warnings,
            "problems": [problem.to_json() for problem in self.problems],
            "tokens": self.tokens.to_json() if self.tokens else None,
            "seq_len": self.seq_len,
            "truncated_rows": self.truncated_rows(self.seq_len) if self.seq_len else None,
            "suggested_seq_len": self.suggestion.to_json() if self.suggestion else None,
            "histogram": {"edges": edges, "counts": counts},
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, ensure_ascii=False)


def check(
    path: str | Path,
    tokenizer: str | TokenCounter | None = None,
    seq_len: int | None = None,
    format: str | None = None,
    mapping: Mapping[str, str] | Iterable[str] | None = None,
) -> CheckReport:
    """Read the whole dataset once and report on it. `tokenizer`: see `load_counter` (None: the estimate)."""
    counter = load_counter(tokenizer) if tokenizer is None or isinstance(tokenizer, str) else tokenizer
    dataset = Dataset(path, format, mapping)
    scan = _Scan(dataset, counter, seq_len)
    for record in dataset:
        scan.add(record)
    return scan.finish()


class _Scan:
    def __init__(self, dataset: Dataset, counter: TokenCounter, seq_len: int | None) -> None:
        self.dataset, self.counter, self.seq_len = dataset, counter, seq_len
        self.rows = 0
        self.rejected = 0
        self.problems: list[Problem] = []
        self.batch: list[Record] = []
        # One entry per valid row, in order: flat arrays, not Python objects.
        self.hashes = array("q")
        self.row_of = array("I")
        self.line_of = array("i")  # -1: no line (Parquet, JSON arrays)
        self.file_of = array("H")
        self.lengths = array("I")
        self.answer_tokens = 0
        self.file_index = {name: index for index, name in enumerate(str(file) for file in dataset.files)}

    def add(self, record: Record) -> None:
        self.problems.extend(record.problems)
        if record.row is None:
            return
        self.rows += 1
        if record.messages is None:
            self.rejected += 1
            return
        self.batch.append(record)
        if len(self.batch) >= TOKEN_BATCH_ROWS:
            self._flush()

    def _flush(self) -> None:
        fmt = self.dataset.format
        counts = self.counter.count([record.messages for record in self.batch], fmt)  # type: ignore[misc]
        for record, count in zip(self.batch, counts, strict=True):
            if count.error is not None:
                self.problems.append(Problem(count.error, "error", record.file, record.line, record.row))
                self.rejected += 1
                continue
            if self.seq_len is not None and count.total > self.seq_len:
                message = say("row.truncated", tokens=count.total, setting="--seq-len", seq_len=self.seq_len)
                self.problems.append(Problem(message, "warning", record.file, record.line, record.row))
            self.hashes.append(conversation_hash(record.messages))  # type: ignore[arg-type]
            self.row_of.append(record.row)  # type: ignore[arg-type]
            self.line_of.append(-1 if record.line is None else record.line)
            self.file_of.append(self.file_index[record.file])
            self.lengths.append(count.total)
            self.answer_tokens += count.answer
        self.batch.clear()

    def _duplicates(self) -> list[Problem]:
        """Rows whose conversation equals an earlier one. Sorting a copy of the hashes finds the repeated
        values; only the rows holding those are looked at again (no argsort: 8 bytes a row, not 16)."""
        import numpy as np

        hashes = np.frombuffer(self.hashes, dtype=np.int64)
        if hashes.size < 2:
            return []
        ordered = np.sort(hashes)
        repeated = np.unique(ordered[1:][ordered[1:] == ordered[:-1]])
        del ordered
        if repeated.size == 0:
            return []
        files = [str(file) for file in self.dataset.files]
        first_of: dict[int, int] = {}
        problems = []
        for index in np.flatnonzero(np.isin(hashes, repeated)):
            index = int(index)
            first = first_of.setdefault(int(hashes[index]), index)
            if first == index:
                continue
            line, first_line = self.line_of[index], self.line_of[first]
            row = self.row_of[first]
            if self.file_of[first] == self.file_of[index]:
                said = (
                    say("row.duplicate_line", row=row, line=first_line)
                    if first_line >= 0
                    else say("row.duplicate", row=row)
                )
            else:
                other = files[self.file_of[first]]
                said = (
                    say("row.duplicate_line_file", row=row, line=first_line, file=other)
                    if first_line >= 0
                    else say("row.duplicate_file", row=row, file=other)
                )
            file = files[self.file_of[index]]
            problems.append(Problem(said, "warning", file, None if line < 0 else line, self.row_of[index]))
        return problems

    def finish(self) -> CheckReport:
        if self.batch:
            self._flush()
        problems = self.problems + self._duplicates()
        if self.rows == 0 and not any(problem.row is None for problem in problems):
            problems.append(Problem(say("row.empty_dataset"), "error", str(self.dataset.path)))
        problems.sort(key=lambda problem: -1 if problem.row is None else problem.row)
        import numpy as np

        lengths = np.sort(np.frombuffer(self.lengths, dtype=np.uint32))
        report = CheckReport(
            source=str(self.dataset.path),
            files=[str(file) for file in self.dataset.files],
            format=self.dataset.format,
            rows=self.rows,
            valid_rows=self.rows - self.rejected,
            problems=problems,
            lengths=lengths,
            seq_len=self.seq_len,
        )
        if len(lengths):
            report.tokens = token_stats(lengths, self.answer_tokens, self.counter.name, self.counter.estimate_error)
            report.suggestion = suggest_seq_len(lengths, report.tokens.p99)
        return report


def conversation_hash(messages: Messages) -> int:
    """64 bits that are equal for equal conversations (Python's string hash: fast, stable within a process)."""
    parts: list[str] = []
    for message in messages:
        parts += (message["role"], message["content"])
        if len(message) > 2:  # tool calls: rare, so the slow exact form is fine
            parts.append(json.dumps(message, sort_keys=True, default=str))
    return hash("\x00".join(parts))


def _round_step(width: int) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, ... that is at least `width`."""
    scale = 1
    while True:
        for factor in (1, 2, 5):
            if factor * scale >= width:
                return factor * scale
        scale *= 10


def quantile(sorted_lengths: Sequence[int], q: float) -> float:
    """Linear-interpolated quantile (numpy's default), on already sorted values."""
    position = (len(sorted_lengths) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(sorted_lengths) - 1)
    below, above = int(sorted_lengths[low]), int(sorted_lengths[high])
    return float(below + (above - below) * (position - low))


def token_stats(
    sorted_lengths: Sequence[int], answer_tokens: int, tokenizer: str | None, estimate_error: float | None
) -> TokenStats:
    """Total, mean, quantiles, max and answer share of non-empty, ascending token counts."""
    import numpy as np

    total = int(np.asarray(sorted_lengths).sum(dtype=np.int64))
    return TokenStats(
        total=total,
        mean=total / len(sorted_lengths),
        p50=quantile(sorted_lengths, 0.50),
        p95=quantile(sorted_lengths, 0.95),
        p99=quantile(sorted_lengths, 0.99),
        max=int(sorted_lengths[-1]),
        answer_token_share=answer_tokens / total if total else None,
        tokenizer=tokenizer,
        estimate_error=estimate_error,
    )


def suggest_seq_len(sorted_lengths: Sequence[int], p99: float) -> SeqLenSuggestion:
    """Cover the p99 row, rounded up to a multiple of 64 (kernels and packing like it; a power of two often
    wastes up to half the memory). The 1% longest rows are truncated; the report says how many."""
    covered = max(1, math.ceil(p99))
    seq_len = SEQ_LEN_MULTIPLE * math.ceil(covered / SEQ_LEN_MULTIPLE)
    power_of_two = max(SEQ_LEN_MULTIPLE, 2 ** math.ceil(math.log2(covered)))
    return SeqLenSuggestion(
        seq_len=seq_len,
        power_of_two=power_of_two,
        covers=0.99,
        truncated_rows=truncated_rows(sorted_lengths, seq_len),
        rule=f"p99 ({covered} tokens) rounded up to a multiple of {SEQ_LEN_MULTIPLE}",
    )


def truncated_rows(sorted_lengths: Sequence[int], seq_len: int) -> int:
    """How many rows are longer than seq_len (lengths sorted ascending)."""
    import numpy as np

    return int(len(sorted_lengths) - np.searchsorted(np.asarray(sorted_lengths), seq_len, side="right"))
