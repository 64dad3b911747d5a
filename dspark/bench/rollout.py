"""`bench rollout`: many rollouts in a row under an open-loop client load, on one server or a
fleet started here; some promoted, some rolled back by an injected regression (2x slower, or
failing).

The client load (``dspark.bench.openloop.OpenLoopLoad``) sends requests to the routers at a fixed
rate, evenly spaced or Poisson, whatever the servers do, each with its own user id and a 1 s
client timeout, and records when each was due and answered. A steady window before the first
rollout is the baseline. Per rollout (from the controller's start to its end) it measures the
largest gap between answers, the p99 latency (from when a request was due) against the steady
p99, and the requests that failed; each rollout's times come from the controller's recorded
events. The result's rows are the measures (median and max over the rollouts, or a total),
every one lower-is-better so `bench compare` can check them; the rollouts themselves are in the
series.
"""
from __future__ import annotations

import datetime as _dt
import statistics
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from dspark.bench.results import BenchResult, Metric
from dspark.bench.table import Column
from dspark.errors import ConfigError

KINDS = {"good": {}, "slow": {"service_ms": 20.0}, "error": {"fail_after": 10}}  # 10 ms a request: 2x slower
PATTERN = ("good", "slow", "good", "error")
TIMEOUT_S = 1.0  # the clients' timeout: an answer later than this is a failed request


def _seconds(later: str, earlier: str) -> float:
    return (_dt.datetime.fromisoformat(later) - _dt.datetime.fromisoformat(earlier)).total_seconds()


def measure(rollout, events: Sequence[dict]) -> dict:
    """Times of one finished rollout (``state.Rollout``) from its recorded events."""
    routes = [e for e in events if e["kind"] == "route"]
    row = {"id": rollout.id, "semver": rollout.semver, "outcome": rollout.outcome, "reason": rollout.reason,
           "total_s": _seconds(rollout.finished, rollout.started)}
    if rollout.outcome == "promoted":
        full = next(e for e in routes if e["message"].startswith("promoted"))
        row["to_full_traffic_s"] = _seconds(full["at"], rollout.started)
    else:
        decided = next(e for e in events if e["kind"] == "rollback")
        row["to_detect_s"] = _seconds(decided["at"], routes[0]["at"]) if routes and routes[0]["at"] < decided["at"] else 0.0
        row["intervals_to_detect"] = sum(1 for e in events if e["kind"] == "analysis" and e["at"] <= decided["at"])
        row["to_roll_back_s"] = _seconds(rollout.finished, decided["at"])
    return row


def interruption(load, start: float, end: float, steady_p99_ms: float) -> dict:
    """What the clients saw during one rollout (time.monotonic() bounds): the largest gap
    between answers, the p99 latency and its ratio to the steady p99, the failed requests."""
    from dspark.bench.openloop import largest_gap, percentile_ms

    due = load.between(start, end)
    p99 = percentile_ms(due, 99)
    return {"largest_gap_s": largest_gap(load.answers, start, end), "p99_ms": p99,
            "p99_ratio": p99 / steady_p99_ms, "requests": len(due),
            "failed_requests": sum(1 for a in due if a.error is not None)}


def summary_rows(rollouts: Sequence[dict], client_requests: int, failed_requests: int,
                 steady: Optional[dict] = None) -> list[dict]:
    """The measures over the rollouts: median and max of each time, the interruption clients
    saw (largest gap; p99 against the steady p99, over the good rollouts: the others inject a
    slower or failing version on purpose), and the totals that must be 0."""
    promoted = [r for r in rollouts if r["outcome"] == "promoted"]
    rolled = [r for r in rollouts if r["outcome"] == "rolled_back"]
    measured = [r for r in rollouts if "largest_gap_s" in r]

    def spread(key: str, what: str, rows: list[dict]) -> dict:
        values = [r[key] for r in rows]
        return {"measure": key, "what": what, "count": len(values),
                "median": statistics.median(values) if values else None, "max": max(values) if values else None}

    unexpected = sum(1 for r in rollouts if (r["kind"] == "good") != (r["outcome"] == "promoted"))
    rows = [
        spread("to_full_traffic_s", "time to full traffic on the new version (s), promoted", promoted),
        spread("total_s", "time to promote incl. unloading the old version (s)", promoted),
        spread("to_detect_s", "time to detect a regression (s), rolled back", rolled),
        spread("intervals_to_detect", "analysis intervals to detect", rolled),
        spread("to_roll_back_s", "time to roll back after detection (s)", rolled),
    ]
    if measured:
        rows += [
            spread("largest_gap_s", "largest gap between answers during a rollout (s; target <= 0.25)", measured),
            spread("p99_ratio", "p99 latency during a good rollout / steady p99 (target <= 2)",
                   [r for r in measured if r["kind"] == "good"]),
        ]
    if steady:
        rows += [{"measure": "steady_largest_gap_s", "what": "largest gap between answers, steady (s)",
                  "median": steady["largest_gap_s"], "count": steady["requests"]},
                 {"measure": "steady_p99_ms", "what": "p99 latency, steady (ms)", "median": steady["p99_ms"],
                  "count": steady["requests"]}]
    return rows + [
        {"measure": "failed_requests", "what": f"failed client requests, {TIMEOUT_S:g} s timeout (target 0)",
         "total": failed_requests, "count": client_requests},
        {"measure": "not_as_injected", "what": "outcomes not as injected (good promoted, regressions rolled back; "
         "target 0)", "total": unexpected, "count": len(rollouts)},
    ]


COLUMNS = [Column("what", "measure"), Column("median", "median", ".2f"), Column("max", "max", ".2f"),
           Column("total", "total", ",d"), Column("count", "of", ",d")]
METRICS = [Metric("median", "lower"), Metric("max", "lower"), Metric("total", "lower")]


