"""The router bench's figures: one run's rows per tier and its goodput, the router's own latency
histogram between two scrapes, the result's columns, and the targets as `bench compare` checks."""
from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from dspark.bench.client import Record
from dspark.bench.compare import Check, compare, parse_target, select
from dspark.bench.load import Point, summarize
from dspark.bench.resources import Sample
from dspark.bench.results import BenchResult, Metric, relative_band
from dspark.bench.router.scenarios import ALL, EXPLAINED, TIERS
from dspark.bench.table import Column

@dataclass
class Run:
    """One scenario in one mode: the requests (Record.target = tier), the server's side."""

    scenario: str
    mode: str
    point: Point
    duration_s: float
    triton_queue_ms: float = float("nan")  # mean wait in Triton's queue in front of the model
    inside: dict = field(default_factory=dict)  # tier -> the router's latency histogram {le: count}

    def of(self, tier: str) -> list[Record]:
        return [r for r in self.point.records if r.target == tier]

    def goodput(self) -> float:
        """Answers per second received while the scenario ran (later answers do not count)."""
        end = self.point.started + self.duration_s
        return sum(r.error is None and r.done <= end for r in self.point.records) / self.duration_s


def tier_figures(records: Sequence[Record], deadline_s: float, duration_s: float) -> dict:
    """One run's figures for one tier: ``summarize`` plus the share answered within the tier's
    deadline and the p99 from the scheduled arrival (send lateness included)."""
    out = summarize(records, duration_s)
    ok = [r for r in records if r.error is None]
    out["in_deadline"] = sum(r.latency <= deadline_s for r in ok)
    out["within_deadline"] = out["in_deadline"] / len(records) if records else float("nan")
    out["p99_from_arrival_ms"] = (float(np.percentile([1e3 * (r.done - r.scheduled) for r in ok], 99))
                                  if ok else float("nan"))
    return out


def router_histograms(metrics: dict[Sample, float] | None, model: str) -> dict[str, dict[float, float]]:
    """tier -> cumulative bucket counts {upper bound s: count} of the router's own latency (from
    ``execute`` to the answer sent), summed over versions; empty for a model that is no router."""
    out: dict[str, dict[float, float]] = defaultdict(dict)
    for (name, labels), value in (metrics or {}).items():
        tags = dict(labels)
        if name == "dspark_router_latency_seconds_bucket" and tags.get("model") == model:
            le = float(tags["le"])
            out[tags["tier"]][le] = out[tags["tier"]].get(le, 0.0) + value
    return dict(out)


def histogram_delta(before: dict, after: dict) -> dict[str, dict[float, float]]:
    return {tier: {le: n - before.get(tier, {}).get(le, 0.0) for le, n in buckets.items()}
            for tier, buckets in after.items()}


def histogram_p99(buckets: dict[float, float]) -> float:
    """The upper bound (ms) of the bucket holding the 99th percentile of cumulative buckets."""
    total = buckets.get(float("inf"), 0)
    for le in sorted(buckets):
        if total and buckets[le] >= 0.99 * total:
            return 1000 * le
    return float("nan")


def _median(values: Sequence[float]) -> float:
    finite = [v for v in values if v == v]
    return statistics.median(finite) if finite else float("nan")


BAND_KEYS = ("p50_ms", "p90_ms", "p99_ms", "p99_from_arrival_ms", "within_deadline", "goodput", "goodput_x")


