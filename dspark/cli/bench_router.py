"""`dspark bench router`: the QoS router against plain FIFO, open loop, in one run.

It builds a temporary repository (a sleep-based target with a known service time and
instance count, a router in front of it, and a zero-time target/router pair for the overhead
measurement), starts its own server, measures the target's capacity, then drives the same
seeded arrival sequence with a tier mix at the router and at the target directly (FIFO):
bursty-below-capacity and sustained-overload scenarios.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import click
import numpy as np
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from dspark.cli.bench import percentile
from dspark.cli.route import read_metrics
from dspark.routing.config import RoutingConfig

DEFAULT_TIERS = RoutingConfig().tiers  # the demo's weights 8 / 3 / 1
TIERS = tuple(DEFAULT_TIERS)


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


PASSTHROUGH_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    # the floor: a minimal synchronous BLS forwarder, for comparison with the router's overhead
    def execute(self, requests):
        return [pb_utils.InferenceResponse(pb_utils.InferenceRequest(
            model_name="bench_fast_target", inputs=r.inputs(), requested_output_names=["y", "version"]
        ).exec().output_tensors()) for r in requests]
"""


@dataclass
class Outcome:
    tier: str
    latency_s: float | None  # None when not answered successfully
    reason: str  # "ok", "deadline", "queue_full", "error", "hung"
    finished_at: float  # seconds since the scenario started


@dataclass
class Scenario:
    name: str
    duration_s: float
    rate_at: callable  # t -> arrivals/s


@dataclass
class Result:
    scenario: str
    mode: str
    outcomes: list[Outcome] = field(default_factory=list)
    duration_s: float = 0.0

    def tier_stats(self, tier: str) -> dict:
        mine = [o for o in self.outcomes if o.tier == tier]
        ok = sorted(o.latency_s for o in mine if o.reason == "ok")
        return {
            "sent": len(mine),
            "ok": len(ok),
            "p50_ms": 1000 * percentile(ok, 50),
            "p99_ms": 1000 * percentile(ok, 99),
            "rejected": dict(Counter(o.reason for o in mine if o.reason != "ok")),
        }

    def goodput(self) -> float:
        """Successful answers per second that arrived while the scenario ran."""
        return sum(o.reason == "ok" and o.finished_at <= self.duration_s for o in self.outcomes) / self.duration_s


def build_repository(root: Path, service_ms: float, instances: int, max_inflight: int,
                     deadlines_ms: dict[str, float]) -> None:
    for name, service in (("bench_target", service_ms), ("bench_fast_target", 0)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(
            model_config(name, "router_demo_target", instances, {"service_time_ms": str(service)}))
    for name, target in (("bench_router", "bench_target"), ("bench_fast_router", "bench_fast_target")):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(
            model_config(name, "qos_router", 1, {"target_model": target, "target_versions": "1"}))
        RoutingConfig(
            tiers={t: replace(policy, deadline_ms=deadlines_ms[t], max_queue=10_000)
                   for t, policy in DEFAULT_TIERS.items()},
            max_inflight=max_inflight,
        ).validate().save(root / name / "routing.yaml")
    (root / "bench_passthrough" / "1").mkdir(parents=True)
    (root / "bench_passthrough" / "1" / "model.py").write_text(PASSTHROUGH_MODEL)
    (root / "bench_passthrough" / "config.pbtxt").write_text(model_config("bench_passthrough", "python", 1, {}))


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
            out.append((t, rng.choices(TIERS, weights=(10, 30, 60))[0]))


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
        try:
            await asyncio.wait_for(client.infer(model, [inp], parameters={"tier": tier} if with_tiers else None),
                                   timeout=hang_s)
            latency, reason = time.perf_counter() - (start + at), "ok"
        except asyncio.TimeoutError:
            latency, reason = None, "hung"
        except Exception as exc:
            text = str(exc)
            latency = None
            reason = ("deadline" if "queue deadline" in text else "queue_full" if "queue is full" in text
                      else "error")
        outcomes[i] = Outcome(tier, latency, reason, time.perf_counter() - start)

    tasks = []
    for i, (at, tier) in enumerate(arrivals):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i, at, tier)))
    await asyncio.gather(*tasks)
    return outcomes


async def run_scenarios(url: str, scenarios: list[Scenario], repeat: int, seed: int,
                        echo) -> tuple[list[Result], list[float]]:
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
                for mode, model, tiers in (("fifo", "bench_target", False), ("router", "bench_router", True)):
                    outcomes = await drive(client, model, arrivals, tiers, hang_s=120)
                    results.append(Result(scenario.name, mode, outcomes, scenario.duration_s))
                    echo(f"  run {rep + 1}/{repeat}: {scenario.name} / {mode}: {len(arrivals)} requests", err=True)
                    await asyncio.sleep(1)
    finally:
        await client.close()
    return results, unloaded


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


