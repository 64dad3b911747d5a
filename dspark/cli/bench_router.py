"""`dspark bench router`: the QoS router against plain FIFO, open loop, in one run.

It builds a temporary repository and starts its own server:

- a sleep-based target (``--service-ms`` × ``--instances``; default 20 ms × 2, the issue's
  held-out scenario) with the router in front of it (the default routing.yaml: max_inflight
  auto, headroom 1 for diamond, deadlines 2/3/5 s; shares 100 %, no shadow) and any
  ``--variant MAX_INFLIGHT:HEADROOM`` routers beside it;
- for the overhead at low load, targets of 1 ms and of the service time, each with a router and
  two bare BLS forwarders measured the same way (sequential HTTP): one that returns the response
  from ``execute`` (the floor of the fast path) and one whose worker thread answers through the
  response sender (the floor of any queued path); stage timings from inside the routers.

Then it measures the target's capacity (closed loop) and drives the same seeded open-loop
Poisson arrivals (tier mix 10 % diamond / 30 % gold / 60 % standard) at the target directly
(FIFO) and at each router: bursty below capacity (mean 0.85x) and sustained overload (1.5x, 2x).
It prints tables and checks against the targets, writes JSON (settings, CPU, results) and PNG
plots (latency over time per tier; goodput vs offered load).

Table columns: p50/p90/p99 from the moment the client sent the request; ``inside``: the upper
bound of the bucket holding the router's own p99 (its latency histogram, execute to answer);
``arrival``: p99 from the scheduled arrival, i.e. plus the client's own lateness in sending. The
two p99s differ only when the load generator itself is starved of CPU (the table's goodput line
gives that lateness); the checks use the first.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import click
import numpy as np
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from dspark.cli.bench import percentile
from dspark.routing.config import RoutingConfig

TIERS = tuple(RoutingConfig().tiers)  # diamond, gold, standard
TIER_MIX = (10, 30, 60)
STAGES_ENV = "DSPARK_ROUTER_STAGES"  # backends/qos_router writes its stage timings there
ROUTER_CEILING_INSTANCES = 4  # instances of the zero-time target behind the router-throughput measurement


def model_config(name: str, backend: str, instances: int, parameters: dict[str, str]) -> str:
    """config.pbtxt of a bench model (x -> y, version), through Triton's own schema."""
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
    lead_ms: float = 2.0

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
            raise click.BadParameter(f"'{text}': expected MAX_INFLIGHT:HEADROOM[:LEAD_MS], e.g. 3:0 or auto:1:2",
                                     param_hint="--variant") from None


@dataclass
class Outcome:
    tier: str
    at: float  # scheduled arrival, seconds since the scenario started
    latency_s: float | None  # from sending it; None when not answered successfully
    reason: str  # "ok", "deadline", "queue_full", "target_timeout", "error", "hung"
    finished_at: float
    send_lag_s: float = 0.0  # how late the client sent it (the load generator's own CPU starvation)


@dataclass
class Scenario:
    name: str
    duration_s: float
    offered: float  # mean offered load, x capacity
    rate_at: Callable[[float], float]  # t -> arrivals/s