def scenario_rows(runs: Sequence[Run], deadlines_s: dict[str, float], capacity: float, offered: float) -> list[dict]:
    """The rows of one scenario and mode over its repeats: per tier (counts summed, percentiles
    the median of the runs', bands their spread) and an ``all`` row (goodput, queues, lateness)."""
    first = runs[0]
    key = {"table": "scenarios", "scenario": first.scenario, "mode": first.mode}
    rows = []
    for tier in TIERS:
        per_run = [tier_figures(run.of(tier), deadlines_s[tier], run.duration_s) for run in runs]
        errors: Counter = Counter()
        for figures in per_run:
            errors.update(figures["errors"])
        sent = sum(f["requests"] for f in per_run)
        row = {**key, "tier": tier, "sent": sent, "ok": sum(f["ok"] for f in per_run),
               **{k: _median([f[k] for f in per_run]) for k in BAND_KEYS if k in per_run[0]},
               "within_deadline": sum(f["in_deadline"] for f in per_run) / sent if sent else None,
               "p99_runs": [round(f["p99_ms"], 1) for f in per_run],
               "router_p99_ms_at_most": _median([histogram_p99(run.inside.get(tier, {})) for run in runs]),
               "errors": dict(errors), "rejected": ", ".join(f"{k} {v}" for k, v in sorted(errors.items())) or "-",
               "band": {k: relative_band([f[k] for f in per_run]) for k in BAND_KEYS if k in per_run[0]}}
        rows.append(row)
    goodputs = [run.goodput() for run in runs]
    unexplained = sum(r.error is not None and r.error not in EXPLAINED for run in runs for r in run.point.records)
    rows.append({**key, "tier": ALL, "offered_x": offered, "sent": sum(len(run.point.records) for run in runs),
                 "ok": sum(r.error is None for run in runs for r in run.point.records),
                 "goodput": _median(goodputs), "goodput_x": _median(goodputs) / capacity,
                 "triton_queue_ms": _median([run.triton_queue_ms for run in runs]),
                 "send_lag_p99_ms": _median([summarize(run.point.records, run.duration_s)["send_lag_p99_ms"]
                                             for run in runs]),
                 "unexplained": unexplained,
                 "band": {"goodput": relative_band(goodputs), "goodput_x": relative_band(goodputs)}})
    return rows


def timeline(run: Run) -> dict[str, list[list]]:
    """tier -> [arrival s, latency ms or None when refused] of one run, for the latency plot."""
    out: dict[str, list[list]] = {tier: [] for tier in TIERS}
    for r in run.point.records:
        out[r.target].append([round(r.scheduled - run.point.started, 4),
                              round(1e3 * r.latency, 2) if r.error is None else None])
    return out


COLUMNS = [
    Column("scenario"), Column("mode"), Column("tier"), Column("model"),
    Column("sent"), Column("ok"), Column("within_deadline", "in deadline", ".1%"),
    Column("p50_ms", "p50 ms", ".2f"), Column("p90_ms", "p90 ms", ".1f"), Column("p99_ms", "p99 ms", ".1f"),
    Column("p99_runs", "p99 of each run", ".0f"), Column("router_p99_ms_at_most", "router's own p99 <= ms", ".0f"),
    Column("p99_from_arrival_ms", "p99 from arrival ms", ".1f"),
    Column("goodput_x", "goodput x capacity", ".3f"), Column("triton_queue_ms", "Triton queue ms", ".1f"),
    Column("send_lag_p99_ms", "client sent late p99 ms", ".1f"), Column("unexplained", "hung or unexplained"),
    Column("rejected", "refused"),
    Column("qps", "req/s", ".1f"), Column("qps_runs", "req/s of each round", ".0f"),
    Column("x_direct", "x direct", ".3f"), Column("ideal_qps", "ideal req/s", ".1f"),
    Column("added_p50_ms", "added p50 ms", "+.2f"), Column("added_runs", "added in each round", "+.2f"),
]
METRICS = [Metric("goodput_x", "higher"), Metric("goodput", "higher"), Metric("qps", "higher"), Metric("x_direct", "higher"),
           Metric("within_deadline", "higher"), Metric("p50_ms", "lower"), Metric("p90_ms", "lower"),
           Metric("p99_ms", "lower"), Metric("p99_from_arrival_ms", "lower"), Metric("added_p50_ms", "lower"),
           Metric("unexplained", "lower")]



