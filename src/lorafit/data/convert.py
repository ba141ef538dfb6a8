"""`lorafit data convert`: the rows that pass, written in one normalized format, all or nothing.

The output is written to a temporary file next to it and renamed into place, so a crash or a full disk never
leaves half a file, and the input is never touched.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafit.data.dataset import Dataset
from lorafit.data.formats import TARGETS, Format, Target, from_messages
from lorafit.data.outputs import output_path
from lorafit.data.problems import Problem
from lorafit.errors import DataError
from lorafit.files import atomic_writer

# What OUT may end in: JSON Lines, which lorafit and `datasets` also read from a .json file.
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")


@dataclass
class ConvertReport:
    source: str
    output: str
    format: Format | None
    to: Target
    rows: int = 0
    written: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def rejected(self) -> int:
        return self.rows - self.written

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "output": self.output,
            "format": self.format,
            "to": self.to,
            "rows": self.rows,
            "written": self.written,
            "rejected": self.rejected,
            "problems": [problem.to_json() for problem in self.problems],
        }


def convert(
    source: str | Path,
    output: str | Path,
    to: str,
    format: str | None = None,
    mapping: Mapping[str, str] | Iterable[str] | None = None,
    overwrite: bool = False,
) -> ConvertReport:
    """Write each row of `source` that has no error as JSONL in `to`; the report counts and lists the rest."""
    if to not in TARGETS:
        raise DataError(f"--to {to}: expected one of {', '.join(TARGETS)}")
    source = Path(source)
    output = output_path(
        output, source, label="output", what="convert writes JSON Lines", suffixes=JSONL_SUFFIXES, name_suffix=f"-{to}"
    )
    if output.exists() and not overwrite:
        raise DataError(f"{output} exists; pass --overwrite to replace it")
    dataset = Dataset(source, format, mapping)
    if dataset.format == "text":
        raise DataError(f"{source} is raw text: it has no turns to convert; train on it as it is (--format text)")
    report = ConvertReport(str(source), str(output), dataset.format, to)  # type: ignore[arg-type]
    unholdable = 0  # valid rows that `to` cannot hold
    try:
        with atomic_writer(output) as handle:
            for record in dataset:
                report.problems.extend(record.problems)
                if record.row is None:
                    continue
                report.rows += 1
                if record.messages is None:
                    continue
                try:
                    converted = from_messages(record.messages, to)  # type: ignore[arg-type]
                except ValueError as error:
                    report.problems.append(Problem(str(error), "error", record.file, record.line, record.row))
                    unholdable += 1
                    continue
                handle.write(json.dumps(converted, ensure_ascii=False) + "\n")
                report.written += 1
            if not report.written:
                raise _NothingToWrite  # leaves OUT as it was: an empty file is not a dataset
    except _NothingToWrite:
        raise DataError(_nothing_written(report, unholdable)) from None
    except OSError as error:
        raise DataError(f"cannot write {output}: {error.strerror or error}") from None
    return report


class _NothingToWrite(Exception):
    """Aborts the atomic write when no row passed, so no empty output is left behind."""


def _nothing_written(report: ConvertReport, unholdable: int) -> str:
    """One line, worded as `lorafit data check` words the same dataset: no rows, or why none passed.
    `unholdable`: rows that passed the checks but that the target cannot hold (`data check` does not list them)."""
    errors = [problem for problem in report.problems if problem.severity == "error"]
    if not errors:
        return f"{report.source} has no rows: the dataset is empty; nothing written"
    first = errors[0]
    if report.rows == 0:
        verdict = "no row can be read"
    elif report.rows == 1:
        verdict = f"its one row cannot be written as {report.to}"
    else:
        verdict = f"none of its {report.rows:,} rows can be written as {report.to}"
    checked = len(errors) > unholdable
    hint = f"; run `lorafit data check {report.source}` for the full list" if checked else ""
    return f"{report.source}: {verdict} (first: {first.where()}: {first.message}); nothing written{hint}"
