"""`bench rollout`: many rollouts in a row under continuous client load, on one server or a fleet
started here; some promoted, some rolled back by an injected regression (2x slower, or failing).

The client load is the rollout demo's (``dspark.rollout.demo.LoadGenerator``: threads calling the
router on every server without pause, each answer recorded with the version that gave it), since
it must span all rollouts and servers at once. Each rollout's times come from the controller's
recorded events. The result's rows are the measures (median and max over the rollouts, or a
total), every one lower-is-better so `bench compare` can check them; the rollouts themselves are
in the series.
"""
from __future__ import annotations

import datetime as _dt
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

from dspark.bench.results import BenchResult, Metric
from dspark.bench.table import Column

KINDS = {"good": {}, "slow": {"service_ms": 20.0}, "error": {"fail_after": 10}}  # 10 ms a request: 2x slower
PATTERN = ("good", "slow", "good", "error")


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


def summary_rows(rollouts: Sequence[dict], client_requests: int, failed_requests: int) -> list[dict]:
    """The measures over the rollouts: median and max of each time, and the totals that must be 0."""
    promoted = [r for r in rollouts if r["outcome"] == "promoted"]
    rolled = [r for r in rollouts if r["outcome"] == "rolled_back"]

    def spread(key: str, what: str, rows: list[dict]) -> dict:
        values = [r[key] for r in rows]
        return {"measure": key, "what": what, "count": len(values),
                "median": statistics.median(values) if values else None, "max": max(values) if values else None}

    unexpected = sum(1 for r in rollouts if (r["kind"] == "good") != (r["outcome"] == "promoted"))
    return [
        spread("to_full_traffic_s", "time to full traffic on the new version (s), promoted", promoted),
        spread("total_s", "time to promote incl. unloading the old version (s)", promoted),
        spread("to_detect_s", "time to detect a regression (s), rolled back", rolled),
        spread("intervals_to_detect", "analysis intervals to detect", rolled),
        spread("to_roll_back_s", "time to roll back after detection (s)", rolled),
        {"measure": "failed_requests", "what": "failed client requests (target 0)", "total": failed_requests,
         "count": client_requests},
        {"measure": "not_as_injected", "what": "outcomes not as injected (good promoted, regressions rolled back; "
         "target 0)", "total": unexpected, "count": len(rollouts)},
    ]


COLUMNS = [Column("what", "measure"), Column("median", "median", ".1f"), Column("max", "max", ".1f"),
           Column("total", "total", ",d"), Column("count", "of", ",d")]
METRICS = [Metric("median", "lower"), Metric("max", "lower"), Metric("total", "lower")]


def run_rollout_bench(rollouts: int, servers: int, threads: int, interval_s: float, hold_s: float,
                      workdir: Path, say: Callable[[str], None] = print) -> BenchResult:
    """Start ``servers`` servers sharing one repository, load them, run ``rollouts`` rollouts in
    the PATTERN (good, 2x slower, good, failing) and measure each."""
    from dspark.rollout import demo
    from dspark.rollout.controller import Controller, Deployment
    from dspark.rollout.fleet import Endpoint
    from dspark.rollout.plan import Plan
    from dspark.rollout.state import StateStore
    from dspark.triton.server import TritonServer
    from dspark.triton.access import DEFAULT_HEADER_PATTERN, header_forward_args, new_api_key

    repo = demo.build_repository(workdir / "repo")
    plan = Plan.from_dict({
        "steps": [{"shadow": 30, "hold_s": hold_s}, {"canary": 25, "hold_s": hold_s}, {"canary": 100, "hold_s": hold_s}],
        "analysis": {"interval_s": interval_s, "min_requests": 10},
        "warmup": {"requests": 3}, "drain_timeout_s": 15})
    fleet, load, rows = [], None, []
    key = new_api_key()
    try:
        for _ in range(servers):
            server = TritonServer([repo], model_control="explicit", load_models=[demo.MODEL, demo.ROUTER],
                                  exit_timeout_s=2, api_key=key, extra_args=header_forward_args(DEFAULT_HEADER_PATTERN))
            server.start()
            fleet.append(server)
        load = demo.LoadGenerator([s.http_url for s in fleet], threads_per_server=threads).start()
        deployment = Deployment(demo.MODEL, demo.ROUTER, str(repo),
                                [Endpoint.parse(s.http_url, s.metrics_url) for s in fleet])
        state = StateStore(workdir / "state.sqlite")
        controller = Controller(deployment, plan, state, key, say=lambda line: None)
        time.sleep(1.0)
        for i in range(rollouts):
            kind = PATTERN[i % len(PATTERN)]
            semver = f"1.{i + 1}.0"
            artifact = demo.model_artifact(workdir / f"model-{i}.py", semver, **KINDS[kind])
            before = len(load.failures())
            outcome = controller.start(artifact, semver)
            rollout_id = outcome.rollout.id
            row = {"kind": kind, **measure(state.get(rollout_id), state.events(rollout_id)),
                   "failed_requests": len(load.failures()) - before}
            rows.append(row)
            say(f"{i + 1:>3}/{rollouts} {kind:<6} {row['outcome']:<12} {row['total_s']:6.1f} s  "
                + (f"full traffic after {row['to_full_traffic_s']:.1f} s" if row["outcome"] == "promoted" else
                   f"detected after {row['to_detect_s']:.1f} s ({row['intervals_to_detect']} intervals): {row['reason']}")
                + f"  failed requests {row['failed_requests']}")
        controller.close()
    finally:
        if load is not None:
            load.stop()
        for server in fleet:
            server.stop()
    failures = load.failures()
    return BenchResult(
        benchmark="rollout",
        settings={"rollouts": rollouts, "servers": servers, "client_threads_per_server": threads,
                  "interval_s": interval_s, "hold_s": hold_s, "pattern": list(PATTERN), "plan": plan.to_dict()},
        rows=summary_rows(rows, len(load.results), len(failures)), columns=COLUMNS, key_fields=["measure"],
        metrics=METRICS,
        notes=[f"{rollouts} rollouts on {servers} server(s) sharing one repository, {threads} client thread(s) per "
               f"server calling the router without pause; pattern {', '.join(PATTERN)} (good 10 ms a request, slow "
               f"20 ms, error fails after 10 answers per instance); plan shadow 30 % -> canary 25 % -> canary 100 %, "
               f"each held {hold_s:g} s; analysis every {interval_s:g} s, min_requests 10"]
        + [f"failed request: {str(f[2])[:200]}" for f in failures[:5]],
        series={"rollouts": rows})
