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
from lorafit.data.problems import Problem
from lorafit.errors import DataError
from lorafit.files import atomic_writer


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
    source, output = Path(source), Path(output)
    if output.exists() and _same_file(source, output):
        raise DataError(f"{output} is the input; write the converted rows to another file")
    if source.is_dir() and output.resolve().is_relative_to(source.resolve()):
        raise DataError(f"{output} is inside the input directory {source}; write it somewhere else")
    if output.exists() and not overwrite:
        raise DataError(f"{output} exists; pass --overwrite to replace it")
    if output.exists() and output.is_dir():
        raise DataError(f"{output} is a directory; name the output file")
    dataset = Dataset(source, format, mapping)
    if dataset.format == "text":
        raise DataError(f"{source} is raw text: it has no turns to convert; train on it as it is (--format text)")
    report = ConvertReport(str(source), str(output), dataset.format, to)  # type: ignore[arg-type]
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
                    continue
                handle.write(json.dumps(converted, ensure_ascii=False) + "\n")
                report.written += 1
    except OSError as error:
        raise DataError(f"cannot write {output}: {error.strerror or error}") from None
    return report


def _same_file(first: Path, second: Path) -> bool:
    try:
        return first.samefile(second)
    except OSError:
        return False
