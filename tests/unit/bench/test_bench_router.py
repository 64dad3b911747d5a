"""`bench router`'s logic without a server: the seeded arrivals, the router's refusals read from
its real messages, per-tier figures and goodput over repeats, the router's histogram from
/metrics, the router's targets through `compare`, and the plots from a result alone."""
import json
import shlex
import time

import pytest
from click.testing import CliRunner

from dspark.bench.client import Record
from dspark.bench.load import Point, arrival_schedule
from dspark.bench.resources import parse_metrics
from dspark.bench.results import BenchResult
from dspark.bench.router import (ALL, COLUMNS, METRICS, TIER_MIX, TIERS, BurstShape, RouterBenchSettings, Run, Variant,
                                 bursty, check_goals, classify, goals, histogram_delta, histogram_p99, router_histograms,
                                 scenario_rows)
from dspark.cli.main import cli
from dspark.errors import ConfigError, UnavailableError
from dspark.routing.config import TierPolicy
from dspark.routing.runtime import RouterCore
from tests.unit.routing.test_routing_runtime import Client, FakeTarget, Recorder, config, eventually


def test_arrivals_are_seeded_follow_the_bursts_and_draw_the_tier_mix():
    scenario = bursty(100.0, 40.0)  # 65/s, and 165/s in the last 2 s of every 10 s
    first = arrival_schedule(scenario.duration_s, scenario.rate_at, TIER_MIX, seed=7)
    assert first == arrival_schedule(scenario.duration_s, scenario.rate_at, TIER_MIX, seed=7)
    assert first != arrival_schedule(scenario.duration_s, scenario.rate_at, TIER_MIX, seed=8)
    assert all(0 <= t < 40 for t, _ in first) and [t for t, _ in first] == sorted(t for t, _ in first)
    in_burst = sum(1 for t, _ in first if t % 10 >= 8) / 8.0   # 8 s of bursts
    outside = sum(1 for t, _ in first if t % 10 < 8) / 32.0
    assert in_burst == pytest.approx(165, rel=0.15) and outside == pytest.approx(65, rel=0.1)
    shares = [sum(1 for _, i in first if i == k) / len(first) for k in range(3)]
    assert shares == pytest.approx([0.1, 0.3, 0.6], abs=0.04)
    with pytest.raises(ConfigError, match="rate must be > 0"):
        arrival_schedule(5.0, lambda t: 0.0, TIER_MIX, seed=1)


def test_the_scenario_is_a_parameter_tier_mix_arrivals_and_burst_shape():
    shape = BurstShape.parse("0.5:2:1:5")  # 50/s, and 200/s in the last 1 s of every 5 s
    scenario = bursty(100.0, 20.0, shape)
    assert scenario.offered == pytest.approx((0.5 * 4 + 2 * 1) / 5) and scenario.name == "bursty 0.80x (2x 1s/5s)"
    even = arrival_schedule(scenario.duration_s, scenario.rate_at, (0, 0, 1), seed=3, process="constant")
    gaps = [b - a for (a, _), (b, _) in zip(even, even[1:])]
    assert {i for _, i in even} == {2}  # a mix without diamond and gold sends none
    assert min(gaps) == pytest.approx(1 / 200) and max(gaps) == pytest.approx(1 / 50, abs=1e-9)
    assert len(even) == pytest.approx(20 * (0.8 * 100), rel=0.02)
    for text in ("0.5:2:1", "0.5:2:5:5", "a:b:c:d"):
        with pytest.raises(ConfigError, match="burst"):
            BurstShape.parse(text)
    with pytest.raises(ConfigError, match="tier_mix: 3 shares >= 0"):
        RouterBenchSettings(tier_mix=(10, 90))
    with pytest.raises(ConfigError, match="arrivals: 'uniform': expected poisson or constant"):
        RouterBenchSettings(arrivals="uniform")
    assert RouterBenchSettings(tier_mix=(0, 50, 50)).to_json()["tier_mix"] == {"diamond": 0, "gold": 50, "standard": 50}


