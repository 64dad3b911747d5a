"""What `dspark rollout status` and `history` show: per server health and model versions, the
router's traffic shares, live per-version metrics, the rollout in progress, past rollouts."""
from __future__ import annotations

import datetime as _dt
import time
from typing import Optional, Sequence

from dspark.errors import ConfigError, DsparkError
from dspark.rollout.analysis import version_stats
from dspark.rollout.deployment import Deployment
from dspark.rollout.fleet import Endpoint, Server
from dspark.rollout.metrics import ScrapeSource, delta
from dspark.rollout.state import Lease, Rollout, StateStore
from dspark.rollout.store import load_routing


def collect(state: StateStore, model: Optional[str], endpoints: Optional[Sequence[Endpoint]],
            api_key: Optional[str], window_s: float = 1.0) -> dict:
    """Everything `status` shows, as plain data (the JSON form)."""
    recent = state.history(model, 1)
    if model is None and recent:
        model = recent[0].model
    if model is None:
        raise ConfigError("model", "no rollout recorded yet: name the model and pass --server")
    last = recent[0] if recent else None
    deployment = Deployment.from_settings(last.settings["deployment"]) if last else None
    if endpoints is None:
        if deployment is None:
            raise ConfigError("server", f"no rollout of '{model}' recorded: pass --server to say where it runs")
        endpoints = deployment.endpoints
    router = deployment.router if deployment else None
    active = state.active(model)
    report: dict = {"model": model, "router": router, "servers": [], "shares": None, "shadow": None,
                    "rollout": _rollout_dict(active) if active else None,
                    "controller": _controller(state.lease(model), active) if active else None,
                    "last_rollout": _rollout_dict(last) if last else None, "versions": [], "window_s": window_s}
    loaded: set[int] = set()
    for endpoint in endpoints:
        server = Server(endpoint, api_key, timeout_s=5)
        entry = {"url": endpoint.url, "live": server.healthy(), "versions": {}, "error": None}
        if entry["live"]:
            try:
                for item in server.index():
                    if item.get("name") == model and item.get("version"):
                        entry["versions"][item["version"]] = item.get("state", "")
                        if item.get("state") == "READY":
                            loaded.add(int(item["version"]))
            except DsparkError as error:
                entry["error"] = str(error)
        server.close()
        report["servers"].append(entry)
    if deployment and deployment.routing_file:
        routing = load_routing(deployment.routing_file)
        report["shares"] = {str(v): p for v, p in routing.shares.items()}
        if routing.shadow.version is not None and routing.shadow.percent > 0:
            report["shadow"] = {"version": routing.shadow.version, "percent": routing.shadow.percent}
    source = ScrapeSource([e.metrics_url for e in endpoints])
    before = source.snapshot()
    time.sleep(window_s)
    after = source.snapshot()
    elapsed = max(after.taken_at - before.taken_at, 1e-9)
    if report["shadow"] and router:  # what was really copied: beyond shadow.max_inflight calls a copy is skipped
        counts = {outcome: delta(after, before, "dspark_router_shadow", model=router,
                                 version=str(report["shadow"]["version"]), outcome=outcome)
                  for outcome in ("agree", "disagree", "error", "skipped")}
        report["shadow"].update(copied=counts["agree"] + counts["disagree"] + counts["error"],
                                skipped=counts["skipped"], disagreed=counts["disagree"])
    for version in sorted(loaded):
        stats = version_stats(before, after, model, version, router, with_p99=bool(router))
        report["versions"].append({"version": version, "rps": stats.requests / elapsed,
                                   "error_rate": stats.error_rate, "mean_ms": stats.mean_ms, "p99_ms": stats.p99_ms})
    return report


def _controller(lease: Optional[Lease], rollout: Rollout) -> dict:
    """Whether a controller drives the rollout in progress: its heartbeat is at most
    ``MISSED_BEATS`` intervals old (else it was killed or stopped, and traffic stays as it left it)."""
    if lease is None:  # the rollout was started by a controller that kept no heartbeat
        return {"running": False, "holder": None, "last_heartbeat": None, "heartbeat_s": None,
                "since": rollout.updated, "since_what": "last update"}
    return {"running": lease.alive(), "holder": lease.holder, "last_heartbeat": lease.beat,
            "heartbeat_s": lease.interval_s, "since": lease.stopped or lease.beat,
            "since_what": "exited" if lease.stopped else "last heartbeat"}


