"""The token profile the planner reads: how long the rows are, and how many a sequence length would cut.

`TokenProfile` (in lorafit.schema) holds quantiles only; `profile_of_lengths` is the one place it is built, for a
file (`length_profile`, `token_profile`) and for the tokens the trainer rendered (`train.examples.token_profile`).
For an exact count of the rows a sequence length truncates, `length_profile` also returns the sorted lengths;
`truncated_rows` takes either.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lorafit.data.check import TokenStats, check, token_stats
from lorafit.data.check import truncated_rows as _count_above
from lorafit.data.problems import Problem
from lorafit.data.tokens import TokenCounter, load_counter
from lorafit.errors import DataError
from lorafit.messages import say
from lorafit.schema import TokenProfile


@dataclass(frozen=True)
class LengthProfile:
    """A TokenProfile plus the sorted token length of every valid row (a numpy int64 array), and where rows with
    errors were skipped (`skip_bad_rows`), how many and the errors `lorafit data check` reports for them."""

    profile: TokenProfile
    lengths: Sequence[int] = field(repr=False)
    skipped_rows: int = 0
    skipped_because: tuple[Problem, ...] = ()

    def truncated_rows(self, seq_len: int) -> int:
        return _count_above(self.lengths, seq_len)


def length_profile(
    path: str | Path,
    tokenizer: str | TokenCounter | None = None,
    format: str | None = None,
    mapping: Mapping[str, str] | Iterable[str] | None = None,
    seq_len: int | None = None,
    skip_bad_rows: bool = False,
) -> LengthProfile:
    """Check the dataset and profile its valid rows. Raises DataError, as the trainer would, if any row has an
    error (the message names the first and the command that lists them all); with `skip_bad_rows` (a plan of
    the rows that are sound: the web page's upload) only if no row is sound."""
    counter = load_counter(tokenizer) if tokenizer is None or isinstance(tokenizer, str) else tokenizer
    report = check(path, tokenizer=counter, seq_len=seq_len, format=format, mapping=mapping)
    errors = [problem for problem in report.problems if problem.severity == "error"]
    if errors and not (skip_bad_rows and report.valid_rows):
        first = errors[0]
        error_rows = len({(problem.file, problem.row) for problem in errors})
        where, problem = first.where(), first.message
        raise DataError(
            say("data.bad_rows_more", where=where, problem=problem, more=error_rows - 1, path=path)
            if error_rows > 1
            else say("data.bad_rows", where=where, problem=problem, path=path)
        )
    if report.tokens is None:
        raise DataError(say("data.no_rows_profile", path=path))
    profile = _profile(report.tokens, str(path), report.valid_rows, counter.basis)
    return LengthProfile(profile, report.lengths, report.rejected_rows, tuple(errors))


def profile_of_lengths(
    lengths: Sequence[int],
    source: str,
    *,
    answer_tokens: int,
    tokenizer: str | None,
    estimate_error: float | None = None,
    basis: str | None = None,
) -> TokenProfile:
    """The TokenProfile of one token count per row (any order): the trainer's, from the exact tokens it renders,
    is built here as `length_profile`'s is, so the planner reads the same figures from either."""
    if not len(lengths):
        raise DataError(f"{source} has no rows to profile")
    import numpy as np

    ordered = np.sort(np.asarray(lengths, dtype=np.int64))
    return _profile(token_stats(ordered, answer_tokens, tokenizer, estimate_error), source, len(ordered), basis)


def _profile(stats: TokenStats, source: str, rows: int, basis: str | None = None) -> TokenProfile:
    return TokenProfile(
        source=source,
        rows=rows,
        total_tokens=stats.total,
        mean=stats.mean,
        p50=stats.p50,
        p95=stats.p95,
        p99=stats.p99,
        max=stats.max,
        tokenizer=stats.tokenizer,
        estimate_error=stats.estimate_error,
        answer_token_share=stats.answer_token_share,
        basis=basis,
    )


def token_profile(
    path: str | Path,
    tokenizer: str | TokenCounter | None = None,
    format: str | None = None,
    mapping: Mapping[str, str] | Iterable[str] | None = None,
    seq_len: int | None = None,
) -> TokenProfile:
    """The planner's view of a dataset (tokenizer None: estimated from characters, with `estimate_error`)."""
    return length_profile(path, tokenizer, format, mapping, seq_len).profile


def truncated_rows(profile_or_lengths: LengthProfile | TokenProfile | Sequence[int], seq_len: int) -> int:
    """Rows longer than seq_len. Exact for a LengthProfile or a list of lengths; for a bare TokenProfile an
    estimate, interpolating between its quantiles (p50, p95, p99, max)."""
    if isinstance(profile_or_lengths, LengthProfile):
        return profile_or_lengths.truncated_rows(seq_len)
    if isinstance(profile_or_lengths, TokenProfile):
        return _estimate_above(profile_or_lengths, seq_len)
    return _count_above(sorted(profile_or_lengths), seq_len)


def _estimate_above(profile: TokenProfile, seq_len: int) -> int:
    if seq_len >= profile.max or profile.rows == 0:
        return 0
    points = [
        (0.0, 0.0),
        (profile.p50, 0.50),
        (profile.p95, 0.95),
        (profile.p99, 0.99),
        (float(profile.max), 1.0),
    ]
    below = 0.0
    for (low, low_share), (high, high_share) in zip(points, points[1:], strict=False):
        if seq_len < high:
            span = high - low
            below = low_share + (high_share - low_share) * ((seq_len - low) / span if span else 1.0)
            break
    # At least the longest row is cut when seq_len < max.
    return max(1, math.ceil(profile.rows * (1.0 - below) - 1e-9))