@dataclass
class Result:
    scenario: str
    mode: str
    outcomes: list[Outcome] = field(default_factory=list)
    duration_s: float = 0.0
    front_queue_ms: float = 0.0  # mean time requests waited in Triton's queue in front of the model
    inside: dict = field(default_factory=dict)  # tier -> the router's own latency histogram (its view)

    def tier_stats(self, tier: str, deadline_s: float) -> dict:
        mine = [o for o in self.outcomes if o.tier == tier]
        ok = sorted(o.latency_s for o in mine if o.reason == "ok")
        scheduled = [o.latency_s + o.send_lag_s for o in mine if o.reason == "ok"]
        return {
            "p99_from_arrival_ms": 1000 * percentile(scheduled, 99),
            "sent": len(mine),
            "ok": len(ok),
            "within_deadline": sum(latency <= deadline_s for latency in ok),
            "p50_ms": 1000 * percentile(ok, 50),
            "p90_ms": 1000 * percentile(ok, 90),
            "p99_ms": 1000 * percentile(ok, 99),
            "rejected": dict(Counter(o.reason for o in mine if o.reason != "ok")),
        }

    def goodput(self) -> float:
        """Successful answers per second that arrived while the scenario ran."""
        return sum(o.reason == "ok" and o.finished_at <= self.duration_s for o in self.outcomes) / self.duration_s


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_repository(root: Path, service_ms: float, instances: int, variants: list[Variant]) -> None:
    def add(name: str, backend: str, count: int, parameters: dict[str, str], model_py: str | None = None):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(model_config(name, backend, count, parameters))
        if model_py is not None:
            (root / name / "1" / "model.py").write_text(model_py)

    default = replace(RoutingConfig(), shares={1: 100.0})  # the demo's routing: shares 100, no shadow
    for target, service in (("bench_target", service_ms), ("bench_t1", 1.0)):
        add(target, "router_demo_target", instances, {"service_time_ms": f"{service:g}"})
        add(f"fwd_return_{target}", "python", 1, {}, FORWARD_RETURN.format(target=target))
        add(f"fwd_sender_{target}", "python", 1, {}, FORWARD_SENDER.format(target=target))
    # the router's own ceiling: a zero-time target with more instances than the CPU has cores
    add("bench_t0", "router_demo_target", ROUTER_CEILING_INSTANCES, {"service_time_ms": "0"})
    routers = {variant.model: replace(default, max_inflight=variant.max_inflight, top_tier_headroom=variant.headroom,
                                      handoff_lead_ms=variant.lead_ms)
               for variant in [Variant(), *variants]}
    routers["router_t1"] = default
    routers["router_t0"] = default
    routers["router_t1_queued"] = replace(default, inline_max_ms=0.0)
    for name, routing in routers.items():
        target = "bench_t1" if name.startswith("router_t1") else "bench_t0" if name == "router_t0" else "bench_target"
        add(name, "qos_router", 1, {"target_model": target, "target_versions": "1"})
        routing.save(root / name / "routing.yaml")


def arrival_times(scenario: Scenario, seed: int) -> list[tuple[float, str]]:
    """A Poisson process with rate rate_at(t) (thinning), each arrival with a tier (10/30/60%)."""
    rng = random.Random(seed)
    peak = max(scenario.rate_at(t / 10) for t in range(int(scenario.duration_s * 10)))
    out, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= scenario.duration_s:
            return out
        if rng.random() < scenario.rate_at(t) / peak:
            out.append((t, rng.choices(TIERS, weights=TIER_MIX)[0]))


def classify(text: str) -> str:
    for marker, reason in (("queue deadline", "deadline"), ("queue is full", "queue_full"),
                           ("did not answer within", "target_timeout"), ("shutting down", "shutdown")):
        if marker in text:
            return reason
    return "error"


async def drive(client, model: str, arrivals: list[tuple[float, str]], with_tiers: bool,
                hang_s: float) -> list[Outcome]:
    """Send each arrival at its time without waiting for earlier ones (open loop)."""
    import tritonclient.http.aio as httpclient

    x = np.ones(4, dtype=np.float32)
    outcomes: list[Outcome] = [None] * len(arrivals)  # type: ignore[list-item]
    start = time.perf_counter() + 0.05

    async def one(i: int, at: float, tier: str) -> None:
        inp = httpclient.InferInput("x", [4], "FP32")
        inp.set_data_from_numpy(x)
        lag = time.perf_counter() - (start + at)  # the client's own delay in sending it
        try:
            await asyncio.wait_for(client.infer(model, [inp], parameters={"tier": tier} if with_tiers else None),
                                   timeout=hang_s)
            latency, reason = time.perf_counter() - (start + at) - lag, "ok"
        except asyncio.TimeoutError:
            latency, reason = None, "hung"
        except Exception as exc:
            latency, reason = None, classify(str(exc))
        outcomes[i] = Outcome(tier, at, latency, reason, time.perf_counter() - start, lag)

    tasks = []
    for i, (at, tier) in enumerate(arrivals):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i, at, tier)))
    await asyncio.gather(*tasks)
    return outcomes