def _rollout_dict(rollout: Rollout) -> dict:
    steps = rollout.settings.get("plan", {}).get("steps", [])
    step = None
    if rollout.phase == "step" and 0 <= rollout.step < len(steps):
        item = steps[rollout.step]
        kind = "canary" if "canary" in item else "shadow"
        step = f"{rollout.step + 1}/{len(steps)} {kind} {item[kind]:g}%"
    return {"id": rollout.id, "model": rollout.model, "semver": rollout.semver, "current_version": rollout.current_version,
            "new_version": rollout.new_version, "phase": rollout.phase, "step": step, "paused": rollout.paused,
            "outcome": rollout.outcome, "reason": rollout.reason, "started": rollout.started,
            "finished": rollout.finished, "duration_s": _duration(rollout)}


def _duration(rollout: Rollout) -> float:
    start = _dt.datetime.fromisoformat(rollout.started)
    end = _dt.datetime.fromisoformat(rollout.finished) if rollout.finished else _dt.datetime.now(_dt.timezone.utc)
    return round((end - start).total_seconds(), 1)


def _fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def render(report: dict) -> str:
    lines = [f"model {report['model']}" + (f"  (router {report['router']})" if report["router"] else "")]
    rollout = report["rollout"]
    if rollout:
        lines.append(f"rollout #{rollout['id']} in progress: {rollout['semver']} as v{rollout['new_version']} beside "
                     f"v{rollout['current_version']}, phase {rollout['phase']}"
                     + (f" {rollout['step']}" if rollout["step"] else "") + (" (PAUSED)" if rollout["paused"] else "")
                     + f", {rollout['duration_s']:.0f} s")
        controller = report["controller"]
        if controller["running"]:
            lines.append(f"controller running ({controller['holder']}, last heartbeat {controller['last_heartbeat']})")
        else:
            lines.append(f"controller not running since {controller['since']} ({controller['since_what']}), "
                         f"run `dspark rollout recover {report['model']}`")
    elif report["last_rollout"]:
        last = report["last_rollout"]
        lines.append(f"no rollout in progress; last: #{last['id']} {last['semver']} {last['outcome']}"
                     + (f" ({last['reason']})" if last["reason"] else ""))
    lines.append("")
    lines.append(f"{'server':<32} {'health':<8} versions")
    for server in report["servers"]:
        versions = ", ".join(f"v{v} {s}" for v, s in sorted(server["versions"].items(), key=lambda kv: int(kv[0])))
        health = "live" if server["live"] else "DOWN"
        lines.append(f"{server['url']:<32} {health:<8} {versions or server['error'] or '-'}")
    if report["shares"] is not None:
        traffic = ", ".join(f"v{v} {p:g}%" for v, p in report["shares"].items())
        shadow = report["shadow"]
        lines.append(f"traffic: {traffic}" + (f"; shadow {shadow['percent']:g}% to v{shadow['version']}" if shadow else ""))
        if shadow and "copied" in shadow:
            sampled = shadow["copied"] + shadow["skipped"]
            lines.append(f"shadow over {report['window_s']:g} s: {shadow['copied']:.0f} of {sampled:.0f} sampled "
                         f"requests copied, {shadow['skipped']:.0f} skipped (shadow.max_inflight calls in flight), "
                         f"{shadow['disagreed']:.0f} disagreed")
    lines.append("")
    lines.append(f"{'version':<8} {'req/s':>8} {'errors':>8} {'mean ms':>8} {'p99 ms':>8}")
    for row in report["versions"]:
        errors = None if row["error_rate"] is None else 100 * row["error_rate"]
        lines.append(f"v{row['version']:<7} {row['rps']:>8.1f} {_fmt(errors, '{:.1f}%'):>8} "
                     f"{_fmt(row['mean_ms'], '{:.1f}'):>8} {_fmt(row['p99_ms'], '{:.1f}'):>8}")
    return "\n".join(lines)


def history_rows(rollouts: list[Rollout]) -> list[dict]:
    return [_rollout_dict(r) for r in rollouts]


def render_history(rows: list[dict]) -> str:
    lines = [f"{'id':>4} {'model':<18} {'version':<12} {'folders':<9} {'outcome':<12} {'took':>7}  {'started':<24} reason"]
    for row in rows:
        outcome = row["outcome"] or f"({row['phase']})"
        lines.append(f"{row['id']:>4} {row['model']:<18} {row['semver']:<12} "
                     f"{str(row['current_version']) + '->' + str(row['new_version']):<9} {outcome:<12} "
                     f"{row['duration_s']:>6.0f}s  {row['started'][:23]:<24} {row['reason'] or ''}")
    return "\n".join(lines)
