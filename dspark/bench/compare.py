"""`bench compare BASE NEW`: the check step of plan-do-check-act.

Rows of the two results are matched by the result's key fields (e.g. model, protocol, level).
For each metric the result declares (and both rows have), the ratio NEW/BASE is set against a
noise band: the root-sum-square of the two rows' relative bands (the spread of the windows or
rounds of each run, and, when BASE or NEW is a folder of repeated runs, the spread across those
runs), at least ``min_band``. A change beyond the band in the bad direction is a regression.
With one run on each side and no ``min_band`` given, the band is only the spread inside each
run, which says nothing of how far two runs differ (two runs of one model differed 2.95x at p99
on a busy machine, with bands of ±4 %): a change beyond it is ``unsure``, not a regression.
A target must be met: a change the ratio must reach (``qps=+20%``, ``p99=-10%``), a bound on
the ratio (``p99<=2x``, ``goodput>=0.97x``: NEW may be up to that much worse), or a bound on
NEW's own value (``within_deadline>=0.995``, ``added_p50_ms<1``). Either failing makes the
comparison fail. ``select`` keeps the rows with given field values, so rows of one result can
be compared with each other (a router's rows against FIFO's in the same run).
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from dspark.bench.results import BenchResult, Metric, load, relative_band
from dspark.bench.table import Column, format_table
from dspark.errors import ConfigError

CHANGE = re.compile(r"^\s*([A-Za-z0-9_.]+)\s*=\s*([+-]?\d+(?:\.\d+)?)\s*%\s*$")
BOUND = re.compile(r"^\s*([A-Za-z0-9_.]+)\s*(<=|>=|<|>)\s*(\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)\s*(x?)\s*$")
ABSOLUTE_ZERO_TOLERANCE = 1e-3  # a metric whose base is 0 (error rate) regresses beyond this
DEFAULT_MIN_BAND = 0.02
OPERATORS = {">=": float.__ge__, "<=": float.__le__, ">": float.__gt__, "<": float.__lt__}


@dataclass(frozen=True)
class Target:
    """What NEW must reach: ``op bound`` on NEW/BASE (``of_base``) or on NEW's own value.
    ``qps=+20%`` is ``>= 1.2`` of the base and must also not regress; ``p99<=2x`` is a
    tolerance (up to 2x the base is fine); ``within_deadline>=0.995`` is on the value alone."""

    metric: str
    op: str
    bound: float
    of_base: bool = True
    text: str = ""

    @property
    def is_change(self) -> bool:
        return self.text.endswith("%")

    def met(self, ratio: float, value: float | None = None) -> bool:
        measured = ratio if self.of_base else value
        return measured is not None and OPERATORS[self.op](float(measured), self.bound)

    def __str__(self) -> str:
        return self.text or f"{self.metric}{self.op}{self.bound:g}{'x' if self.of_base else ''}"


def parse_target(text: str) -> Target:
    change = CHANGE.match(text)
    if change:
        value = float(change.group(2)) / 100
        return Target(change.group(1), ">=" if value >= 0 else "<=", 1 + value, True,
                      f"{change.group(1)}={value:+.0%}")
    bound = BOUND.match(text)
    if bound:
        metric, op, number, times = bound.groups()
        return Target(metric, op, float(number), bool(times), f"{metric}{op}{number}{times}")
    raise ConfigError("target", f"{text!r}: expected METRIC=+N% or METRIC=-N% (a change), METRIC<=Rx or "
                      "METRIC>=Rx (a bound on NEW/BASE), or METRIC<=V (on NEW's value), e.g. qps=+20% p99<=2x")


def parse_targets(texts: Sequence[str]) -> list[Target]:
    return [parse_target(part) for text in texts for part in text.replace(",", " ").split()]


def select(result: BenchResult, where: dict[str, str]) -> BenchResult:
    """The result with only the rows whose fields have these values (compared as text, or as
    numbers when both are numbers)."""
    def matches(row: dict) -> bool:
        for key, wanted in where.items():
            value = row.get(key)
            if str(value) == wanted:
                continue
            try:
                if isinstance(value, (int, float)) and float(wanted) == value:
                    continue
            except ValueError:
                pass
            return False
        return True
    rows = [row for row in result.rows if matches(row)]
    if not rows:
        shown = ", ".join(f"{k}={v}" for k, v in where.items())
        raise ConfigError("where", f"no row of the {result.benchmark} result has {shown}")
    return replace(result, rows=rows)


def parse_where(texts: Sequence[str]) -> dict[str, str]:
    where = {}
    for text in texts:
        key, sep, value = text.partition("=")
        if not sep or not key:
            raise ConfigError("where", f"{text!r}: expected FIELD=VALUE, e.g. mode=fifo")
        where[key.strip()] = value.strip()
    return where


def resolve_metric(name: str, metrics: Sequence[Metric]) -> Metric:
    keys = {m.key: m for m in metrics}
    for candidate in (name, f"{name}_ms"):
        if candidate in keys:
            return keys[candidate]
    raise ConfigError("target", f"no metric {name!r} in these results; they have {', '.join(keys)}")


@dataclass
class Check:
    point: str
    metric: str
    base: float
    new: float
    ratio: float
    band: float
    target: str | None
    verdict: str  # ok, improved, regression, unsure (beyond a band from one run a side), missed, met

    @property
    def failed(self) -> bool:
        return self.verdict in ("regression", "missed")


def merge_runs(results: Sequence[BenchResult], where: str) -> BenchResult:
    """Repeated runs of one benchmark as one result: each metric the median over the runs, its
    band the larger of the runs' own band (median) and the spread across runs."""
    first = results[0]
    if any(r.benchmark != first.benchmark for r in results):
        raise ConfigError("benchmark", f"{where} mixes {sorted({r.benchmark for r in results})}")
    by_key: dict[tuple, list[dict]] = {}
    for result in results:
        for row in result.rows:
            by_key.setdefault(result.key_of(row), []).append(row)
    rows = []
    for rows_of_key in by_key.values():
        merged = dict(rows_of_key[0])
        merged["band"] = {}
        for metric in first.metrics:
            values = [r[metric.key] for r in rows_of_key if isinstance(r.get(metric.key), (int, float))]
            if not values:
                continue
            merged[metric.key] = statistics.median(values)
            own = statistics.median(r.get("band", {}).get(metric.key, 0.0) for r in rows_of_key)
            merged["band"][metric.key] = max(own, relative_band(values))
        merged["runs"] = len(rows_of_key)
        rows.append(merged)
    return BenchResult(first.benchmark, first.settings, rows, first.columns, first.key_fields, first.metrics,
                       first.notes, {}, first.group_by, first.machine, first.git, first.command, first.created)