async def run_scenarios(url: str, metrics_url: str, scenarios: list[Scenario], modes: list[tuple[str, str, bool]],
                        repeat: int, seed: int, echo) -> tuple[list[Result], list[float]]:
    """All runs on one client, so its connection pool is reused: in a fresh pool every new
    connection's set-up lands in the measured latency as the outstanding requests grow."""
    import tritonclient.http.aio as httpclient

    client = httpclient.InferenceServerClient(url, conn_limit=1000)
    results, unloaded = [], []
    try:
        for rep in range(repeat):
            unloaded.append(unloaded_p99(url, calls=200))
            for k, scenario in enumerate(scenarios):
                arrivals = arrival_times(scenario, seed + 100 * rep + k)
                for mode, model, tiers in modes:
                    before = await queue_stats(client, model), router_histograms(metrics_url, model)
                    outcomes = await drive(client, model, arrivals, tiers, hang_s=120)
                    await asyncio.sleep(1)  # the router exports its metrics in batches
                    after = await queue_stats(client, model), router_histograms(metrics_url, model)
                    front = (after[0][0] - before[0][0]) / max(1, after[0][1] - before[0][1]) / 1e6
                    inside = {tier: {le: n - before[1].get(tier, {}).get(le, 0) for le, n in buckets.items()}
                              for tier, buckets in after[1].items()}
                    results.append(Result(scenario.name, mode, outcomes, scenario.duration_s, front, inside))
                    echo(f"  run {rep + 1}/{repeat}: {scenario.name} / {mode}: {len(arrivals)} requests", err=True)
    finally:
        await client.close()
    return results, unloaded


def router_histograms(metrics_url: str, model: str) -> dict[str, dict[float, float]]:
    """tier -> cumulative bucket counts {upper bound s: count} of the router's own end-to-end latency
    (from execute to the answer sent); empty for a model that is no router."""
    from dspark.cli.route import read_metrics

    out: dict[str, dict[float, float]] = defaultdict(dict)
    for name, labels, value in read_metrics(metrics_url, model):
        if name == "dspark_router_latency_seconds_bucket":
            le = float(labels["le"])
            out[labels["tier"]][le] = out[labels["tier"]].get(le, 0) + value
    return out


def histogram_p99(buckets: dict[float, float]) -> float:
    """The upper bound (ms) of the bucket holding the 99th percentile of cumulative buckets."""
    total = buckets.get(float("inf"), 0)
    for le in sorted(buckets):
        if total and buckets[le] >= 0.99 * total:
            return 1000 * le
    return float("nan")


async def queue_stats(client, model: str) -> tuple[int, int]:
    """(total ns, count) requests of ``model`` waited in Triton's queue, from its statistics."""
    stats = (await client.get_inference_statistics(model))["model_stats"][0]["inference_stats"]["queue"]
    return int(stats.get("ns", 0)), int(stats.get("count", 0))


async def measure_capacity(url: str, model: str, concurrency: int, seconds: float) -> float:
    """Completions per second with `concurrency` requests always outstanding (closed loop)."""
    import tritonclient.http.aio as httpclient

    client = httpclient.InferenceServerClient(url, conn_limit=concurrency)
    inp = httpclient.InferInput("x", [4], "FP32")
    inp.set_data_from_numpy(np.ones(4, dtype=np.float32))
    await asyncio.gather(*(client.infer(model, [inp]) for _ in range(concurrency)))  # warm up
    stop = time.perf_counter() + seconds
    done = 0

    async def worker():
        nonlocal done
        while time.perf_counter() < stop:
            await client.infer(model, [inp])
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    await client.close()
    return done / elapsed