def run_rollout_bench(rollouts: int, servers: int, rate: float, arrivals: str, interval_s: float, hold_s: float,
                      workdir: Path, steady_s: float = 10.0, pattern: Sequence[str] = PATTERN,
                      parallel_loads: int = 1, say: Callable[[str], None] = print) -> BenchResult:
    """Start ``servers`` servers sharing one repository, send their routers ``rate`` requests/s
    in all (open loop), measure a steady window of ``steady_s``, then run ``rollouts`` rollouts
    in the ``pattern`` (kinds of KINDS) and measure each."""
    from dspark.bench.openloop import OpenLoopLoad, largest_gap, percentile_ms
    from dspark.rollout import demo
    from dspark.rollout.controller import Controller
    from dspark.rollout.deployment import Deployment
    from dspark.rollout.fleet import Endpoint
    from dspark.rollout.plan import Plan
    from dspark.rollout.state import StateStore
    from dspark.server.launcher import TritonServer
    from dspark.server.access import DEFAULT_HEADER_PATTERN, header_forward_args, new_api_key

    unknown = [kind for kind in pattern if kind not in KINDS]
    if unknown or not pattern:
        raise ConfigError("pattern", f"{','.join(pattern)!r}: give kinds of {', '.join(KINDS)}, comma-separated")
    repo = demo.build_repository(workdir / "repo")
    plan = Plan.from_dict({
        "steps": [{"shadow": 30, "hold_s": hold_s}, {"canary": 25, "hold_s": hold_s}, {"canary": 100, "hold_s": hold_s}],
        "analysis": {"interval_s": interval_s, "min_requests": 10},
        "warmup": {"requests": 3}, "drain_timeout_s": 15, "parallel_loads": parallel_loads})
    fleet, load, rows = [], None, []
    key = new_api_key()
    try:
        for _ in range(servers):
            server = TritonServer([repo], model_control="explicit", load_models=[demo.MODEL, demo.ROUTER],
                                  exit_timeout_s=2, api_key=key, extra_args=header_forward_args(DEFAULT_HEADER_PATTERN))
            server.start()
            fleet.append(server)
        load = OpenLoopLoad([s.http_url for s in fleet], demo.ROUTER, rate=rate, arrivals=arrivals,
                            timeout_s=TIMEOUT_S).start()
        deployment = Deployment(demo.MODEL, demo.ROUTER, str(repo),
                                [Endpoint.parse(s.http_url, s.metrics_url, s.grpc_url) for s in fleet])
        state = StateStore(workdir / "state.sqlite")
        controller = Controller(deployment, plan, state, key, say=lambda line: None)
        time.sleep(2.0)  # connections opened, every instance has answered
        started = time.monotonic()
        time.sleep(steady_s)
        window = load.between(started, time.monotonic())
        steady = {"largest_gap_s": largest_gap(load.answers, started, time.monotonic()),
                  "p99_ms": percentile_ms(window, 99), "requests": len(window)}
        say(f"steady {steady_s:g} s: p99 {steady['p99_ms']:.1f} ms, largest gap {steady['largest_gap_s']:.3f} s, "
            f"{sum(1 for a in window if a.error)} failed of {len(window)}")
        for i in range(rollouts):
            kind = pattern[i % len(pattern)]
            semver = f"1.{i + 1}.0"
            artifact = demo.model_artifact(workdir / f"model-{i}.py", semver, **KINDS[kind])
            start = time.monotonic()
            outcome = controller.start(artifact, semver)
            end = time.monotonic()
            rollout_id = outcome.rollout.id
            row = {"kind": kind, **measure(state.get(rollout_id), state.events(rollout_id)),
                   **interruption(load, start, end, steady["p99_ms"])}
            rows.append(row)
            say(f"{i + 1:>3}/{rollouts} {kind:<6} {row['outcome']:<12} {row['total_s']:6.1f} s  "
                + (f"full traffic after {row['to_full_traffic_s']:.1f} s" if row["outcome"] == "promoted" else
                   f"detected after {row['to_detect_s']:.1f} s ({row['intervals_to_detect']} intervals): {row['reason']}")
                + f"  largest gap {row['largest_gap_s']:.3f} s, p99 {row['p99_ms']:.1f} ms "
                  f"({row['p99_ratio']:.2f}x steady), failed {row['failed_requests']}")
        controller.close()
    finally:
        if load is not None:
            load.stop()
        for server in fleet:
            server.stop()
    failures = load.failures()
    return BenchResult(
        benchmark="rollout",
        settings={"rollouts": rollouts, "servers": servers, "rate": rate, "arrivals": arrivals,
                  "timeout_s": TIMEOUT_S, "steady_s": steady_s, "interval_s": interval_s, "hold_s": hold_s,
                  "pattern": list(pattern), "plan": plan.to_dict()},
        rows=summary_rows(rows, len(load.answers), len(failures), steady), columns=COLUMNS, key_fields=["measure"],
        metrics=METRICS,
        notes=[f"{rollouts} rollouts on {servers} server(s) sharing one repository; clients: {rate:g} requests/s in "
               f"all to the routers, open loop ({arrivals} arrivals), 1,000 user ids, {TIMEOUT_S:g} s timeout; "
               f"latency from when a request was due; baseline: {steady_s:g} s steady before the first rollout; "
               f"pattern {', '.join(pattern)} (good 10 ms a request, slow 20 ms, error fails after 10 answers per "
               f"instance); plan shadow 30 % -> canary 25 % -> canary 100 %, each held {hold_s:g} s; analysis every "
               f"{interval_s:g} s, min_requests 10; servers load {parallel_loads} at a time"]
        + [f"failed request: {f.error[:200]}" for f in failures[:5]],
        series={"rollouts": rows})