def test_refusals_are_classified_from_the_routers_own_messages():
    """Drive a real RouterCore into each refusal; the bench must read the same reason from the
    message alone (what a client receives)."""
    release = time.monotonic() + 10

    def hang(payload):
        while time.monotonic() < release:
            time.sleep(0.01)
        return {"y": payload["x"]}
    tiers = {"gold": TierPolicy(weight=3, deadline_ms=150, timeout_ms=100),
             "standard": TierPolicy(weight=1, deadline_ms=150, max_queue=1)}
    core = RouterCore(config(tiers=tiers, max_inflight=1, inline_max_ms=0), FakeTarget(behaviour={1: hang}),
                      Recorder(), poll_interval_s=0.05)
    core.start()
    client = Client()
    try:
        core.submit(client.job("hung", tier="gold"))
        assert eventually(lambda: core.scheduler.inflight == 1)
        core.submit(client.job("queued", tier="standard"))
        core.submit(client.job("full", tier="standard"))
        assert eventually(lambda: len(client.answers) == 3)
    finally:
        release = 0
        core.stop(timeout_s=2)
    late = Client()
    core.submit(late.job("late"))
    errors = [client.error(n) for n in ("hung", "queued", "full")] + [late.error("late")]
    assert [e.reason for e in errors] == ["target_timeout", "deadline", "queue_full", "shutdown"]
    for error in errors:
        assert isinstance(error, UnavailableError)
        assert classify("UNAVAILABLE", f"HTTP 503: {error}") == error.reason
    assert classify("UNAVAILABLE", "HTTP 503: model is not ready") == "UNAVAILABLE"
    assert classify("timeout", "") == "timeout" and classify("INTERNAL", "queue is full") == "INTERNAL"


def record(tier, sent, latency=None, error=None, lag=0.0):
    done = sent + (latency if latency is not None else 0.001)
    return Record(tier, sent - lag, sent, done, error=error)


def run(records, scenario="overload 2x", mode="router", duration=10.0, started=100.0, queue_ms=1.0, inside=None):
    point = Point("schedule", 1.0, records, [], True, duration, started, (started, started + duration), records,
                  [started, started + duration])
    return Run(scenario, mode, point, duration, queue_ms, inside or {})


DEADLINES = {"diamond": 2.0, "gold": 3.0, "standard": 5.0}


def test_tier_rows_and_goodput_over_repeats():
    t = 100.0
    one = run([record("diamond", t + 1, 0.1), record("diamond", t + 2, 0.2, lag=0.5), record("diamond", t + 3, 3.0),
               record("gold", t + 4, error="deadline"),
               record("standard", t + 5, 5.4),                     # answered after the run's 10 s: no goodput
               record("standard", t + 6, error="timeout"), record("standard", t + 7, error="INTERNAL")])
    two = run([record("diamond", t + 1, 0.3), record("gold", t + 2, 0.5), record("standard", t + 3, 0.6)],
              queue_ms=3.0)
    rows = {r["tier"]: r for r in scenario_rows([one, two], DEADLINES, capacity=0.5, offered=2.0)}
    diamond = rows["diamond"]
    assert diamond["sent"] == 4 and diamond["ok"] == 4
    assert diamond["within_deadline"] == pytest.approx(3 / 4)  # the 3 s answer missed diamond's 2 s
    assert diamond["p99_runs"][1] == pytest.approx(300.0)
    assert diamond["p99_ms"] == pytest.approx((diamond["p99_runs"][0] + 300.0) / 2, abs=0.1)  # median of 2 runs
    assert diamond["band"]["p99_ms"] > 0
    # from the scheduled arrival the 0.5 s lateness counts: run one's p99 2954 ms instead of 2944
    assert diamond["p99_from_arrival_ms"] == pytest.approx(diamond["p99_ms"] + 5.0, abs=0.1)
    assert rows["gold"]["errors"] == {"deadline": 1} and rows["gold"]["rejected"] == "deadline 1"
    assert rows["standard"]["within_deadline"] == pytest.approx(1 / 4)  # 5.4 s > 5 s; two errors; one in time
    total = rows[ALL]
    # goodput per run: answers done within 10 s of the start (run one: 3 diamond; run two: 3) / 10 s
    assert total["goodput"] == pytest.approx(0.3) and total["goodput_x"] == pytest.approx(0.6)
    assert total["unexplained"] == 2  # the hung (timeout) and the INTERNAL; the deadline is explained
    assert total["triton_queue_ms"] == pytest.approx(2.0) and total["offered_x"] == 2.0
    assert total["sent"] == 10 and total["ok"] == 7


