"""One row's problem, located so a user can open the file at the right place and fix it.

Errors reject the row (it is not trained on and not converted); warnings keep it but are worth a look.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from lorafit.messages import say

Severity = Literal["error", "warning"]


@dataclass(frozen=True, slots=True)
class Problem:
    """What is wrong, and where: `line` is 1-based in the file (None where a file has no lines, e.g. Parquet),
    `row` is the 0-based record index across the whole dataset (None for a problem with the file itself)."""

    message: str
    severity: Severity = "error"
    file: str | None = None
    line: int | None = None
    row: int | None = None
    field: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def where(self) -> str:
        """'data.jsonl:12 (row 11)' — for one-line messages."""
        place = self.file or "data"
        if self.line is not None:
            place += f":{self.line}"
        if self.row is not None:
            place = say("row.where", place=place, row=self.row)
        return place
