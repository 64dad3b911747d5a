"""`dspark bench rollout`: many rollouts in a row under continuous client load, on one server or
a fleet started here; some promoted, some rolled back by an injected regression (2x slower, or
failing). Reports time to promote, time to detect and roll back (also in analysis intervals),
and failed client requests (target 0). Writes JSON with the settings and the CPU."""
from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

import click

from dspark.cli.bench_router import cpu_model
from dspark.rollout import demo
from dspark.rollout.controller import Controller, Deployment
from dspark.rollout.fleet import Endpoint
from dspark.rollout.plan import Plan
from dspark.rollout.state import StateStore
from dspark.triton.server import DEFAULT_HEADER_PATTERN, TritonServer, header_forward_args, new_api_key

KINDS = {"good": {}, "slow": {"service_ms": 20.0}, "error": {"fail_after": 10}}  # 10 ms a request: 2x slower
PATTERN = ("good", "slow", "good", "error")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _seconds(later: str, earlier: str) -> float:
    return (_dt.datetime.fromisoformat(later) - _dt.datetime.fromisoformat(earlier)).total_seconds()


def measure(state: StateStore, rollout_id: int, interval_s: float) -> dict:
    """Times of one rollout from its recorded events."""
    rollout = state.get(rollout_id)
    events = state.events(rollout_id)
    routes = [e for e in events if e["kind"] == "route"]
    row = {"id": rollout_id, "semver": rollout.semver, "outcome": rollout.outcome, "reason": rollout.reason,
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


def run_benchmark(rollouts: int, servers: int, threads: int, interval_s: float, hold_s: float,
                  workdir: Path, say=print) -> dict:
    repo = demo.build_repository(workdir / "repo")
    fleet = []
    load = None
    key = new_api_key()
    try:
        for _ in range(servers):
            server = TritonServer([repo], model_control="explicit", load_models=[demo.MODEL, demo.ROUTER],
                                  exit_timeout_s=2, api_key=key, extra_args=header_forward_args(DEFAULT_HEADER_PATTERN))
            server.start()
            fleet.append(server)
        load = demo.LoadGenerator([s.http_url for s in fleet], threads_per_server=threads).start()
        plan = Plan.from_dict({
            "steps": [{"shadow": 30, "hold_s": hold_s}, {"canary": 25, "hold_s": hold_s},
                      {"canary": 100, "hold_s": hold_s}],
            "analysis": {"interval_s": interval_s, "min_requests": 10},
            "warmup": {"requests": 3}, "drain_timeout_s": 15})
        deployment = Deployment(demo.MODEL, demo.ROUTER, str(repo),
                                [Endpoint.parse(s.http_url, s.metrics_url) for s in fleet])
        state = StateStore(workdir / "state.sqlite")
        controller = Controller(deployment, plan, state, key, say=lambda line: None)
        rows = []
        time.sleep(1.0)
        for i in range(rollouts):
            kind = PATTERN[i % len(PATTERN)]
            semver = f"1.{i + 1}.0"
            artifact = demo.model_artifact(workdir / f"model-{i}.py", semver, **KINDS[kind])
            before = len(load.failures())
            outcome = controller.start(artifact, semver)
            row = {"kind": kind, **measure(state, outcome.rollout.id, interval_s),
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
    requests = len(load.results) if load else 0
    return {"settings": {"rollouts": rollouts, "servers": servers, "client_threads_per_server": threads,
                         "interval_s": interval_s, "hold_s": hold_s, "pattern": list(PATTERN),
                         "plan": plan.to_dict()},
            "cpu": cpu_model(), "cores": os.cpu_count(), "client_requests": requests,
            "failed_requests": len(load.failures()) if load else None,
            "failures": [str(f[2])[:200] for f in load.failures()[:5]] if load else [], "rollouts": rows}


def summary(result: dict) -> str:
    rows = result["rollouts"]
    promoted = [r for r in rows if r["outcome"] == "promoted"]
    rolled = [r for r in rows if r["outcome"] == "rolled_back"]
    expected = sum(1 for r in rows if (r["kind"] == "good") == (r["outcome"] == "promoted"))

    def med(values):
        return f"{statistics.median(values):.1f}" if values else "-"

    lines = [f"rollouts on {result['settings']['servers']} server(s), {result['cpu']} ({result['cores']} cores), "
             f"interval {result['settings']['interval_s']:g} s, steps held {result['settings']['hold_s']:g} s",
             "| measure | median | max |", "|---|---|---|",
             f"| time to full traffic on the new version (s), {len(promoted)} promoted | "
             f"{med([r['to_full_traffic_s'] for r in promoted])} | {max((r['to_full_traffic_s'] for r in promoted), default=0):.1f} |",
             f"| time to promote incl. unloading the old version (s) | {med([r['total_s'] for r in promoted])} | "
             f"{max((r['total_s'] for r in promoted), default=0):.1f} |",
             f"| time to detect a regression (s), {len(rolled)} rolled back | {med([r['to_detect_s'] for r in rolled])} | "
             f"{max((r['to_detect_s'] for r in rolled), default=0):.1f} |",
             f"| analysis intervals to detect | {med([r['intervals_to_detect'] for r in rolled])} | "
             f"{max((r['intervals_to_detect'] for r in rolled), default=0)} |",
             f"| time to roll back after detection (s) | {med([r['to_roll_back_s'] for r in rolled])} | "
             f"{max((r['to_roll_back_s'] for r in rolled), default=0):.1f} |",
             f"| failed client requests (target 0) | {result['failed_requests']} of {result['client_requests']} | |",
             f"| outcomes as injected (good promoted, regressions rolled back) | {expected} of {len(rows)} | |"]
    return "\n".join(lines)


@click.command(name="rollout")
@click.option("--rollouts", default=20, show_default=True)
@click.option("--servers", default=1, show_default=True, help="Servers in the fleet (sharing one repository).")
@click.option("--threads", default=2, show_default=True, help="Client threads per server.")
@click.option("--interval", "interval_s", default=0.5, show_default=True, help="Analysis interval (s).")
@click.option("--hold", "hold_s", default=1.0, show_default=True, help="Seconds each step is held.")
@click.option("--output", type=click.Path(path_type=Path), default=None, help="Write the results as JSON here.")
def rollout_bench(rollouts: int, servers: int, threads: int, interval_s: float, hold_s: float,
                  output: Optional[Path]) -> None:
    """Rollouts in a row under load: time to promote, to detect and roll back, failed requests."""
    workdir = Path(tempfile.mkdtemp(prefix="dspark-bench-rollout-"))
    try:
        result = run_benchmark(rollouts, servers, threads, interval_s, hold_s, workdir, say=click.echo)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    click.echo(summary(result))
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=2))
        click.echo(f"wrote {output}")
