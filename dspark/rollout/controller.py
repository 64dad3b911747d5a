"""The rollout controller: stage a version, load it beside the current one, walk the plan's
steps under analysis, then promote it or roll it back, on one server or a fleet.

Order of operations (what keeps clients from ever failing):
- a version is routed to only after it is loaded and warm on *every* server (loaded a few
  servers at a time: deployment.py);
- a version is unloaded only after every router has confirmed (``dspark_router_config_version``
  on each server's /metrics) a routing file that no longer sends it traffic, and requests routed
  before the switch have drained (the longest tier deadline, then an interval with no request
  reaching it);
- each phase is written to the state file before it is applied, so ``recover`` can redo it:
  every phase's actions are idempotent.
"""
from __future__ import annotations

import datetime as _dt
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from dspark._ext import probes
from dspark.errors import ConfigError, UnavailableError
from dspark.repository.modelspec import ModelSpec, SpecError, VersionRecord, semver_key
from dspark.rollout.analysis import judge
from dspark.rollout.deployment import Deployment, Fleet
from dspark.rollout.fleet import Server
from dspark.rollout.metrics import read
from dspark.rollout.plan import Plan
from dspark.rollout.state import Heartbeat, ModelLock, Rollout, StateStore


@dataclass
class Outcome:
    rollout: Rollout
    promoted: bool
    reason: Optional[str] = None