def measure_overhead(url: str, models: list[str], rounds: int, calls: int) -> tuple[float, dict[str, float]]:
    """Sequential HTTP calls, the models interleaved round by round: the first model's p50 (ms,
    median of the rounds) and, for each other model, the median over rounds of its p50 minus the
    first model's p50 in the same round (pairs within a round cancel the machine's drift)."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url)
    inp = httpclient.InferInput("x", [4], "FP32")
    inp.set_data_from_numpy(np.ones(4, dtype=np.float32))
    for model in models:
        for _ in range(10):
            client.infer(model, [inp])
    p50 = defaultdict(list)
    for _ in range(rounds):
        for model in models:
            times = []
            for _ in range(calls):
                t = time.perf_counter()
                client.infer(model, [inp], parameters={"tier": "gold"} if "router" in model else None)
                times.append(time.perf_counter() - t)
            p50[model].append(1000 * statistics.median(times))
    base = p50[models[0]]
    return statistics.median(base), {m: statistics.median(a - b for a, b in zip(p50[m], base)) for m in models[1:]}


def unloaded_p99(url: str, calls: int) -> float:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url)
    inp = httpclient.InferInput("x", [4], "FP32")
    inp.set_data_from_numpy(np.ones(4, dtype=np.float32))
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        client.infer("bench_router", [inp], parameters={"tier": "diamond"})
        times.append(time.perf_counter() - t)
    return 1000 * percentile(times, 99)


def bursty(capacity: float, duration_s: float, base: float = 0.65, burst: float = 1.65,
           period_s: float = 10.0, burst_s: float = 2.0) -> Scenario:
    mean = (base * (period_s - burst_s) + burst * burst_s) / period_s
    return Scenario(f"bursty {mean:.2f}x ({burst:g}x {burst_s:g}s/{period_s:g}s)", duration_s, mean,
                    lambda t: capacity * (burst if (t % period_s) >= period_s - burst_s else base))


def overload(capacity: float, factor: float, duration_s: float) -> Scenario:
    return Scenario(f"overload {factor:g}x", duration_s, factor, lambda t: capacity * factor)


def aggregate(results: list[Result], deadlines_s: dict[str, float]) -> dict[tuple[str, str], dict]:
    """Per (scenario, mode) over the repeats: counts summed, percentiles and goodput as medians of the runs."""
    groups: dict[tuple[str, str], list[Result]] = defaultdict(list)
    for r in results:
        groups[(r.scenario, r.mode)].append(r)
    out = {}
    for key, runs in groups.items():
        tiers = {}
        for tier in TIERS:
            per_run = [r.tier_stats(tier, deadlines_s[tier]) for r in runs]
            rejected = Counter()
            for st in per_run:
                rejected.update(st["rejected"])
            tiers[tier] = {
                **{count: sum(st[count] for st in per_run) for count in ("sent", "ok", "within_deadline")},
                "router_p99_ms_at_most": statistics.median(histogram_p99(r.inside.get(tier, {})) for r in runs),
                **{p: statistics.median(st[p] for st in per_run)
                   for p in ("p50_ms", "p90_ms", "p99_ms", "p99_from_arrival_ms")},
                "p99_ms_runs": [round(st["p99_ms"], 1) for st in per_run],
                "rejected": dict(rejected),
            }
        out[key] = {"tiers": tiers, "goodput": statistics.median(r.goodput() for r in runs),
                    "client_send_lag_p99_ms": statistics.median(
                        1000 * percentile([o.send_lag_s for o in r.outcomes], 99) for r in runs),
                    "triton_queue_ms": statistics.median(r.front_queue_ms for r in runs),
                    "unexplained": sum(o.reason in ("hung", "error") for r in runs for o in r.outcomes)}
    return out


def report(stats: dict[tuple[str, str], dict], capacity: float, echo) -> None:
    echo(f"{'scenario':<28} {'mode':<18} {'tier':<9} {'sent':>5} {'ok':>5} {'in ddl':>7} {'p50 ms':>7} "
         f"{'p90 ms':>7} {'p99 ms':>8} {'inside':>7} {'arrival':>8}  {'p99 of each run':<20} rejected")
    for (scenario, mode), agg in stats.items():
        for tier in TIERS:
            st = agg["tiers"][tier]
            rej = ", ".join(f"{k} {v}" for k, v in sorted(st["rejected"].items())) or "-"
            runs = "/".join(f"{v:.0f}" for v in st["p99_ms_runs"])
            within = 100 * st["within_deadline"] / max(1, st["sent"])
            inside = st["router_p99_ms_at_most"]
            inside = f"<={inside:.0f}" if inside == inside else "-"
            echo(f"{scenario:<28} {mode:<18} {tier:<9} {st['sent']:>5} {st['ok']:>5} {within:>6.1f}% "
                 f"{st['p50_ms']:>7.1f} {st['p90_ms']:>7.1f} {st['p99_ms']:>8.1f} {inside:>7} "
                 f"{st['p99_from_arrival_ms']:>8.1f}  {runs:<20} {rej}")
        echo(f"{scenario:<28} {mode:<18} goodput {agg['goodput']:.1f}/s = {agg['goodput'] / capacity:.3f}x capacity; "
             f"Triton's queue in front of the model {agg['triton_queue_ms']:.1f} ms mean; "
             f"the client sent late by {agg['client_send_lag_p99_ms']:.1f} ms p99")


def summarize(stats: dict[tuple[str, str], dict], capacity: float, base_p99: float, overhead: dict,
              router_mode: str) -> list[tuple[str, bool]]:
    """The issue's targets, each as (line, met)."""
    scenarios = list(dict.fromkeys(scenario for scenario, _ in stats))
    checks = []
    for b in (s for s in scenarios if s.startswith("bursty")):
        std = stats[(b, router_mode)]["tiers"]["standard"]
        if (b, "fifo") in stats:
            fifo_d, rtr_d = stats[(b, "fifo")]["tiers"]["diamond"], stats[(b, router_mode)]["tiers"]["diamond"]
            ratio = rtr_d["p99_ms"] / fifo_d["p99_ms"]
            checks.append((f"bursty: diamond p99 {rtr_d['p99_ms']:.1f} ms = {ratio:.2f}x FIFO's {fifo_d['p99_ms']:.1f} "
                           f"ms (target <= 0.58x)", ratio <= 0.58))
        share = std["within_deadline"] / max(1, std["sent"])
        checks.append((f"bursty: standard within its deadline {100 * share:.2f}% (target >= 99.5%)", share >= 0.995))
    for s in (s for s in scenarios if s.startswith("overload")):
        agg = stats[(s, router_mode)]
        d = agg["tiers"]["diamond"]
        checks.append((f"{s}: goodput {agg['goodput'] / capacity:.3f}x capacity (target >= 0.97x)",
                       agg["goodput"] >= 0.97 * capacity))
        checks.append((f"{s}: diamond p99 {d['p99_ms']:.1f} ms = {d['p99_ms'] / base_p99:.2f}x unloaded "
                       f"{base_p99:.1f} ms (target <= 2x)", d["p99_ms"] <= 2 * base_p99))
        checks.append((f"{s}: {agg['unexplained']} requests hung or failed without a reason (target 0)",
                       agg["unexplained"] == 0))
    for service, added in overhead.items():
        checks.append((f"router overhead at low load, {service} target: {added:+.2f} ms p50 (target < 1 ms; "
                       f"moonshot < 0.5 ms)", added < 1.0))
    return checks