METRICS_TEXT = """# HELP dspark_router_latency_seconds End-to-end latency
# TYPE dspark_router_latency_seconds histogram
{rows}
"""


def histogram_text(counts):
    lines = []
    for version, tier, buckets in counts:
        for le, n in buckets:
            lines.append(f'dspark_router_latency_seconds_bucket{{model="bench_router",tier="{tier}",'
                         f'version="{version}",le="{le}"}} {n}')
    lines.append('dspark_router_latency_seconds_bucket{model="other",tier="gold",version="1",le="+Inf"} 99')
    return METRICS_TEXT.format(rows="\n".join(lines))


def test_the_routers_own_p99_from_its_histogram_between_two_scrapes():
    before = parse_metrics(histogram_text([("1", "gold", [("0.05", 10), ("0.1", 10), ("+Inf", 10)])]))
    after = parse_metrics(histogram_text([
        ("1", "gold", [("0.05", 60), ("0.1", 108), ("+Inf", 110)]),
        ("2", "gold", [("0.05", 0), ("0.1", 0), ("+Inf", 0)]),
        ("1", "diamond", [("0.05", 50), ("0.1", 50), ("+Inf", 50)])]))
    delta = histogram_delta(router_histograms(before, "bench_router"), router_histograms(after, "bench_router"))
    assert delta["gold"] == {0.05: 50, 0.1: 98, float("inf"): 100}
    assert histogram_p99(delta["gold"]) == float("inf")  # 98 of 100 within 100 ms: the p99 is beyond
    assert histogram_p99(delta["diamond"]) == pytest.approx(50.0)
    assert router_histograms(after, "bench_target") == {}
    assert histogram_p99({}) != histogram_p99({})  # nan


def result_with(bursty_p99=300.0, goodput=98.0, overload_p99=90.0, within=0.999, added=0.7, unexplained=0,
                router_qps=96.0):
    key = {"scenario": "bursty 0.85x", "table": "scenarios"}
    rows = [
        {"table": "reference", "scenario": "capacity", "mode": "direct", "tier": ALL, "qps": 100.0, "goodput": 100.0},
        {"table": "reference", "scenario": "capacity", "mode": "router", "tier": ALL, "qps": router_qps,
         "goodput": router_qps, "x_direct": router_qps / 100},
        {"table": "reference", "scenario": "unloaded", "mode": "router", "tier": "diamond", "p99_ms": 50.0},
        {**key, "mode": "fifo", "tier": "diamond", "p99_ms": 1000.0, "within_deadline": 1.0},
        {**key, "mode": "router", "tier": "diamond", "p99_ms": bursty_p99, "within_deadline": 1.0},
        {**key, "mode": "router", "tier": "standard", "p99_ms": 80.0, "within_deadline": within},
        {"table": "scenarios", "scenario": "overload 1.5x", "mode": "router", "tier": "diamond",
         "p99_ms": overload_p99},
        {"table": "scenarios", "scenario": "overload 1.5x", "mode": "fifo", "tier": ALL, "goodput": 101.0,
         "goodput_x": 1.01, "offered_x": 1.5, "unexplained": 0},
        {"table": "scenarios", "scenario": "overload 1.5x", "mode": "router", "tier": ALL, "goodput": goodput,
         "goodput_x": goodput / 100, "offered_x": 1.5, "unexplained": unexplained},
        {"table": "overhead", "scenario": "overhead 1 ms", "mode": "router", "tier": "gold", "model": "router_t1",
         "added_p50_ms": added},
    ]
    return BenchResult("router", {}, rows, COLUMNS, ["scenario", "mode", "tier"], METRICS, group_by="table")


