"""`bench router`: the QoS router against plain FIFO, open loop, in one run, on a server it starts.

The repository it builds holds a sleep-based target (``service_ms`` x ``instances``; default
20 ms x 2, a held-out scenario) with the router in front of it (the demo's routing:
max_inflight auto, headroom 1 for diamond, lead 2 ms, deadlines 2/3/5 s, shares 100 %, no
shadow) and any ``Variant`` routers beside it; for the overhead at low load, targets of 1 ms and
of the service time, each with a router and two bare BLS forwarders (one returns the response
from ``execute``: the fast path's floor; one answers from a worker thread through the response
sender: the floor of any queued path), and a zero-time target for one router's ceiling.

Everything is driven by the package's load generator over one HTTP transport (connections kept
across runs): the target's capacity is a closed-loop point; each scenario is one seeded
``arrival_schedule`` (Poisson arrivals, tier mix 10/30/60) replayed with ``run_fixed`` at the
target directly (FIFO) and at each router, so A and B see the same arrivals; overheads and the
unloaded diamond p99 are sequential ``run_fixed`` calls. Triton's /metrics before and after each
run give the time requests waited in Triton's queue in front of each model and the router's own
latency histogram. The rows (scenario, mode, tier) and the targets, checked with `compare`,
make one ``BenchResult``.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from dspark.bench.client import HttpTransport, Record
from dspark.bench.compare import Check, compare, parse_target, select
from dspark.bench.inputs import ModelInfo
from dspark.bench.load import LoadGenerator, LoadSettings, Point, Target, arrival_schedule, summarize
from dspark.bench.resources import Sample, model_counters, scrape
from dspark.bench.results import BenchResult, Metric, relative_band
from dspark.bench.table import Column
from dspark.errors import ConfigError
from dspark.routing.config import RoutingConfig
from dspark.routing.metrics import STAGES_ENV

TIERS = tuple(RoutingConfig().tiers)  # diamond, gold, standard
TIER_MIX = (10, 30, 60)
ALL = "all"  # the tier of a scenario's summary row (goodput, queues, the client's lateness)
ROUTER_CEILING_INSTANCES = 4  # instances of the zero-time target behind the router-throughput measurement
CEILING_OUTSTANDING = 32
UNLOADED_CALLS = 200
# error kinds of a request the router refused with a reason (UNAVAILABLE + its message)
REASONS = (("queue deadline", "deadline"), ("queue is full", "queue_full"),
           ("did not answer within", "target_timeout"), ("shutting down", "shutdown"))
EXPLAINED = frozenset(kind for _, kind in REASONS)


def classify(kind: str, message: str) -> str:
    """The router's reason for refusing a request, read from its UNAVAILABLE message; other
    errors keep their kind (``timeout``: no answer within the client's timeout, i.e. hung)."""
    if kind == "UNAVAILABLE":
        return next((reason for marker, reason in REASONS if marker in message), kind)
    return kind


# --- the repository --------------------------------------------------------------------------------
def model_config(name: str, backend: str, instances: int, parameters: dict[str, str]) -> str:
    """config.pbtxt of a bench model (x -> y, version), through Triton's own schema."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = model_config_pb2.ModelConfig(name=name, backend=backend, max_batch_size=0)
    config.input.add(name="x", data_type=model_config_pb2.TYPE_FP32, dims=[-1])
    config.output.add(name="y", data_type=model_config_pb2.TYPE_FP32, dims=[-1])
    config.output.add(name="version", data_type=model_config_pb2.TYPE_INT32, dims=[1])
    config.instance_group.add(count=instances, kind=model_config_pb2.ModelInstanceGroup.KIND_CPU)
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return text_format.MessageToString(config)


# Bare BLS forwarders: the floors of the router's two paths (nothing but the BLS hop)
FORWARD_RETURN = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    # the fast path's floor: call the target in execute and return its response
    def execute(self, requests):
        return [pb_utils.InferenceResponse(pb_utils.InferenceRequest(
            model_name="{target}", inputs=r.inputs(), requested_output_names=["y", "version"]
        ).exec().output_tensors()) for r in requests]
"""

FORWARD_SENDER = """
import queue
import threading

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    # any queued path's floor: execute returns at once, a worker thread calls the target and
    # answers through the response sender
    def initialize(self, args):
        self.jobs = queue.SimpleQueue()
        threading.Thread(target=self.work, daemon=True).start()

    def work(self):
        while True:
            request, sender = self.jobs.get()
            response = pb_utils.InferenceRequest(
                model_name="{target}", inputs=request.inputs(), requested_output_names=["y", "version"]).exec()
            sender.send(pb_utils.InferenceResponse(response.output_tensors()),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def execute(self, requests):
        for request in requests:
            self.jobs.put((request, request.get_response_sender()))
        return None
"""


@dataclass(frozen=True)
class Variant:
    """A router configuration under test: calls in flight for every tier, the top tier's extra
    and the hand-off lead (routing.yaml max_inflight, top_tier_headroom, handoff_lead_ms)."""

    max_inflight: int | str = "auto"
    headroom: int = 1
    lead_ms: float = 0.0

    @property
    def model(self) -> str:
        return ("bench_router" if self == Variant() else
                f"bench_router_m{self.max_inflight}_h{self.headroom}_l{self.lead_ms:g}".replace(".", "_"))

    @property
    def label(self) -> str:
        return "router" if self == Variant() else f"router {self.max_inflight}:{self.headroom}:{self.lead_ms:g}"

    @classmethod
    def parse(cls, text: str) -> "Variant":
        parts = text.split(":")
        try:
            inflight = parts[0] if parts[0] == "auto" else int(parts[0])
            return cls(inflight, int(parts[1]) if len(parts) > 1 else 0, float(parts[2]) if len(parts) > 2 else 0.0)
        except (ValueError, IndexError):
            raise ConfigError("variant", f"{text!r}: expected MAX_INFLIGHT:HEADROOM[:LEAD_MS], e.g. 3:0 or auto:1:2") \
                from None


def build_repository(root: Path, service_ms: float, instances: int, variants: Sequence[Variant],
                     overhead: bool = True) -> None:
    """The bench's models; without ``overhead`` only the target and the routers in front of it."""
    def add(name: str, backend: str, count: int, parameters: dict[str, str], model_py: str | None = None) -> None:
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(model_config(name, backend, count, parameters))
        if model_py is not None:
            (root / name / "1" / "model.py").write_text(model_py)

    default = replace(RoutingConfig(), shares={1: 100.0})  # the demo's routing: shares 100, no shadow
    routers = {variant.model: replace(default, max_inflight=variant.max_inflight, top_tier_headroom=variant.headroom,
                                      handoff_lead_ms=variant.lead_ms)
               for variant in [Variant(), *variants]}
    add("bench_target", "router_demo_target", instances, {"service_time_ms": f"{service_ms:g}"})
    if overhead:
        add("bench_t1", "router_demo_target", instances, {"service_time_ms": "1"})
        for target in ("bench_target", "bench_t1"):
            add(f"fwd_return_{target}", "python", 1, {}, FORWARD_RETURN.format(target=target))
            add(f"fwd_sender_{target}", "python", 1, {}, FORWARD_SENDER.format(target=target))
        # the router's own ceiling: a zero-time target with more instances than the CPU has cores
        add("bench_t0", "router_demo_target", ROUTER_CEILING_INSTANCES, {"service_time_ms": "0"})
        routers.update(router_t1=default, router_t0=default, router_t1_queued=replace(default, inline_max_ms=0.0))
    for name, routing in routers.items():
        target = "bench_t1" if name.startswith("router_t1") else "bench_t0" if name == "router_t0" else "bench_target"
        add(name, "qos_router", 1, {"target_model": target, "target_versions": "1"})
        routing.save(root / name / "routing.yaml")


# --- settings and scenarios ----------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    name: str
    duration_s: float
    offered: float  # mean offered load, x capacity
    rate_at: Callable[[float], float]  # t -> arrivals/s


def bursty(capacity: float, duration_s: float, base: float = 0.65, burst: float = 1.65,
           period_s: float = 10.0, burst_s: float = 2.0) -> Scenario:
    mean = (base * (period_s - burst_s) + burst * burst_s) / period_s
    return Scenario(f"bursty {mean:.2f}x ({burst:g}x {burst_s:g}s/{period_s:g}s)", duration_s, mean,
                    lambda t: capacity * (burst if (t % period_s) >= period_s - burst_s else base))


def overload(capacity: float, factor: float, duration_s: float) -> Scenario:
    return Scenario(f"overload {factor:g}x", duration_s, factor, lambda t: capacity * factor)


@dataclass
class RouterBenchSettings:
    service_ms: float = 20.0
    instances: int = 2
    variants: list[Variant] = field(default_factory=list)
    bursty_s: float = 20.0           # 0: no bursty scenario
    overload_s: float = 15.0
    overloads: list[float] = field(default_factory=lambda: [1.5, 2.0])
    repeat: int = 3
    fifo: bool = True                # also the target directly (the A/B baseline)
    overhead: bool = True            # the low-load overhead and one router's ceiling
    scenarios: bool = True           # False: the overhead alone
    overhead_rounds: int = 7
    overhead_calls: tuple[int, int] = (100, 60)  # sequential calls per round at 1 ms and at service_ms
    capacity_s: float = 8.0          # closed-loop measurement of the target's capacity (and the ceiling's)
    seed: int = 7
    timeout_s: float = 120.0         # a request without an answer by then is counted as hung ("timeout")

    def __post_init__(self) -> None:
        self.variants = list(dict.fromkeys(v for v in self.variants if v != Variant()))
        if self.repeat < 1 or self.overhead_rounds < 1:
            raise ConfigError("repeat", "repeats and rounds must be >= 1")
        if not (self.overhead or self.scenarios):
            raise ConfigError("overhead", "nothing to measure: the overhead is skipped and so are the scenarios")

    @property
    def deadlines_s(self) -> dict[str, float]:
        return {t: policy.deadline_ms / 1000 for t, policy in RoutingConfig().tiers.items()}

    @property
    def modes(self) -> list[tuple[str, str, bool]]:
        """(mode, model, sends tiers): FIFO (the target directly) first, then each router."""
        return ([("fifo", "bench_target", False)] if self.fifo else []) + [
            (v.label, v.model, True) for v in [Variant(), *self.variants]]

    def scenario_list(self, capacity: float) -> list[Scenario]:
        return ([bursty(capacity, self.bursty_s)] if self.bursty_s > 0 else []) + [
            overload(capacity, f, self.overload_s) for f in self.overloads]

    def to_json(self) -> dict:
        data = asdict(self)
        data["variants"] = [v.label for v in self.variants]
        data["tier_mix"] = dict(zip(TIERS, TIER_MIX))
        data["deadlines_ms"] = {t: 1000 * s for t, s in self.deadlines_s.items()}
        return data


# --- one run of a scenario: rows per tier, goodput ----------------------------------------------
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


# --- measuring -----------------------------------------------------------------------------------
class Bench:
    """The load generators of one server: one HTTP transport, prepared requests per model."""

    def __init__(self, url: str, metrics_url: str, settings: RouterBenchSettings, log: Callable[[str], None]):
        self.url, self.metrics_url, self.settings, self.log = url, metrics_url, settings, log
        self.transport = HttpTransport(url, settings.timeout_s)
        self._info: dict[str, ModelInfo] = {}

    async def targets(self, model: str, tiers: Sequence[str | None], send_tier: bool = True) -> list[Target]:
        """One target per tier, labelled by it and sending it as the ``tier`` parameter unless
        ``send_tier`` is false (FIFO: the target directly, the tiers only for the figures)."""
        if model not in self._info:
            self._info[model] = ModelInfo.from_config(await self.transport.model_config(model))
        arrays = {"x": np.ones(4, dtype=np.float32)}
        return [Target(model, [self.transport.prepare(self._info[model], arrays,
                                                      {"tier": t} if send_tier and t else None)], label=t or "")
                for t in tiers]

    def generator(self, targets: Sequence[Target], **load) -> LoadGenerator:
        return LoadGenerator(self.transport, targets, LoadSettings(seed=self.settings.seed, **load), classify=classify)

    async def closed_loop(self, model: str, outstanding: int, seconds: float) -> dict:
        """Answers per second with ``outstanding`` requests always in flight, after 1 s warm-up,
        in three windows (req/s and its band over them)."""
        generator = self.generator(await self.targets(model, [None]), warmup_s=1.0, window_s=seconds / 3,
                                   stable_windows=3, max_windows=3)
        point = await generator.run_point("concurrency", outstanding)
        figures = summarize(point.records, point.duration_s)
        return {"qps": figures["qps"], "p50_ms": figures["p50_ms"], "errors": figures["errors"],
                "band": {"qps": relative_band([w["qps"] for w in point.windows])}}

    async def sequential_p50(self, model: str, tier: str | None, calls: int) -> float:
        targets = await self.targets(model, [tier])
        point = await self.generator(targets).run_fixed(concurrency=1, count=calls)
        return summarize(point.records, point.duration_s)["p50_ms"]

    async def overhead(self, stages_dir: Path) -> tuple[list[dict], dict]:
        """The router's overhead at low load (1 ms and ``service_ms`` targets) beside the bare
        forwarders: sequential calls, the models interleaved round by round; per model the median
        over rounds of its p50 minus the direct p50 of the same round (pairs cancel the drift)."""
        s = self.settings
        rows, stages = [], {}
        for target, label, calls in (("bench_t1", "1 ms", s.overhead_calls[0]),
                                     ("bench_target", f"{s.service_ms:g} ms", s.overhead_calls[1])):
            routers = ["router_t1", "router_t1_queued"] if target == "bench_t1" else ["bench_router"]
            models = [target, f"fwd_return_{target}", f"fwd_sender_{target}", *routers]
            tier = {m: "gold" if "router" in m else None for m in models}
            for model in models:
                await self.sequential_p50(model, tier[model], 10)  # warm-up
            p50: dict[str, list[float]] = defaultdict(list)
            for _ in range(s.overhead_rounds):
                for model in models:
                    p50[model].append(await self.sequential_p50(model, tier[model], calls))
            direct = p50[target]
            for model in models:
                added = [a - b for a, b in zip(p50[model], direct)]
                rows.append({"table": "overhead", "scenario": f"overhead {label}", "mode": overhead_mode(model),
                             "tier": tier[model] or "-", "model": model, "p50_ms": _median(p50[model]),
                             **({} if model == target else {"added_p50_ms": _median(added),
                                                            "added_runs": [round(a, 2) for a in added]}),
                             "rounds": s.overhead_rounds, "calls": calls,
                             "band": {"p50_ms": relative_band(p50[model]),
                                      **({} if model == target else {"added_p50_ms": relative_band(added)})}})
            stages[label] = read_stages(stages_dir, routers)
            self.log(f"overhead at low load, {label} target: direct p50 {_median(direct):.2f} ms; added: " +
                     ", ".join(f"{r['mode']} {r['added_p50_ms']:+.2f}" for r in rows[-len(models) + 1:]))
        return rows, stages

    async def run(self, scenario: Scenario, mode: str, model: str, send_tier: bool, seed: int) -> Run:
        """One scenario's seeded arrivals at one model; the same seed replays them at another."""
        schedule = arrival_schedule(scenario.duration_s, scenario.rate_at, TIER_MIX, seed)
        targets = await self.targets(model, TIERS, send_tier)
        before = scrape(self.metrics_url)
        point = await self.generator(targets).run_fixed(schedule=schedule)
        await asyncio.sleep(1)  # the router exports its metrics in batches
        after = scrape(self.metrics_url)
        run = Run(scenario.name, mode, point, scenario.duration_s)
        if before is not None and after is not None:
            run.triton_queue_ms = model_counters(before, after, model).get("server_queue_us_per_request",
                                                                           float("nan")) / 1e3
            run.inside = histogram_delta(router_histograms(before, model), router_histograms(after, model))
        return run


def overhead_mode(model: str) -> str:
    if model.startswith("fwd_return_"):
        return "forwarder (return)"
    if model.startswith("fwd_sender_"):
        return "forwarder (sender)"
    return {"router_t1": "router", "bench_router": "router", "router_t1_queued": "router (queued path)"}.get(
        model, "direct")


def read_stages(folder: Path, models: Sequence[str]) -> dict[str, dict]:
    """The routers' stage timings (p50 per stage), which they write every 0.5 s."""
    time.sleep(0.7)
    out = {}
    for model in models:
        path = folder / f"{model}.json"
        if path.exists():
            out[model] = json.loads(path.read_text())
    return out


def _stage_line(model: str, stages: dict) -> str:
    return f"inside {model} (p50 per stage): " + ", ".join(f"{s} {v['p50_ms']:.3f} ms" for s, v in stages.items())


async def measure(url: str, metrics_url: str, stages_dir: Path, settings: RouterBenchSettings,
                  log: Callable[[str], None]) -> tuple[list[dict], dict, list[str]]:
    """Every figure of the bench on a running server built by ``build_repository``: rows,
    series (raw data for the plots) and notes."""
    s = settings
    bench = Bench(url, metrics_url, s, log)
    await bench.transport.open(0)
    rows: list[dict] = []
    series: dict = {}
    notes: list[str] = []
    try:
        if s.overhead:
            overhead_rows, stages = await bench.overhead(stages_dir)
            rows += overhead_rows
            series["stages_ms"] = stages
            notes += [_stage_line(m, st) for label in stages for m, st in stages[label].items()]
            for model in ("bench_t0", "router_t0"):
                figures = await bench.closed_loop(model, CEILING_OUTSTANDING, s.capacity_s * 0.75)
                rows.append({"table": "reference", "scenario": "ceiling", "mode": "direct" if model == "bench_t0"
                             else "router", "tier": "-", "model": model, **figures})
            log(f"one router instance's ceiling: {rows[-1]['qps']:.0f} req/s, the target directly {rows[-2]['qps']:.0f}")
            notes.append(f"ceiling: closed loop, {CEILING_OUTSTANDING} outstanding, zero-time target with "
                         f"{ROUTER_CEILING_INSTANCES} instances, directly and through one router instance")
        if not s.scenarios:
            return rows, series, notes
        figures = await bench.closed_loop("bench_target", 4 * s.instances, s.capacity_s)
        capacity = figures["qps"]
        rows.append({"table": "reference", "scenario": "capacity", "mode": "direct", "tier": ALL, "model": "bench_target",
                     **figures, "goodput": capacity, "ideal_qps": 1000 * s.instances / s.service_ms})
        log(f"capacity (closed loop, {4 * s.instances} outstanding, target direct): {capacity:.1f} req/s "
            f"(ideal {1000 * s.instances / s.service_ms:.1f})")
        scenarios = s.scenario_list(capacity)
        runs: dict[tuple[str, str], list[Run]] = defaultdict(list)
        unloaded = []
        diamond = await bench.targets("bench_router", ["diamond"])
        for rep in range(s.repeat):
            point = await bench.generator(diamond).run_fixed(concurrency=1, count=UNLOADED_CALLS)
            unloaded.append(summarize(point.records, point.duration_s)["p99_ms"])
            for k, scenario in enumerate(scenarios):
                for mode, model, send_tier in s.modes:
                    run = await bench.run(scenario, mode, model, send_tier, s.seed + 100 * rep + k)
                    runs[(scenario.name, mode)].append(run)
                    log(f"run {rep + 1}/{s.repeat}: {scenario.name} / {mode}: {len(run.point.records)} requests, "
                        f"goodput {run.goodput() / capacity:.3f}x capacity")
        rows.append({"table": "reference", "scenario": "unloaded", "mode": "router", "tier": "diamond",
                     "model": "bench_router", "p99_ms": _median(unloaded), "p99_runs": [round(v, 1) for v in unloaded],
                     "band": {"p99_ms": relative_band(unloaded)}})
        offered = {sc.name: sc.offered for sc in scenarios}
        for (name, _), group in runs.items():
            rows += scenario_rows(group, s.deadlines_s, capacity, offered[name])
        series["timeline"] = {f"{name} / {mode}": timeline(group[0]) for (name, mode), group in runs.items()}
        series["scenarios"] = [{"name": sc.name, "offered_x": sc.offered, "duration_s": sc.duration_s} for sc in scenarios]
        stages = read_stages(stages_dir, [model for _, model, tiers in s.modes if tiers])
        series["stages_ms_under_load"] = stages
        notes.append(f"capacity: closed loop, {4 * s.instances} outstanding, the target directly: {capacity:.1f} req/s "
                     f"(ideal {1000 * s.instances / s.service_ms:.1f}); unloaded diamond p99 through the router "
                     f"({UNLOADED_CALLS} sequential calls before each repeat): {_median(unloaded):.1f} ms")
        notes += [_stage_line(m, st) + " over all scenarios" for m, st in stages.items()]
        return rows, series, notes
    finally:
        await bench.transport.close()


@contextlib.contextmanager
def bench_server(settings: RouterBenchSettings) -> Iterator[tuple[object, Path]]:
    """A server on free loopback ports serving the bench's repository (removed afterwards), the
    routers writing their stage timings into the folder yielded beside it."""
    import shutil

    from dspark.triton.server import TritonServer

    root = Path(tempfile.mkdtemp(prefix="dspark-bench-router-"))
    previous = os.environ.get(STAGES_ENV)
    server = None
    try:
        build_repository(root / "repo", settings.service_ms, settings.instances, settings.variants, settings.overhead)
        (root / "stages").mkdir()
        os.environ[STAGES_ENV] = str(root / "stages")
        server = TritonServer([root / "repo"])
        server.start()
        yield server, root / "stages"
    finally:
        if server is not None:
            server.stop()
        if previous is None:
            os.environ.pop(STAGES_ENV, None)
        else:
            os.environ[STAGES_ENV] = previous
        shutil.rmtree(root, ignore_errors=True)


# --- the result and its targets ------------------------------------------------------------------
COLUMNS = [
    Column("scenario"), Column("mode"), Column("tier"), Column("model"),
    Column("sent"), Column("ok"), Column("within_deadline", "in deadline", ".1%"),
    Column("p50_ms", "p50 ms", ".2f"), Column("p90_ms", "p90 ms", ".1f"), Column("p99_ms", "p99 ms", ".1f"),
    Column("p99_runs", "p99 of each run", ".0f"), Column("router_p99_ms_at_most", "router's own p99 <= ms", ".0f"),
    Column("p99_from_arrival_ms", "p99 from arrival ms", ".1f"),
    Column("goodput_x", "goodput x capacity", ".3f"), Column("triton_queue_ms", "Triton queue ms", ".1f"),
    Column("send_lag_p99_ms", "client sent late p99 ms", ".1f"), Column("unexplained", "hung or unexplained"),
    Column("rejected", "refused"),
    Column("qps", "req/s", ".1f"), Column("ideal_qps", "ideal req/s", ".1f"),
    Column("added_p50_ms", "added p50 ms", "+.2f"), Column("added_runs", "added in each round", "+.2f"),
]
METRICS = [Metric("goodput_x", "higher"), Metric("goodput", "higher"), Metric("qps", "higher"),
           Metric("within_deadline", "higher"), Metric("p50_ms", "lower"), Metric("p90_ms", "lower"),
           Metric("p99_ms", "lower"), Metric("p99_from_arrival_ms", "lower"), Metric("added_p50_ms", "lower"),
           Metric("unexplained", "lower")]


def run_router_bench(settings: RouterBenchSettings, log: Callable[[str], None] = lambda _: None) -> BenchResult:
    """Start the bench's server, measure, and return the result (rows: scenario, mode, tier)."""
    load_start = round(os.getloadavg()[0], 1)
    with bench_server(settings) as (server, stages_dir):
        log(f"server on {server.http_url}: target {settings.instances} instances x {settings.service_ms:g} ms")
        rows, series, notes = asyncio.run(measure(server.http_url, server.metrics_url, stages_dir, settings, log))
    if settings.scenarios:
        notes.insert(0, f"target {settings.instances} x {settings.service_ms:g} ms; open-loop Poisson arrivals, "
                        f"tiers {'/'.join(f'{t} {m}%' for t, m in zip(TIERS, TIER_MIX))}, the same seeded arrivals "
                        f"for every mode; {settings.repeat} run(s) of each (medians of the runs' percentiles, counts "
                        "summed); p50/p90/p99 from sending, 'from arrival' adds the client's lateness")
    if settings.overhead:
        notes.insert(0, f"overhead at low load: sequential HTTP calls, {settings.overhead_calls[0]} (1 ms target) and "
                        f"{settings.overhead_calls[1]} ({settings.service_ms:g} ms target) per model and round, models "
                        f"interleaved; added p50 = the median over {settings.overhead_rounds} rounds of the model's p50 "
                        "minus the direct p50 of the same round")
    notes.append(f"load average {load_start:g} at the start, {os.getloadavg()[0]:.1f} at the end")
    result = BenchResult("router", settings.to_json(), rows, COLUMNS, ["scenario", "mode", "tier"], METRICS,
                         notes, series, group_by="table")
    return result


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
    """Issue 11's targets for each router of the result: bursty diamond p99 <= 0.58x FIFO's and
    >= 99.5 % of standard within its deadline; under overload goodput >= 0.97x the capacity,
    diamond p99 <= 2x unloaded and no request hung or failed without a reason; overhead p50 < 1 ms
    (the default router)."""
    rows = result.rows
    present = {(r["scenario"], r["mode"]) for r in rows}
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows if r.get("table") == "scenarios"))
    modes = list(dict.fromkeys(r["mode"] for r in rows if r.get("table") == "scenarios" and r["mode"] != "fifo"))
    out = []
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
                out.append(Goal(f"{name}, {mode}: goodput vs capacity", "goodput>=0.97x",
                                {"scenario": name, "mode": mode, "tier": ALL}, {"scenario": "capacity"}))
                out.append(Goal(f"{name}, {mode}: diamond p99 vs unloaded", "p99_ms<=2x",
                                {"scenario": name, "mode": mode, "tier": "diamond"}, {"scenario": "unloaded"}))
                out.append(Goal(f"{name}, {mode}: hung or failed without a reason", "unexplained<=0",
                                {"scenario": name, "mode": mode, "tier": ALL}))
    for row in rows:
        if row.get("table") == "overhead" and row["mode"] == "router" and row["model"] in ("router_t1", "bench_router"):
            out.append(Goal(f"{row['scenario']}: router's added p50 (ms)", "added_p50_ms<1",
                            {"scenario": row["scenario"], "mode": "router", "tier": row["tier"]}))
    return out


def check_goals(result: BenchResult) -> list[Check]:
    return [c for goal in goals(result) for c in goal.check(result)]