def plot(results: list[Result], stats: dict, capacity: float, modes: list[str], scenarios: list[Scenario],
         deadlines_s: dict[str, float], out_prefix: Path) -> list[Path]:
    """latency-over-time (first run of each scenario, one panel per mode) and goodput-vs-load PNGs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"diamond": "tab:blue", "gold": "tab:orange", "standard": "tab:gray"}
    first = {}
    for r in results:
        first.setdefault((r.scenario, r.mode), r)
    fig, axes = plt.subplots(len(scenarios), len(modes), figsize=(4.5 * len(modes), 3.2 * len(scenarios)),
                             squeeze=False, sharey="row")
    for row, scenario in enumerate(scenarios):
        for col, mode in enumerate(modes):
            ax = axes[row][col]
            run = first[(scenario.name, mode)]
            for tier in reversed(TIERS):
                ok = [(o.at, 1000 * o.latency_s) for o in run.outcomes if o.tier == tier and o.reason == "ok"]
                shed = [o.at for o in run.outcomes if o.tier == tier and o.reason != "ok"]
                if ok:
                    ax.scatter(*zip(*ok), s=3, color=colors[tier], label=f"{tier}")
                if shed:
                    ax.scatter(shed, [1000 * deadlines_s[tier]] * len(shed), s=6, marker="x", color=colors[tier],
                               alpha=0.4, label=f"{tier} rejected")
            ax.set_yscale("log")
            ax.set_title(f"{scenario.name}\n{mode}", fontsize=8)
            ax.set_xlabel("arrival time (s)", fontsize=8)
            if col == 0:
                ax.set_ylabel("latency (ms)", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][-1].legend(fontsize=6, markerscale=3)
    fig.tight_layout()
    latency_png = out_prefix.with_name(out_prefix.name + "-latency.png")
    fig.savefig(latency_png, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.6))
    offered = [s.offered for s in scenarios]
    for mode in modes:
        ax.plot(offered, [stats[(s.name, mode)]["goodput"] / capacity for s in scenarios], marker="o", label=mode)
    ax.plot([0, max(offered)], [0, max(offered)], color="lightgray", lw=0.8, ls=":")
    ax.axhline(1.0, color="lightgray", lw=0.8)
    ax.axhline(0.97, color="tab:red", lw=0.8, ls="--", label="target 0.97x")
    ax.set_xlabel("offered load (x measured capacity)")
    ax.set_ylabel("goodput (x measured capacity)")
    ax.set_ylim(0, 1.2)
    ax.legend(fontsize=7)
    fig.tight_layout()
    goodput_png = out_prefix.with_name(out_prefix.name + "-goodput.png")
    fig.savefig(goodput_png, dpi=110)
    plt.close(fig)
    return [latency_png, goodput_png]


def read_stages(folder: Path, models: list[str]) -> dict[str, dict]:
    time.sleep(0.7)  # the routers write their stage timings every 0.5 s
    out = {}
    for model in models:
        path = folder / f"{model}.json"
        if path.exists():
            out[model] = json.loads(path.read_text())
    return out


def measure_overheads(url: str, stages_dir: Path, service_ms: float, rounds: int, echo) -> tuple[dict, dict]:
    """The router's overhead at low load (1 ms and ``service_ms`` targets) beside the bare BLS
    forwarders, with the routers' stage timings, and one router instance's throughput ceiling."""
    overhead = {}
    for target, label, calls in (("bench_t1", "1 ms", 100), ("bench_target", f"{service_ms:g} ms", 60)):
        routers = ["router_t1", "router_t1_queued"] if target == "bench_t1" else ["bench_router"]
        models = [target, f"fwd_return_{target}", f"fwd_sender_{target}", *routers]
        direct, added_ms = measure_overhead(url, models, rounds, calls)
        overhead[label] = {"direct_p50_ms": direct, **added_ms, "stages_ms": read_stages(stages_dir, routers)}
        echo(f"overhead at low load, {label} target (sequential HTTP; p50 of {calls} calls minus the direct "
             f"p50 of the same round, median of {rounds} rounds): direct {direct:.2f} ms; added: " +
             ", ".join(f"{m} {v:+.2f}" for m, v in added_ms.items()))
        for model, stages in overhead[label]["stages_ms"].items():
            echo(f"  inside {model} (p50 per stage): " + ", ".join(f"{s} {v['p50_ms']:.3f} ms" for s, v in stages.items()))
    ceiling = {model: asyncio.run(measure_capacity(url, model, concurrency=32, seconds=6))
               for model in ("bench_t0", "router_t0")}
    echo(f"throughput of one router instance (closed loop, 32 outstanding, zero-time target with "
         f"{ROUTER_CEILING_INSTANCES} instances): router {ceiling['router_t0']:.0f} req/s, the target "
         f"direct {ceiling['bench_t0']:.0f} req/s")
    return overhead, {"direct_req_s": ceiling["bench_t0"], "router_req_s": ceiling["router_t0"],
                      "outstanding": 32, "target_instances": ROUTER_CEILING_INSTANCES}


@click.command(name="router")
@click.option("--service-ms", default=20.0, show_default=True, help="Target's service time per request.")
@click.option("--instances", default=2, show_default=True, help="Target instances (capacity = instances/service time).")
@click.option("--variant", "variants", multiple=True, type=Variant.parse, metavar="MAX_INFLIGHT:HEADROOM[:LEAD_MS]",
              help="Also run a router with these routing.yaml settings (repeatable), e.g. 2:0 (as many calls as "
                   "instances), 3:0 (instances+1 for every tier), auto:1:0 (headroom, no hand-off lead).")
@click.option("--bursty-s", default=20.0, show_default=True, help="Length of the bursty scenario per mode (0: skip it).")
@click.option("--skip-fifo", is_flag=True, help="Only the routers (A/B of router settings in less time).")
@click.option("--skip-overhead", is_flag=True, help="No low-load overhead measurement (A/B runs).")
@click.option("--overload-s", default=15.0, show_default=True, help="Length of each overload scenario per mode.")
@click.option("--repeat", default=3, show_default=True,
              help="Runs of every scenario; the table shows medians of the runs' percentiles.")
@click.option("--overload", "overloads", multiple=True, type=float, default=(1.5, 2.0), show_default=True,
              help="Overload factors (repeatable).")
@click.option("--overhead-rounds", default=7, show_default=True, help="Rounds of the low-load overhead measurement.")
@click.option("--seed", default=7, show_default=True)
@click.option("--overhead-only", is_flag=True, help="Only the low-load overhead measurement (a few minutes).")
@click.option("--out", "out_prefix", type=click.Path(path_type=Path), default=Path("bench-router"), show_default=True,
              help="Results go to OUT.json, OUT-latency.png and OUT-goodput.png.")
def router(service_ms, instances, variants, bursty_s, skip_fifo, skip_overhead, overload_s, overloads, repeat, overhead_rounds, seed,
           overhead_only, out_prefix) -> None:
    """QoS router vs plain FIFO: bursty below capacity and sustained overload, plus router overhead."""
    from dspark.triton.server import TritonServer

    variants = list(dict.fromkeys(v for v in variants if v != Variant()))
    deadlines_s = {t: policy.deadline_ms / 1000 for t, policy in RoutingConfig().tiers.items()}
    settings = {"service_ms": service_ms, "instances": instances, "variants": [v.label for v in variants],
                "bursty_s": bursty_s, "skip_fifo": skip_fifo, "overload_s": overload_s, "overloads": list(overloads), "repeat": repeat,
                "seed": seed, "tier_mix": dict(zip(TIERS, TIER_MIX)), "deadlines_ms": {
                    t: 1000 * s for t, s in deadlines_s.items()}, "overhead_rounds": overhead_rounds}
    machine = {"cpu": cpu_model(), "cores": os.cpu_count(), "loadavg_start": os.getloadavg()}
    root = Path(tempfile.mkdtemp(prefix="dspark-bench-router-"))
    build_repository(root / "repo", service_ms, instances, variants)
    stages_dir = root / "stages"
    stages_dir.mkdir()
    os.environ[STAGES_ENV] = str(stages_dir)
    server = TritonServer([root / "repo"])
    server.start()
    out: dict = {"settings": settings, "machine": machine}
    try:
        url = server.http_url
        click.echo(f"target: {instances} instances x {service_ms:g} ms; CPU {machine['cpu']} "
                   f"({machine['cores']} cores, load {machine['loadavg_start'][0]:.1f})")
        added: dict[str, float] = {}
        if not skip_overhead:
            out["overhead"], out["router_ceiling"] = measure_overheads(url, stages_dir, service_ms, overhead_rounds,
                                                                       click.echo)
            added = {label: o["bench_router" if "bench_router" in o else "router_t1"]
                     for label, o in out["overhead"].items()}
        if overhead_only:
            for label, value in added.items():
                click.echo(f"[{'PASS' if value < 1.0 else 'MISS'}] router overhead at low load, {label} target: "
                           f"{value:+.2f} ms p50 (target < 1 ms; moonshot < 0.5 ms)")
            return
        capacity = asyncio.run(measure_capacity(url, "bench_target", concurrency=4 * instances, seconds=8))
        out["capacity"] = capacity
        click.echo(f"capacity (closed loop, {4 * instances} outstanding, target direct): {capacity:.1f} req/s "
                   f"(ideal {1000 * instances / service_ms:.1f})")
        scenarios = ([bursty(capacity, bursty_s)] if bursty_s > 0 else []) + [
            overload(capacity, f, overload_s) for f in overloads]
        modes = ([] if skip_fifo else [("fifo", "bench_target", False)]) + [
            (v.label, v.model, True) for v in [Variant(), *variants]]
        results, unloaded = asyncio.run(run_scenarios(url, server.metrics_url, scenarios, modes, repeat, seed,
                                                      click.echo))
        out["stages_ms_under_load"] = under_load = read_stages(stages_dir, [model for _, model, tiers in modes if tiers])
        for model, stages in under_load.items():
            click.echo(f"inside {model} over all scenarios (p50 per stage): " +
                       ", ".join(f"{s} {v['p50_ms']:.3f} ms" for s, v in stages.items()))
        base_p99 = statistics.median(unloaded)
        out["unloaded_diamond_p99_ms"] = {"median": base_p99, "runs": unloaded}
        click.echo(f"diamond p99 through the router, unloaded (200 sequential calls before each run): "
                   f"{base_p99:.1f} ms (runs: {', '.join(f'{v:.1f}' for v in unloaded)})")
        stats = aggregate(results, deadlines_s)
        click.echo("")
        report(stats, capacity, click.echo)
        click.echo("")
        checks = []
        for mode, _, with_tiers in modes:
            if not with_tiers:
                continue
            for text, ok in summarize(stats, capacity, base_p99, added if mode == "router" else {}, mode):
                checks.append({"mode": mode, "check": text, "met": ok})
                click.echo(f"[{'PASS' if ok else 'MISS'}] {mode}: {text}")
        out["checks"] = checks
        out["results"] = [{"scenario": s, "mode": m, "offered_x": next(x.offered for x in scenarios if x.name == s),
                           **agg} for (s, m), agg in stats.items()]
        pngs = plot(results, stats, capacity, [m for m, _, _ in modes], scenarios, deadlines_s, out_prefix)
        click.echo("plots: " + ", ".join(str(p) for p in pngs))
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
        os.environ.pop(STAGES_ENV, None)
        machine["loadavg_end"] = os.getloadavg()
        json_path = out_prefix.with_name(out_prefix.name + ".json")
        json_path.write_text(json.dumps(out, indent=1))
        click.echo(f"results: {json_path}")
