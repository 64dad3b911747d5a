"""Measuring the router bench on its server: the overhead at low load, one router's ceiling, the
target's capacity, and each scenario's seeded arrivals replayed at FIFO and at each router."""
from __future__ import annotations

import asyncio
import os
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from dspark.bench.jsonfile import read_json
from dspark.bench.client import HttpTransport
from dspark.bench.inputs import ModelInfo
from dspark.bench.load import LoadGenerator, LoadSettings, Target, arrival_schedule, summarize
from dspark.bench.resources import model_counters, scrape
from dspark.bench.results import BenchResult, relative_band
from dspark.bench.router.repository import bench_server
from dspark.bench.router.result import (COLUMNS, METRICS, Run, _median, histogram_delta, router_histograms,
                                        scenario_rows, timeline)
from dspark.bench.router.scenarios import (ALL, CEILING_OUTSTANDING, ROUTER_CEILING_INSTANCES, TIERS, UNLOADED_CALLS,
                                           RouterBenchSettings, Scenario, classify)


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

    async def closed_loop(self, model: str, outstanding: int, seconds: float, tiers: bool = False) -> dict:
        """Answers per second with ``outstanding`` requests always in flight, after 1 s warm-up,
        in three windows (req/s and its band over them); ``tiers``: the requests carry the tiers
        of the settings' mix (a router), else none."""
        targets = ([replace(t, weight=w) for t, w in zip(await self.targets(model, TIERS), self.settings.tier_mix)]
                   if tiers else await self.targets(model, [None]))
        generator = self.generator([t for t in targets if t.weight > 0], warmup_s=1.0, window_s=seconds / 3,
                                   stable_windows=3, max_windows=3)
        point = await generator.run_point("concurrency", outstanding)
        figures = summarize(point.records, point.duration_s)
        return {"qps": figures["qps"], "p50_ms": figures["p50_ms"], "errors": figures["errors"],
                "band": {"qps": relative_band([w["qps"] for w in point.windows])}}

    async def capacity(self) -> list[dict]:
        """The target's capacity and the router's in front of it: closed loop with 4 requests per
        target instance outstanding, directly and through the default router in turn, round by
        round (pairs cancel the machine's drift); medians over the rounds."""
        s = self.settings
        outstanding = 4 * s.instances
        direct, routed = [], []
        for _ in range(s.capacity_rounds):
            direct.append(await self.closed_loop("bench_target", outstanding, s.capacity_s))
            routed.append(await self.closed_loop("bench_router", outstanding, s.capacity_s, tiers=True))
        ratios = [r["qps"] / d["qps"] for d, r in zip(direct, routed)]
        rows = []
        for mode, model, runs in (("direct", "bench_target", direct), ("router", "bench_router", routed)):
            qps = [r["qps"] for r in runs]
            rows.append({"table": "reference", "scenario": "capacity", "mode": mode, "tier": ALL, "model": model,
                         "qps": _median(qps), "p50_ms": _median([r["p50_ms"] for r in runs]),
                         "qps_runs": [round(q, 1) for q in qps], "goodput": _median(qps),
                         **({"ideal_qps": 1000 * s.instances / s.service_ms} if mode == "direct" else
                            {"x_direct": _median(ratios)}),
                         "band": {"qps": relative_band(qps), "goodput": relative_band(qps)}})
        self.log(f"capacity (closed loop, {outstanding} outstanding): target directly {rows[0]['qps']:.1f} req/s "
                 f"(ideal {1000 * s.instances / s.service_ms:.1f}), through the router {rows[1]['qps']:.1f} "
                 f"({rows[1]['x_direct']:.3f}x)")
        return rows

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
        schedule = arrival_schedule(scenario.duration_s, scenario.rate_at, self.settings.tier_mix, seed,
                                    self.settings.arrivals)
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
            out[model] = read_json(path, "stages")
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
        capacity_rows = await bench.capacity()
        rows += capacity_rows
        capacity = capacity_rows[0]["qps"]
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
        notes.append(f"capacity: closed loop, {4 * s.instances} outstanding, the target directly and through the router "
                     f"(tiers in the mix) alternating, {s.capacity_rounds} rounds of {s.capacity_s:g} s each; medians "
                     f"of the rounds, the router's 'x direct' the median of the rounds' ratios; unloaded diamond p99 "
                     f"through the router ({UNLOADED_CALLS} sequential calls before each repeat): "
                     f"{_median(unloaded):.1f} ms")
        notes += [_stage_line(m, st) + " over all scenarios" for m, st in stages.items()]
        return rows, series, notes
    finally:
        await bench.transport.close()


def run_router_bench(settings: RouterBenchSettings, log: Callable[[str], None] = lambda _: None) -> BenchResult:
    """Start the bench's server, measure, and return the result (rows: scenario, mode, tier)."""
    load_start = round(os.getloadavg()[0], 1)
    with bench_server(settings) as (server, stages_dir):
        log(f"server on {server.http_url}: target {settings.instances} instances x {settings.service_ms:g} ms")
        rows, series, notes = asyncio.run(measure(server.http_url, server.metrics_url, stages_dir, settings, log))
    if settings.scenarios:
        notes.insert(0, f"target {settings.instances} x {settings.service_ms:g} ms; open-loop {settings.arrivals} "
                        f"arrivals, tiers {'/'.join(f'{t} {m:g}%' for t, m in zip(TIERS, settings.tier_mix))}, the "
                        "same seeded arrivals "
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