def load_side(path: Path) -> BenchResult:
    """A result file, or a folder of repeated runs (every *.json in it)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.json"))
        if not files:
            raise ConfigError("", "no *.json results in this folder", path)
        return merge_runs([load(f) for f in files], str(path))
    return load(path)


def _describe(result: BenchResult, row: dict, ignore: Sequence[str]) -> str:
    return ", ".join(f"{k}={row[k]}" for k in result.key_fields if k not in ignore and row.get(k) is not None) or "all"


def compare(base: BenchResult, new: BenchResult, targets: Sequence[Target] = (), min_band: float | None = None,
            ignore_keys: Sequence[str] = (), metrics: Sequence[str] = ()) -> list[Check]:
    """One check per matched row and metric. ``min_band`` None: the floor is DEFAULT_MIN_BAND, and
    a change beyond the band of two single runs is ``unsure``; given, it is the noise the caller
    knows, and such a change is judged."""
    judge_single_runs = min_band is not None
    min_band = DEFAULT_MIN_BAND if min_band is None else min_band
    if base.benchmark != new.benchmark:
        raise ConfigError("benchmark", f"BASE is {base.benchmark!r} but NEW is {new.benchmark!r}: compare like with like")
    keys = [k for k in base.key_fields if k not in ignore_keys]
    index = {tuple(row.get(k) for k in keys): row for row in base.rows}
    wanted = [resolve_metric(m, base.metrics) for m in metrics] if metrics else list(base.metrics)
    target_of = {resolve_metric(t.metric, base.metrics).key: t for t in targets}
    wanted += [m for m in base.metrics if m.key in target_of and m not in wanted]
    checks: list[Check] = []
    matched = 0
    for row in new.rows:
        base_row = index.get(tuple(row.get(k) for k in keys))
        if base_row is None:
            continue
        matched += 1
        point = _describe(new, row, ignore_keys)
        for metric in wanted:
            b, n = base_row.get(metric.key), row.get(metric.key)
            if not isinstance(b, (int, float)) or not isinstance(n, (int, float)) or b != b or n != n:
                continue
            band = max(min_band, math.hypot(base_row.get("band", {}).get(metric.key, 0.0),
                                            row.get("band", {}).get(metric.key, 0.0)))
            target = target_of.get(metric.key)
            if b == 0:
                ratio = 1.0 if n == 0 else math.inf
                worse = metric.better == "lower" and n > ABSOLUTE_ZERO_TOLERANCE
                better = metric.better == "higher" and n > 0
            else:
                ratio = n / b
                worse = ratio > 1 + band if metric.better == "lower" else ratio < 1 - band
                better = ratio < 1 - band if metric.better == "lower" else ratio > 1 + band
            verdict = "regression" if worse else "improved" if better else "ok"
            single_runs = base_row.get("runs", 1) < 2 and row.get("runs", 1) < 2
            if verdict != "ok" and b != 0 and single_runs and not judge_single_runs:
                verdict = "unsure"
            if target is not None:
                met = target.met(ratio, float(n)) and not (worse and target.is_change)
                verdict = "met" if met else "missed"
            checks.append(Check(point, metric.key, float(b), float(n), ratio, band,
                                str(target) if target else None, verdict))
    if not matched:
        raise ConfigError("rows", f"no row of NEW matches a row of BASE on {', '.join(keys)} "
                          "(--ignore-key model compares different models at the same settings)")
    missing = [str(t) for t in targets if not any(c.target == str(t) for c in checks)]
    if missing:
        raise ConfigError("target", f"{', '.join(missing)}: no matched row has that metric in both results")
    return checks


CHECK_COLUMNS = [Column("point"), Column("metric"), Column("base", "base", ".4g"), Column("new", "new", ".4g"),
                 Column("ratio", "new/base", ".3f"), Column("band", "± band", ".1%"), Column("target"),
                 Column("verdict")]


def format_checks(checks: Sequence[Check]) -> str:
    return format_table([vars(c) for c in checks], CHECK_COLUMNS)