@dataclass(frozen=True)
class Goal:
    """One of the router's targets as a `bench compare` of rows of one result."""

    name: str
    target: str
    new: dict
    base: dict | None = None  # None: a bound on the new rows' own value

    def check(self, result: BenchResult) -> list[Check]:
        new = select(result, self.new)
        base = select(result, self.base) if self.base else new
        checks = compare(base, new, [parse_target(self.target)], min_band=0.0,
                         ignore_keys=result.key_fields if self.base else (), metrics=[parse_target(self.target).metric])
        nan = float("nan")  # a bound on the value alone has no base
        return [replace(c, point=self.name) if self.base else replace(c, point=self.name, base=nan, ratio=nan)
                for c in checks if c.target]

    def command(self, path: str) -> str:
        """The same check as a command line."""
        def where(flag: str, rows: dict) -> str:
            return " ".join(f"--{flag}-where '{k}={v}'" for k, v in rows.items())
        ignore = " ".join(f"--ignore-key {k}" for k in ("scenario", "mode", "tier")) if self.base else ""
        return " ".join(p for p in (f"dspark bench compare {path} {path}", where("base", self.base or self.new),
                                    where("new", self.new), ignore, f"--target '{self.target}'") if p)


def goals(result: BenchResult) -> list[Goal]:
    """The router's targets for each router of the result: its capacity >= 0.95x the target's
    direct capacity (the default router); bursty diamond p99 <= 0.58x FIFO's and >= 99.5 % of
    standard within its deadline; under overload goodput >= 0.97x FIFO's (the capacity's without
    FIFO), diamond p99 <= 2x unloaded and no request hung or failed without a reason; overhead
    p50 <= 1 ms (the default router)."""
    rows = result.rows
    present = {(r["scenario"], r["mode"]) for r in rows}
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows if r.get("table") == "scenarios"))
    modes = list(dict.fromkeys(r["mode"] for r in rows if r.get("table") == "scenarios" and r["mode"] != "fifo"))
    out = []
    if ("capacity", "router") in present:
        out.append(Goal("capacity: router vs the target directly", "qps>=0.95x",
                        {"scenario": "capacity", "mode": "router"}, {"scenario": "capacity", "mode": "direct"}))
    for mode in modes:
        for name in scenarios:
            if name.startswith("bursty"):
                if (name, "fifo") in present:
                    out.append(Goal(f"{name}, {mode}: diamond p99 vs FIFO", "p99_ms<=0.58x",
                                    {"scenario": name, "mode": mode, "tier": "diamond"},
                                    {"scenario": name, "mode": "fifo", "tier": "diamond"}))
                out.append(Goal(f"{name}, {mode}: standard within deadline", "within_deadline>=0.995",
                                {"scenario": name, "mode": mode, "tier": "standard"}))
            elif name.startswith("overload"):
                fifo = (name, "fifo") in present
                out.append(Goal(f"{name}, {mode}: goodput vs {'FIFO' if fifo else 'capacity'}", "goodput>=0.97x",
                                {"scenario": name, "mode": mode, "tier": ALL},
                                {"scenario": name, "mode": "fifo", "tier": ALL} if fifo else
                                {"scenario": "capacity", "mode": "direct"}))
                out.append(Goal(f"{name}, {mode}: diamond p99 vs unloaded", "p99_ms<=2x",
                                {"scenario": name, "mode": mode, "tier": "diamond"}, {"scenario": "unloaded"}))
                out.append(Goal(f"{name}, {mode}: hung or failed without a reason", "unexplained<=0",
                                {"scenario": name, "mode": mode, "tier": ALL}))
    for row in rows:
        if row.get("table") == "overhead" and row["mode"] == "router" and row["model"] in ("router_t1", "bench_router"):
            out.append(Goal(f"{row['scenario']}: router's added p50 (ms)", "added_p50_ms<=1",
                            {"scenario": row["scenario"], "mode": "router", "tier": row["tier"]}))
    return out


def check_goals(result: BenchResult) -> list[Check]:
    return [c for goal in goals(result) for c in goal.check(result)]