def measure_overhead(url: str, rounds: int, calls: int) -> dict[str, float]:
    """Median over rounds of the p50 latency (ms) of a zero-time target called directly, through a
    minimal synchronous BLS forwarder, and through the router."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url)
    inp = httpclient.InferInput("x", [4], "FP32")
    inp.set_data_from_numpy(np.ones(4, dtype=np.float32))
    p50 = defaultdict(list)
    for _ in range(rounds):
        for model in ("bench_fast_target", "bench_passthrough", "bench_fast_router"):
            times = []
            for _ in range(calls):
                t = time.perf_counter()
                client.infer(model, [inp])
                times.append(time.perf_counter() - t)
            p50[model].append(1000 * statistics.median(times))
    return {model: statistics.median(values) for model, values in p50.items()}


def fast_path_count(metrics_url: str, model: str) -> float:
    """The router's dspark_router_fast_path_total from /metrics (counted every 0.5 s)."""
    time.sleep(1.0)
    return sum(v for n, _, v in read_metrics(metrics_url, model) if n == "dspark_router_fast_path_total")


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


def bursty(capacity: float, duration_s: float, base: float = 0.65, burst: float = 1.8,
           period_s: float = 10.0, burst_s: float = 2.0) -> Scenario:
    mean = (base * (period_s - burst_s) + burst * burst_s) / period_s
    return Scenario(f"bursty (mean {mean:.2f}x, bursts {burst}x for {burst_s:g} s every {period_s:g} s)",
                    duration_s,
                    lambda t: capacity * (burst if (t % period_s) >= period_s - burst_s else base))


def overload(capacity: float, factor: float, duration_s: float) -> Scenario:
    return Scenario(f"overload {factor:g}x", duration_s, lambda t: capacity * factor)


def aggregate(results: list[Result]) -> dict[tuple[str, str], dict]:
    """Per (scenario, mode) over the repeats: counts summed, p50/p99/goodput as medians of the runs."""
    groups: dict[tuple[str, str], list[Result]] = defaultdict(list)
    for r in results:
        groups[(r.scenario, r.mode)].append(r)
    out = {}
    for key, runs in groups.items():
        tiers = {}
        for tier in TIERS:
            per_run = [r.tier_stats(tier) for r in runs]
            rejected = Counter()
            for st in per_run:
                rejected.update(st["rejected"])
            tiers[tier] = {
                "sent": sum(st["sent"] for st in per_run),
                "ok": sum(st["ok"] for st in per_run),
                "p50_ms": statistics.median(st["p50_ms"] for st in per_run),
                "p99_ms": statistics.median(st["p99_ms"] for st in per_run),
                "p99_ms_runs": [round(st["p99_ms"], 1) for st in per_run],
                "rejected": dict(rejected),
            }
        out[key] = {"tiers": tiers, "goodput": statistics.median(r.goodput() for r in runs),
                    "unexplained": sum(o.reason in ("hung", "error") for r in runs for o in r.outcomes)}
    return out


def report(stats: dict[tuple[str, str], dict], capacity: float, echo) -> None:
    echo(f"{'scenario':<44} {'mode':<6} {'tier':<9} {'sent':>5} {'ok':>5} {'p50 ms':>8} {'p99 ms':>8}  "
         f"{'p99 of each run':<22} rejected")
    for (scenario, mode), agg in stats.items():
        for tier in TIERS:
            st = agg["tiers"][tier]
            rej = ", ".join(f"{k} {v}" for k, v in sorted(st["rejected"].items())) or "-"
            runs = "/".join(f"{v:.0f}" for v in st["p99_ms_runs"])
            echo(f"{scenario:<44} {mode:<6} {tier:<9} {st['sent']:>5} {st['ok']:>5} "
                 f"{st['p50_ms']:>8.1f} {st['p99_ms']:>8.1f}  {runs:<22} {rej}")
        echo(f"{scenario:<44} {mode:<6} goodput {agg['goodput']:.1f}/s = {agg['goodput'] / capacity:.2f}x capacity")


@click.command(name="router")
@click.option("--service-ms", default=100.0, show_default=True, help="Target's service time per request.")
@click.option("--instances", default=8, show_default=True, help="Target instances (capacity = instances/service time).")
@click.option("--max-inflight", default=None, type=int, help="Router's concurrency to the target (default instances+1).")
@click.option("--bursty-s", default=20.0, show_default=True, help="Length of the bursty scenario per mode.")
@click.option("--overload-s", default=15.0, show_default=True, help="Length of each overload scenario per mode.")
@click.option("--repeat", default=3, show_default=True,
              help="Runs of every scenario; the table shows medians of the runs' percentiles.")
@click.option("--overload", "overloads", multiple=True, type=float, default=(1.5, 2.0), show_default=True,
              help="Overload factors (repeatable).")