def verdicts(result):
    return {c.point: c.verdict for c in check_goals(result)}


def test_the_routers_targets_are_checked_with_compare():
    met = verdicts(result_with())
    assert len(met) == 7 and set(met.values()) == {"met"}, met
    assert "overload 1.5x, router: goodput vs FIFO" in met and "capacity: router vs the target directly" in met
    # 0.60x FIFO's p99 misses 0.58x; 97 of FIFO's 101 (0.96x) misses 0.97x; 2.2x unloaded misses 2x;
    # 99.4 % misses 99.5 %; +1.1 ms is over 1 ms; one request without a reason; 0.94x capacity misses 0.95x
    missed = verdicts(result_with(bursty_p99=600.0, goodput=97.0, overload_p99=110.0, within=0.994, added=1.1,
                                  unexplained=1, router_qps=94.0))
    assert len(missed) == 7 and set(missed.values()) == {"missed"}, missed
    # a tolerance is not a regression: 1.8x the unloaded p99 is within "<= 2x"
    assert verdicts(result_with(overload_p99=90.0))["overload 1.5x, router: diamond p99 vs unloaded"] == "met"
    # without FIFO rows the A/B check is left out, the rest stays
    no_fifo = result_with()
    no_fifo.rows = [r for r in no_fifo.rows if r["table"] != "scenarios" or r["mode"] != "fifo"]
    assert "bursty 0.85x, router: diamond p99 vs FIFO" not in verdicts(no_fifo) and len(verdicts(no_fifo)) == 6
    # the overload's goodput is then held against the capacity: 98 of 100
    assert verdicts(no_fifo)["overload 1.5x, router: goodput vs capacity"] == "met"


def test_each_target_is_the_same_bench_compare_command(tmp_path):
    for p99, exit_code in ((300.0, 0), (600.0, 1)):
        path = result_with(bursty_p99=p99).save(tmp_path / "router.json")
        goal = next(g for g in goals(result_with()) if "FIFO" in g.name)
        args = shlex.split(goal.command(str(path)))
        assert args[:3] == ["dspark", "bench", "compare"] and "scenario=bursty 0.85x" in args
        out = CliRunner().invoke(cli, args[1:])
        assert out.exit_code == exit_code, out.output
        assert ("met" if exit_code == 0 else "missed") in out.output


def test_variants_parse_or_name_the_field():
    assert Variant.parse("2:0:0") == Variant(2, 0, 0.0) and Variant.parse("auto:1:2") == Variant() \
        and Variant.parse("auto:1") == Variant("auto", 1, 0.0)  # the routing file's defaults: auto, 1, 2 ms
    assert Variant().label == "router" and Variant(3, 0, 0.0).label == "router 3:0:0" \
        and Variant("auto", 1, 0.0).label == "router auto:1:0"
    with pytest.raises(ConfigError, match="variant.*MAX_INFLIGHT:HEADROOM"):
        Variant.parse("three")


def test_router_plots_come_from_the_result_alone(tmp_path):
    from dspark.bench.plots import plot_router

    result = result_with()
    result.settings = {"deadlines_ms": {"diamond": 2000, "gold": 3000, "standard": 5000}}
    result.rows += [{"table": "scenarios", "scenario": "bursty 0.85x", "mode": m, "tier": ALL, "offered_x": 0.85,
                     "goodput_x": 0.84} for m in ("fifo", "router")]
    result.rows += [{"table": "scenarios", "scenario": "overload 1.5x", "mode": "fifo", "tier": ALL,
                     "offered_x": 1.5, "goodput_x": 1.0}]
    result.series["timeline"] = {f"{s} / {m}": {t: [[0.1 * i, 20.0 + i] for i in range(20)] + [[2.5, None]]
                                                for t in TIERS}
                                 for s in ("bursty 0.85x", "overload 1.5x") for m in ("fifo", "router")}
    paths = plot_router(BenchResult.from_json(json.loads(json.dumps(result.to_json()))), tmp_path)
    assert [p.name for p in paths] == ["router_latency.png", "router_goodput.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)