class Controller:
    def __init__(self, deployment: Deployment, plan: Plan, state: StateStore, api_key: Optional[str] = None,
                 say: Callable[[str], None] = print):
        self.deployment = deployment
        self.plan = plan
        self.state = state
        self.say = say
        self._t0 = time.monotonic()
        self._rollout: Optional[Rollout] = None
        self.fleet = Fleet(deployment, plan, api_key, self._event)

    # ------------------------------------------------------------------ public entry points
    def start(self, artifact: Path, semver: str) -> Outcome:
        """Publish ``artifact`` as version ``semver`` and run the plan to its end."""
        with ModelLock(self.state.path, self.deployment.model), Heartbeat(self.state.path, self.deployment.model):
            return self._start(artifact, semver)

    def recover(self, rollback: bool = False) -> Outcome:
        """Finish the interrupted rollout of this model (or roll it back)."""
        with ModelLock(self.state.path, self.deployment.model), Heartbeat(self.state.path, self.deployment.model):
            return self._recover(rollback)

    def _start(self, artifact: Path, semver: str) -> Outcome:
        model = self.deployment.model
        active = self.state.active(model)
        if active is not None:
            raise UnavailableError(f"rollout #{active.id} of '{model}' ({active.semver}) stopped in phase "
                                   f"'{active.phase}': run `dspark rollout recover {model}` first", "interrupted")
        artifact = Path(artifact)
        if not artifact.exists():
            raise ConfigError("artifact", "does not exist", artifact)
        spec = self.fleet.spec()
        newest = spec.version
        semver_key(semver)
        if newest is not None and semver_key(semver) <= semver_key(newest):
            raise SpecError("version", f"{semver} is not newer than the recorded {newest}; give a higher "
                                       "semantic version")
        current = self.fleet.current_folder(spec)
        self.fleet.check_servers(current)
        new = spec.next_folder()
        for server in self.fleet.servers:  # a rolled-back version of this number may still be stopping
            if not server.wait_unloaded(model, new, self.plan.drain_timeout_s):
                raise UnavailableError(f"{server.name}: an earlier version {new} of '{model}' is still unloading",
                                       "unloading")
        if self.deployment.router:
            self.fleet.check_routing(current, new)
        settings = {"deployment": self.deployment.to_settings(), "plan": self.plan.to_dict(),
                    "artifact": str(artifact.resolve())}
        rollout = self.state.create(model, self.deployment.router, semver, current, new, settings)
        self._rollout = rollout
        self._event("start", f"rollout #{rollout.id}: {model} {semver} as version {new} beside version {current} "
                             f"on {len(self.fleet.servers)} server(s), metrics from {self.fleet.metrics.describe()}")
        self._stage(spec, artifact, semver, current, new)
        return self._drive(self._phase("loading"))

    def _recover(self, rollback: bool) -> Outcome:
        rollout = self.state.active(self.deployment.model)
        if rollout is None:
            raise UnavailableError(f"no interrupted rollout of '{self.deployment.model}' to recover", "none")
        self._rollout = rollout
        self._event("recover", f"recovering rollout #{rollout.id} from phase '{rollout.phase}'"
                               + (f" step {rollout.step + 1}" if rollout.phase == "step" else "")
                               + (" by rolling back" if rollback else ""))
        if rollout.phase in ("retiring",):
            return self._drive(rollout)  # the old version is going: finishing is the only way back
        if rollback or rollout.phase == "staging":
            return self._rollback(rollout.reason or ("rolled back by hand after an interruption" if rollback
                                                     else "interrupted while staging the version"))
        return self._drive(rollout)

    # ------------------------------------------------------------------ phases
    def _drive(self, rollout: Rollout) -> Outcome:
        try:
            if rollout.phase == "loading":
                self._load_new(rollout)
                rollout = self._phase("warmup")
            if rollout.phase == "warmup":
                self._warm_up(rollout)
                rollout = self._phase("step", step=0)
            if rollout.phase == "step":
                for index in range(rollout.step, len(self.plan.steps)):
                    rollout = self._phase("step", step=index)
                    outcome = self._run_step(rollout, index)
                    if outcome == "promote":
                        break
                rollout = self._phase("promoting")
            if rollout.phase == "rolling_back":
                return self._rollback(rollout.reason or "rollback interrupted")
            if rollout.phase == "promoting":
                self._route(rollout, {rollout.new_version: 100.0}, None, "promoted: all traffic")
                rollout = self._phase("draining")
            if rollout.phase == "draining":
                self.fleet.drain(rollout.current_version)
                rollout = self._phase("retiring")
            if rollout.phase == "retiring":
                self._retire(rollout)
                rollout = self._finish("promoted", None)
            return Outcome(rollout, True, None)
        except _Rollback as signal:
            return self._rollback(str(signal))
        except UnavailableError as error:
            if self._rollout.phase in ("retiring", "rolling_back"):
                raise
            return self._rollback(str(error))

    def _stage(self, spec: ModelSpec, artifact: Path, semver: str, current: int, new: int) -> None:
        model = self.deployment.model
        for leftover in self.fleet.store.clean_staging(model):
            self._event("stage", f"removed {leftover}, left by an interrupted staging")
        record = VersionRecord(semver=semver, folder=new, artifact=spec.artifact_name, source=str(artifact.resolve()),
                               added=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
        if self.fleet.store.exists(f"{model}/{new}"):  # left by an interrupted rollout: not served
            self.fleet.store.remove_folder(f"{model}/{new}")
        self.fleet.store.install_folder(f"{model}/{new}", artifact, spec.artifact_name)
        current_semver = next(r.semver for r in spec.versions if r.folder == current)
        spec.versions.append(record)
        spec.serve_versions = [current_semver, semver]
        self.fleet.write_spec(spec)
        self._event("stage", f"staged {semver} as {self.fleet.store.url}/{model}/{new}; config serves versions {current}, {new}")

    def _load_new(self, rollout: Rollout) -> None:
        model, new = rollout.model, rollout.new_version

        def settled(server: Server) -> None:
            if not server.wait_ready(model, new, True, self.plan.load_timeout_s):
                raise UnavailableError(f"{server.name}: version {new} of '{model}' not ready after "
                                       f"{self.plan.load_timeout_s:g} s", "load")
            if not server.ready(model, rollout.current_version):
                raise UnavailableError(f"{server.name}: current version {rollout.current_version} of '{model}' "
                                       "stopped being ready while loading the new one", "load")

        self.fleet.load(settled)
        self._event("load", f"version {new} loaded and ready on {len(self.fleet.servers)} server(s)")

    def _warm_up(self, rollout: Rollout) -> None:
        model, new = rollout.model, rollout.new_version
        count = self.plan.warmup.requests
        if count:
            self.fleet.on_all(lambda s: s.warm_up(model, new, count), "warm-up")
            self._event("warmup", f"{count} warm-up request(s) answered on each server")
        accuracy = self.plan.analysis.accuracy
        if accuracy is not None:
            scores = {v: self.fleet.accuracy(v) for v in (rollout.current_version, new)}
            message = (f"accuracy on {accuracy.dataset.name}: version {new} {scores[new]:.3f}, "
                       f"version {rollout.current_version} {scores[rollout.current_version]:.3f} (min {accuracy.min:g})")
            self._event("accuracy", message, {str(k): v for k, v in scores.items()})
            if scores[new] < accuracy.min:
                raise _Rollback(f"accuracy {scores[new]:.3f} of version {new} on {accuracy.dataset.name} "
                                f"< {accuracy.min:g}")

    def _run_step(self, rollout: Rollout, index: int) -> str:
        step = self.plan.steps[index]
        label = f"step {index + 1}/{len(self.plan.steps)} {step.kind} {step.percent:g}%"
        probes.rollout_step(rollout.model, index + 1, step.kind, step.percent)
        cur, new = rollout.current_version, rollout.new_version
        if step.kind == "canary":
            shares = {cur: 100.0 - step.percent, new: step.percent} if step.percent < 100 else {new: 100.0}
            # a canary call that fails is answered by the current version, still loaded everywhere
            self._route(rollout, shares, None, label, fallback=cur)
        else:
            self._route(rollout, {cur: 100.0}, step.percent, label)
        rules = self.plan.analysis
        started = time.monotonic()
        served = 0.0
        breaches = judged = 0
        previous = step_start = read(self.fleet.metrics, (cur, new))
        while True:
            command = self._wait(rules.interval_s)
            rollout = self.state.get(rollout.id)
            if command == "promote":
                self._event("command", f"promoted by hand during {label}")
                return "promote"
            snapshot = read(self.fleet.metrics, (cur, new))
            verdict = judge(previous, snapshot, model=rollout.model, router=rollout.router, current=cur, new=new,
                            phase=step.kind, rules=rules)
            # latency is judged on the step so far, once it spans latency_intervals intervals: one
            # slow interval (a busy host) is not a slow version, nor is one fast interval a fast one
            judged += 1
            verdict.reasons.pop("latency", None)
            if judged >= rules.latency_intervals:
                overall = judge(step_start, snapshot, model=rollout.model, router=rollout.router, current=cur,
                                new=new, phase=step.kind, rules=rules)
                if "latency" in overall.reasons:
                    verdict.reasons["latency"] = overall.reasons["latency"] + f" over the step's {judged} intervals"
            previous = snapshot
            not_ready = [s.name for s in self.fleet.servers if not s.ready(rollout.model, new)]
            if not_ready:
                verdict.reasons["ready"] = f"version {new} not ready on " + ", ".join(not_ready)
            self._event("analysis", f"{label}: {verdict.summary()}"
                                    + (f" -> BREACH: {verdict.breach}" if verdict.breach else "")
                                    + "".join(f" [{note}]" for note in verdict.notes), verdict.to_dict())
            if verdict.breach:
                breaches += 1
                if breaches >= rules.breaches_to_rollback:
                    raise _Rollback(verdict.breach)
            else:
                breaches = 0
            served += verdict.new.requests
            held = time.monotonic() - started
            if rollout.paused:
                continue
            if (step.hold_s is None or held >= step.hold_s) and (step.requests is None or served >= step.requests):
                return "next"

    def _wait(self, seconds: float) -> Optional[str]:
        """Sleep for ``seconds`` while taking commands; returns 'promote' when asked to skip ahead."""
        deadline = time.monotonic() + seconds
        while True:
            for command, reason in self.state.take_commands(self.deployment.model):
                if command == "rollback":
                    raise _Rollback(f"rolled back by hand{': ' + reason if reason else ''}")
                if command == "promote":
                    return "promote"
                if command in ("pause", "resume"):
                    self.state.update(self._rollout.id, paused=command == "pause")
                    self._event("command", f"{command}d by hand" + (f": {reason}" if reason else ""))
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(0.1, left))

    def _retire(self, rollout: Rollout) -> None:
        """Serve only the new version: the old one is unloaded (Triton waits for its requests)."""
        spec = self.fleet.spec()
        spec.serve_versions = [rollout.semver]
        self.fleet.write_spec(spec)
        self.fleet.load(lambda s: s.wait_ready(rollout.model, rollout.current_version, False,
                                               self.plan.drain_timeout_s))
        self._event("retire", f"version {rollout.current_version} unloaded; {rollout.semver} "
                              f"(version {rollout.new_version}) serves alone")

    def _rollback(self, reason: str) -> Outcome:
        rollout = self._phase("rolling_back", reason=reason)
        self._event("rollback", f"ROLLING BACK: {reason}")
        model, cur, new = rollout.model, rollout.current_version, rollout.new_version
        if self.deployment.router:
            self._route(rollout, {cur: 100.0}, None, "rollback: all traffic")
            self.fleet.drain(new)
        spec = self.fleet.spec()
        current_semver = next(r.semver for r in spec.versions if r.folder == cur)
        spec.versions = [r for r in spec.versions if r.folder != new]
        spec.serve_versions = [current_semver]
        self.fleet.write_spec(spec)
        # its instances may take seconds more to stop; they serve nothing
        self.fleet.load(lambda s: s.wait_ready(model, new, False, self.plan.drain_timeout_s), tolerate=True)
        self.fleet.store.remove_folder(f"{model}/{new}")
        rollout = self._finish("rolled_back", reason)
        self._event("done", f"rolled back: version {cur} serves alone; reason: {reason}")
        return Outcome(rollout, False, reason)

    # ------------------------------------------------------------------ routing
    def _route(self, rollout: Rollout, shares: dict[int, float], shadow_percent: Optional[float], label: str,
               fallback: Optional[int] = None) -> None:
        """Write the routing file and wait until every reachable server's router applies it."""
        if not self.deployment.router:
            return
        version = self.fleet.route(rollout.new_version, shares, shadow_percent, fallback)
        split = ", ".join(f"v{v} {p:g}%" for v, p in shares.items())
        shadow_text = f", shadow {shadow_percent:g}% to v{rollout.new_version}" if shadow_percent else ""
        self._event("route", f"{label}: {split}{shadow_text} (routing version {version}, "
                             f"confirmed on {len(self.fleet.servers)} server(s))",
                    {"shares": {str(k): v for k, v in shares.items()}, "shadow": shadow_percent})

    def _phase(self, phase: str, **fields) -> Rollout:
        self._rollout = self.state.update(self._rollout.id, phase=phase, **fields)
        return self._rollout

    def _finish(self, outcome: str, reason: Optional[str]) -> Rollout:
        self._rollout = self.state.update(self._rollout.id, phase="done", outcome=outcome, reason=reason,
                                          finished=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"))
        self.state.drop_commands(self._rollout.model)
        if outcome == "promoted":
            self._event("done", f"promoted: {self._rollout.semver} (version {self._rollout.new_version}) serves all traffic")
        return self._rollout

    def _event(self, kind: str, message: str, data=None) -> None:
        self.say(f"[{time.monotonic() - self._t0:6.1f}s] {message}")
        if self._rollout is not None:
            self.state.event(self._rollout.id, kind, message, data)

    def close(self) -> None:
        self.fleet.close()


class _Rollback(Exception):
    """Raised inside a rollout to roll it back; the message is the reason."""

