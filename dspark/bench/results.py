"""Benchmark results: one versioned JSON schema for every layer (micro, model, system).

A result carries what is needed to read it later without the code that made it: the machine
(CPU model, instruction sets, cores, clock, FMA peak), the git revision, the command and its
settings, the rows (one per measured point) with the columns to print them, which row fields
identify a point across runs (``key_fields``), which metrics `bench compare` checks and in which
direction (``metrics``), and per row the relative noise band of each metric (``row["band"]``),
measured from the repeats of that run.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from dspark.bench.jsonfile import read_json
from dspark.bench.machine import cpu_class, git_revision, this_machine
from dspark.bench.table import Column, format_table
from dspark.errors import ConfigError

SCHEMA = "dspark-bench"
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Metric:
    """A metric `bench compare` checks: higher or lower is better."""

    key: str
    better: str  # "higher" | "lower"

    def __post_init__(self) -> None:
        if self.better not in ("higher", "lower"):
            raise ValueError(f"Metric {self.key}: better must be 'higher' or 'lower', not {self.better!r}")


@dataclass
class BenchResult:
    benchmark: str                 # "micro/fused", "model", "system", ...
    settings: dict
    rows: list[dict]
    columns: list[Column] = field(default_factory=list)
    key_fields: list[str] = field(default_factory=list)
    metrics: list[Metric] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    series: dict = field(default_factory=dict)     # time series and raw data (resources, windows)
    group_by: str | None = None                     # print one table per value of this field
    machine: dict = field(default_factory=lambda: this_machine().to_json())
    git: dict = field(default_factory=git_revision)
    command: str = field(default_factory=lambda: shlex.join(["dspark", *sys.argv[1:]])
                         if Path(sys.argv[0]).name == "dspark" else shlex.join(sys.argv))
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    load_average: float | None = field(default_factory=lambda: round(os.getloadavg()[0], 1)
                                       if hasattr(os, "getloadavg") else None)

    def table(self, markdown: bool = False) -> str:
        """The rows as one table, or one per ``group_by`` value, each with the columns it fills."""
        if not self.group_by:
            return format_table(self.rows, self.columns or None, markdown=markdown)
        groups: dict = {}
        for row in self.rows:
            groups.setdefault(row.get(self.group_by), []).append(row)
        return "\n\n".join(format_table(rows, [c for c in self.columns if any(r.get(c.key) is not None for r in rows)],
                                         markdown=markdown) for rows in groups.values())

    def key_of(self, row: dict) -> tuple:
        return tuple(row.get(k) for k in self.key_fields)

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "benchmark": self.benchmark,
            "created": self.created, "load_average": self.load_average, "command": self.command, "git": self.git, "machine": self.machine,
            "settings": self.settings, "key_fields": self.key_fields,
            "metrics": [[m.key, m.better] for m in self.metrics],
            "columns": [c.to_json() for c in self.columns], "notes": self.notes,
            "rows": self.rows, "series": self.series, "group_by": self.group_by,
        }

    @classmethod
    def from_json(cls, data: Any, path: Path | str | None = None) -> "BenchResult":
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise ConfigError("schema", f"not a dspark benchmark result (expected \"schema\": \"{SCHEMA}\")", path)
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ConfigError("schema_version", f"{version!r} is not supported by this dspark "
                              f"(reads {SCHEMA_VERSION}); re-run the benchmark or use the matching dspark", path)
        try:
            return cls(
                benchmark=data["benchmark"], settings=data["settings"], rows=list(data["rows"]),
                columns=[Column.from_json(c) for c in data.get("columns", [])],
                key_fields=list(data.get("key_fields", [])),
                metrics=[Metric(*m) for m in data.get("metrics", [])], notes=list(data.get("notes", [])),
                series=data.get("series", {}), machine=data.get("machine", {}), git=data.get("git", {}),
                command=data.get("command", ""), created=data.get("created", ""),
                load_average=data.get("load_average"), group_by=data.get("group_by"))
        except KeyError as missing:
            raise ConfigError(str(missing.args[0]), "missing from the result", path) from None
        except (TypeError, ValueError) as error:
            raise ConfigError("metrics", str(error), path) from None

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1, default=_jsonable) + "\n")
        return path


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def load(path: Path) -> BenchResult:
    return BenchResult.from_json(read_json(path), path)


def header_line(result: BenchResult) -> str:
    """One line naming the machine and revision, printed above every table."""
    m = result.machine
    commit = (result.git.get("commit") or "unknown")[:10] + ("+dirty" if result.git.get("dirty") else "")
    load = f"; load average {result.load_average:g}" if result.load_average is not None else ""
    isa = f" ({cpu_class(m.get('vendor', ''), m.get('family', 0), m['isa'])})" if m.get("isa") is not None else ""
    return f"{m.get('cpu_model', '?')}{isa}, {m.get('cores', '?')} cores; git {commit}; {result.created}{load}"


def relative_band(values: Sequence[float]) -> float:
    """Half the spread of repeated measurements relative to their median: the noise band."""
    finite = sorted(v for v in values if v == v)
    if len(finite) < 2:
        return 0.0
    mid = finite[len(finite) // 2] if len(finite) % 2 else (finite[len(finite) // 2 - 1] + finite[len(finite) // 2]) / 2
    return (finite[-1] - finite[0]) / 2 / abs(mid) if mid else 0.0
