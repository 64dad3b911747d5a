"""The one table printer of every benchmark: plain text for the terminal, Markdown for docs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence


@dataclass(frozen=True)
class Column:
    """A column: the row field it shows, its title, and a format spec (``.2f``, ``.1%``, ``,d``)."""

    key: str
    title: str = ""
    fmt: str = ""

    @property
    def heading(self) -> str:
        return self.title or self.key

    def cell(self, row: dict) -> str:
        value = row.get(self.key)
        if value is None or (isinstance(value, float) and value != value):
            return "-"
        if self.fmt and isinstance(value, (int, float)) and not isinstance(value, bool):
            return format(value, self.fmt)
        if isinstance(value, (list, tuple)):
            return "/".join(format(v, self.fmt) if self.fmt and isinstance(v, (int, float)) else str(v)
                            for v in value)
        return str(value)

    def to_json(self) -> list[str]:
        return [self.key, self.title, self.fmt]

    @classmethod
    def from_json(cls, data: Any) -> "Column":
        return cls(*data) if isinstance(data, (list, tuple)) else cls(str(data))


def columns_for(rows: Sequence[dict]) -> list[Column]:
    """Every field of the rows, in first-seen order, numbers with up to 3 decimals."""
    keys = list(dict.fromkeys(k for row in rows for k in row if not isinstance(row[k], dict)))
    floats = {k for row in rows for k in keys if isinstance(row.get(k), float)}
    return [Column(k, k, ".3g" if k in floats else "") for k in keys]


def format_table(rows: Sequence[dict], columns: Iterable[Column] | None = None, markdown: bool = False) -> str:
    columns = list(columns) if columns is not None else columns_for(rows)
    cells = [[c.cell(row) for c in columns] for row in rows]
    headings = [c.heading for c in columns]
    if markdown:
        lines = ["| " + " | ".join(headings) + " |", "|" + "|".join("---" for _ in columns) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in cells]
        return "\n".join(lines)
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headings)]
    lines = [" | ".join(h.rjust(w) for h, w in zip(headings, widths)),
             "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)