@click.option("--seed", default=7, show_default=True)
@click.option("--overhead-only", is_flag=True, help="Only the low-load overhead measurement (about a minute).")
@click.option("--json-out", type=click.Path(path_type=Path), default=None, help="Also write the results as JSON.")
def router(service_ms, instances, max_inflight, bursty_s, overload_s, overloads, repeat, seed, overhead_only,
           json_out) -> None:
    """QoS router vs plain FIFO: bursty below capacity and sustained overload, plus router overhead."""
    from dspark.triton.server import TritonServer

    deadlines = {"diamond": 1000.0, "gold": 2000.0, "standard": 5000.0}
    root = Path(tempfile.mkdtemp(prefix="dspark-bench-router-"))
    build_repository(root, service_ms, instances, max_inflight or instances + 1, deadlines)
    server = TritonServer([root])
    server.start()
    try:
        url = server.http_url
        click.echo(f"target: {instances} instances x {service_ms:g} ms; router deadlines {deadlines}")
        p50 = measure_overhead(url, rounds=5, calls=100)
        direct, passthrough, routed = p50["bench_fast_target"], p50["bench_passthrough"], p50["bench_fast_router"]
        added = routed - direct
        click.echo(f"overhead at low load (zero-time target, sequential HTTP, median of 5 rounds of p50): "
                   f"direct {direct:.2f} ms, minimal sync BLS forwarder {passthrough:.2f} ms "
                   f"(+{passthrough - direct:.2f}), router {routed:.2f} ms (+{added:.2f})")
        click.echo(f"  router calls on the fast path (execute forwards itself): "
                   f"{fast_path_count(server.metrics_url, 'bench_fast_router'):.0f} of 500")
        if overhead_only:
            click.echo(f"[{'PASS' if added < 1.0 else 'MISS'}] router overhead at low load: {added:.2f} ms added p50 "
                       f"(target < 1 ms)")
            return
        capacity = asyncio.run(measure_capacity(url, "bench_target", concurrency=2 * instances, seconds=5))
        click.echo(f"capacity (closed loop, {2 * instances} outstanding, target direct): {capacity:.1f} req/s "
                   f"(ideal {1000 * instances / service_ms:.1f})")
        scenarios = [bursty(capacity, bursty_s)] + [overload(capacity, f, overload_s) for f in overloads]
        results, unloaded = asyncio.run(run_scenarios(url, scenarios, repeat, seed, click.echo))
        base_p99 = statistics.median(unloaded)
        click.echo(f"diamond p99 through the router, unloaded (200 sequential calls before each run): "
                   f"{base_p99:.1f} ms (runs: {', '.join(f'{v:.1f}' for v in unloaded)})")
        stats = aggregate(results)
        click.echo("")
        report(stats, capacity, click.echo)
        click.echo("")
        summarize(stats, capacity, base_p99, added, click.echo)
        if json_out:
            json_out.write_text(json.dumps({
                "capacity": capacity, "unloaded_diamond_p99_ms": base_p99,
                "overhead_ms": {"direct_p50": direct, "passthrough_p50": passthrough, "router_p50": routed,
                                "added": added},
                "results": [{"scenario": scenario, "mode": mode, **agg} for (scenario, mode), agg in stats.items()],
            }, indent=2))
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def summarize(stats: dict[tuple[str, str], dict], capacity: float, base_p99: float, added_ms: float,
              echo) -> None:
    scenarios = list(dict.fromkeys(scenario for scenario, _ in stats))
    checks = []
    b = scenarios[0]
    fifo_d, rtr_d = stats[(b, "fifo")]["tiers"]["diamond"], stats[(b, "router")]["tiers"]["diamond"]
    lower = 1 - rtr_d["p99_ms"] / fifo_d["p99_ms"]
    checks.append((f"bursty: diamond p99 {rtr_d['p99_ms']:.1f} ms vs FIFO {fifo_d['p99_ms']:.1f} ms "
                   f"({100 * lower:.0f}% lower; target >= 42%)", lower >= 0.42))
    std = stats[(b, "router")]["tiers"]["standard"]
    share = std["ok"] / max(1, std["sent"])
    checks.append((f"bursty: standard completed {100 * share:.2f}% (target >= 99.5%)", share >= 0.995))
    for s in scenarios[1:]:
        agg = stats[(s, "router")]
        d = agg["tiers"]["diamond"]
        checks.append((f"{s}: diamond p99 {d['p99_ms']:.1f} ms = {d['p99_ms'] / base_p99:.2f}x unloaded "
                       f"(target <= 2x)", d["p99_ms"] <= 2 * base_p99))
        checks.append((f"{s}: goodput {agg['goodput'] / capacity:.2f}x capacity (target >= 0.95)",
                       agg["goodput"] >= 0.95 * capacity))
        checks.append((f"{s}: {agg['unexplained']} requests hung or failed without a reason (target 0)",
                       agg["unexplained"] == 0))
    checks.append((f"router overhead at low load: {added_ms:.2f} ms added p50 (target < 1 ms)", added_ms < 1.0))
    for text, ok in checks:
        echo(f"[{'PASS' if ok else 'MISS'}] {text}")
