"""The rollout controller: stage a version, load it beside the current one, walk the plan's
steps under analysis, then promote it or roll it back, on one server or a fleet.

Order of operations (what keeps clients from ever failing):
- a version is routed to only after it is loaded and warm on *every* server;
- a version is unloaded only after every router has confirmed (``dspark_router_config_version``
  on each server's /metrics) a routing file that no longer sends it traffic, and requests routed
  before the switch have drained (the longest tier deadline, then an interval with no request
  reaching it);
- each phase is written to the state file before it is applied, so ``recover`` can redo it:
  every phase's actions are idempotent.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime as _dt
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from dspark.errors import ConfigError, DsparkError, UnavailableError
from dspark.params import parse_parameters
from dspark.repository.modelspec import (
    CONFIG_FILENAME, SPEC_FILENAME, ModelSpec, SpecError, VersionRecord, check_model_name, semver_key)
from dspark.rollout.analysis import judge
from dspark.rollout.fleet import Endpoint, Server, connect
from dspark.rollout.metrics import PrometheusSource, ScrapeSource, delta, read
from dspark.rollout.plan import Plan
from dspark.rollout.state import Heartbeat, ModelLock, Rollout, StateStore
from dspark.rollout.store import load_routing, open_store, save_routing
from dspark.triton.params import RouterParameters

CONFIRM_TIMEOUT_S = 15.0


@dataclass
class Deployment:
    """Where a rollout acts: the model, the router in front of it, the repository the servers
    share, the router's routing file, the servers and the metrics source."""

    model: str
    router: Optional[str]
    repository: str
    endpoints: list[Endpoint]
    routing_file: Optional[str] = None
    prometheus: Optional[str] = None

    def __post_init__(self) -> None:
        check_model_name(self.model, "model")  # it names the lock file and the repository folder
        if self.router:
            check_model_name(self.router, "router")
        if self.router and not self.routing_file:
            if str(self.repository).startswith("s3://"):
                raise ConfigError("routing-file", "with an S3 repository, say where the routers read their routing: "
                                                  "a shared path or an S3 object their pods sync (docs/rollout.md)")
            self.routing_file = str(Path(self.repository) / self.router / "routing.yaml")

    def to_settings(self) -> dict:
        data = dataclasses.asdict(self)
        data["endpoints"] = [dataclasses.asdict(e) for e in self.endpoints]
        return data

    @classmethod
    def from_settings(cls, data: dict) -> "Deployment":
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        values["endpoints"] = [Endpoint(**e) for e in values["endpoints"]]
        return cls(**values)


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
        self.store = open_store(deployment.repository)
        self.servers: list[Server] = connect(deployment.endpoints, api_key, plan.load_timeout_s)
        self.direct = ScrapeSource([e.metrics_url for e in deployment.endpoints])
        self.metrics = PrometheusSource(deployment.prometheus) if deployment.prometheus else self.direct
        self._t0 = time.monotonic()
        self._rollout: Optional[Rollout] = None

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
        spec = self._spec()
        newest = spec.version
        semver_key(semver)
        if newest is not None and semver_key(semver) <= semver_key(newest):
            raise SpecError("version", f"{semver} is not newer than the recorded {newest}; give a higher "
                                       "semantic version")
        current = self._current_folder(spec)
        self._check_fleet(current)
        new = spec.next_folder()
        for server in self.servers:  # a rolled-back version of this number may still be stopping
            if not server.wait_unloaded(model, new, self.plan.drain_timeout_s):
                raise UnavailableError(f"{server.name}: an earlier version {new} of '{model}' is still unloading",
                                       "unloading")
        if self.deployment.router:
            self._check_routing(current, new)
        settings = {"deployment": self.deployment.to_settings(), "plan": self.plan.to_dict(),
                    "artifact": str(artifact.resolve())}
        rollout = self.state.create(model, self.deployment.router, semver, current, new, settings)
        self._rollout = rollout
        self._event("start", f"rollout #{rollout.id}: {model} {semver} as version {new} beside version {current} "
                             f"on {len(self.servers)} server(s), metrics from {self.metrics.describe()}")
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
                self._drain(rollout.current_version)
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
        for leftover in self.store.clean_staging(model):
            self._event("stage", f"removed {leftover}, left by an interrupted staging")
        record = VersionRecord(semver=semver, folder=new, artifact=spec.artifact_name, source=str(artifact.resolve()),
                               added=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
        if self.store.exists(f"{model}/{new}"):  # left by an interrupted rollout: not served
            self.store.remove_folder(f"{model}/{new}")
        self.store.install_folder(f"{model}/{new}", artifact, spec.artifact_name)
        current_semver = next(r.semver for r in spec.versions if r.folder == current)
        spec.versions.append(record)
        spec.serve_versions = [current_semver, semver]
        self._write_spec(spec)
        self._event("stage", f"staged {semver} as {self.store.url}/{model}/{new}; config serves versions {current}, {new}")

    def _load_new(self, rollout: Rollout) -> None:
        model, new = rollout.model, rollout.new_version
        self._on_all(lambda s: s.load(model), f"load {model}")
        for server in self.servers:
            if not server.wait_ready(model, new, True, self.plan.load_timeout_s):
                raise UnavailableError(f"{server.name}: version {new} of '{model}' not ready after "
                                       f"{self.plan.load_timeout_s:g} s", "load")
            if not server.ready(model, rollout.current_version):
                raise UnavailableError(f"{server.name}: current version {rollout.current_version} of '{model}' "
                                       "stopped being ready while loading the new one", "load")
        self._event("load", f"version {new} loaded and ready on {len(self.servers)} server(s)")

    def _warm_up(self, rollout: Rollout) -> None:
        model, new = rollout.model, rollout.new_version
        count = self.plan.warmup.requests
        if count:
            self._on_all(lambda s: s.warm_up(model, new, count), "warm-up")
            self._event("warmup", f"{count} warm-up request(s) answered on each server")
        accuracy = self.plan.analysis.accuracy
        if accuracy is not None:
            scores = {v: self._accuracy(model, v) for v in (rollout.current_version, new)}
            message = (f"accuracy on {accuracy.dataset.name}: version {new} {scores[new]:.3f}, "
                       f"version {rollout.current_version} {scores[rollout.current_version]:.3f} (min {accuracy.min:g})")
            self._event("accuracy", message, {str(k): v for k, v in scores.items()})
            if scores[new] < accuracy.min:
                raise _Rollback(f"accuracy {scores[new]:.3f} of version {new} on {accuracy.dataset.name} "
                                f"< {accuracy.min:g}")

    def _run_step(self, rollout: Rollout, index: int) -> str:
        step = self.plan.steps[index]
        label = f"step {index + 1}/{len(self.plan.steps)} {step.kind} {step.percent:g}%"
        cur, new = rollout.current_version, rollout.new_version
        if step.kind == "canary":
            shares = {cur: 100.0 - step.percent, new: step.percent} if step.percent < 100 else {new: 100.0}
            self._route(rollout, shares, None, label)
        else:
            self._route(rollout, {cur: 100.0}, step.percent, label)
        rules = self.plan.analysis
        started = time.monotonic()
        served = 0.0
        breaches = judged = 0
        previous = step_start = read(self.metrics)
        while True:
            command = self._wait(rules.interval_s)
            rollout = self.state.get(rollout.id)
            if command == "promote":
                self._event("command", f"promoted by hand during {label}")
                return "promote"
            snapshot = read(self.metrics)
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
            not_ready = [s.name for s in self.servers if not s.ready(rollout.model, new)]
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
        spec = self._spec()
        spec.serve_versions = [rollout.semver]
        self._write_spec(spec)
        self._on_all(lambda s: s.load(rollout.model), f"load {rollout.model}")
        for server in self.servers:
            server.wait_ready(rollout.model, rollout.current_version, False, self.plan.drain_timeout_s)
        self._event("retire", f"version {rollout.current_version} unloaded; {rollout.semver} "
                              f"(version {rollout.new_version}) serves alone")

    def _rollback(self, reason: str) -> Outcome:
        rollout = self._phase("rolling_back", reason=reason)
        self._event("rollback", f"ROLLING BACK: {reason}")
        model, cur, new = rollout.model, rollout.current_version, rollout.new_version
        if self.deployment.router:
            self._route(rollout, {cur: 100.0}, None, "rollback: all traffic")
            self._drain(new)
        spec = self._spec()
        current_semver = next(r.semver for r in spec.versions if r.folder == cur)
        spec.versions = [r for r in spec.versions if r.folder != new]
        spec.serve_versions = [current_semver]
        self._write_spec(spec)
        self._on_all(lambda s: s.load(model), f"load {model}", tolerate=True)
        for server in self.servers:  # its instances may take seconds more to stop; they serve nothing
            server.wait_ready(model, new, False, self.plan.drain_timeout_s)
        self.store.remove_folder(f"{model}/{new}")
        rollout = self._finish("rolled_back", reason)
        self._event("done", f"rolled back: version {cur} serves alone; reason: {reason}")
        return Outcome(rollout, False, reason)

    # ------------------------------------------------------------------ routing
    def _route(self, rollout: Rollout, shares: dict[int, float], shadow_percent: Optional[float], label: str) -> None:
        """Write the routing file and wait until every reachable server's router applies it."""
        if not self.deployment.router:
            return
        config = load_routing(self.deployment.routing_file)
        shadow = _changed(config.shadow, version=rollout.new_version if shadow_percent else None,
                                     percent=shadow_percent or 0.0)
        wanted = _changed(config, shares=shares, shadow=shadow)
        if dict(config.shares) == shares and config.shadow == shadow:
            wanted = config  # already written (a recovery): only confirm it
        else:
            wanted = _changed(wanted, version=config.version + 1).validate()
            save_routing(wanted, self.deployment.routing_file)
        self._confirm(wanted.version)
        split = ", ".join(f"v{v} {p:g}%" for v, p in shares.items())
        shadow_text = f", shadow {shadow_percent:g}% to v{rollout.new_version}" if shadow_percent else ""
        self._event("route", f"{label}: {split}{shadow_text} (routing version {wanted.version}, "
                             f"confirmed on {len(self.servers)} server(s))",
                    {"shares": {str(k): v for k, v in shares.items()}, "shadow": shadow_percent})

    def _confirm(self, version: int) -> None:
        deadline = time.monotonic() + CONFIRM_TIMEOUT_S
        router = self.deployment.router
        down: set[str] = set()
        while True:
            snapshot = self.direct.snapshot()
            lagging = []
            for server, endpoint in zip(self.servers, self.deployment.endpoints):
                if endpoint.metrics_url in snapshot.errors:
                    if endpoint.url not in down and not server.healthy():
                        down.add(endpoint.url)  # a server that is down routes nothing
                        self._event("warning", f"{endpoint.url} is down: routing version {version} not confirmed there")
                    if endpoint.url not in down:
                        lagging.append(f"{endpoint.url} (metrics unreachable)")
                    continue
                seen = [v for _, v in snapshot.select("dspark_router_config_version", model=router,
                                                      instance=endpoint.metrics_url)]
                if not seen or max(seen) < version:
                    lagging.append(f"{endpoint.url} (router at {max(seen) if seen else 'no'} routing version)")
            if not lagging:
                return
            if time.monotonic() > deadline:
                raise UnavailableError(f"routing version {version} not confirmed within {CONFIRM_TIMEOUT_S:g} s "
                                       f"on: {', '.join(lagging)}", "routing")
            time.sleep(0.1)

    def _drain(self, version: int) -> None:
        """Wait until requests routed to ``version`` before the switch are gone: the longest
        queue deadline (a queued request is dispatched or expired by then), then an interval in
        which no request reached it (capped by the plan's drain_timeout_s)."""
        model = self.deployment.model
        started = time.monotonic()
        if self.deployment.router:
            config = load_routing(self.deployment.routing_file)
            longest = max(t.deadline_ms for t in config.tiers.values()) / 1000
            time.sleep(max(0.0, min(longest, self.plan.drain_timeout_s) - (time.monotonic() - started)))
        quiet = min(1.0, self.plan.analysis.interval_s)
        previous = self.direct.snapshot()
        while time.monotonic() - started < self.plan.drain_timeout_s:
            time.sleep(quiet)
            snapshot = self.direct.snapshot()
            labels = {"model": model, "version": str(version)}
            moved = sum(delta(snapshot, previous, name, **labels)
                        for name in ("nv_inference_request_success", "nv_inference_request_failure"))
            pending = snapshot.total("nv_inference_pending_request_count", **labels)
            if moved == 0 and pending == 0:
                self._event("drain", f"version {version} drained in {time.monotonic() - started:.1f} s")
                return
            previous = snapshot
        self._event("drain", f"version {version} still had requests after {self.plan.drain_timeout_s:g} s; going on")

    # ------------------------------------------------------------------ helpers
    def _spec(self) -> ModelSpec:
        model = self.deployment.model
        text = self.store.read_text(f"{model}/{SPEC_FILENAME}")
        if text is None:
            raise SpecError("", f"no {SPEC_FILENAME} for '{model}' in {self.store.url}: run "
                                f"`dspark repo init` to adopt the model first")
        return ModelSpec.from_dict(yaml.safe_load(text))

    def _write_spec(self, spec: ModelSpec) -> None:
        model = self.deployment.model
        self.store.write_text(f"{model}/{SPEC_FILENAME}", yaml.safe_dump(spec.to_dict(), sort_keys=False))
        self.store.write_text(f"{model}/{CONFIG_FILENAME}", spec.config_text() + instance_warmup(
            spec.to_model_config(), self.plan.warmup.instance_requests))

    @staticmethod
    def _current_folder(spec: ModelSpec) -> int:
        if not spec.versions:
            raise SpecError("versions", "the model has no version yet: add its first with `dspark repo add`")
        if spec.serve_versions == "latest":
            return max(r.folder for r in spec.versions)
        if isinstance(spec.serve_versions, list) and len(spec.serve_versions) == 1:
            return spec.folder_of(spec.serve_versions[0])
        raise SpecError("serve_versions", f"serves {spec.serve_versions!r}: a rollout starts from one served "
                                          "version (finish or undo the last change first)")

    def _check_fleet(self, current: int) -> None:
        model = self.deployment.model
        problems = []
        for server in self.servers:
            if not server.healthy():
                problems.append(f"{server.name} is not live")
                continue
            try:
                server.index()  # the model-repository API answers (the key is right)
            except UnavailableError as error:
                problems.append(str(error))
                continue
            if not server.ready(model, current):
                problems.append(f"{server.name} does not serve '{model}' version {current}")
            elif self.deployment.router and not server.ready(self.deployment.router):
                problems.append(f"{server.name} does not serve the router '{self.deployment.router}'")
        if problems:
            raise UnavailableError("fleet not ready: " + "; ".join(problems), "fleet")

    def _check_routing(self, current: int, new: int) -> None:
        router = self.deployment.router
        config = load_routing(self.deployment.routing_file)
        if {v for v, p in config.shares.items() if p > 0} != {current}:
            raise ConfigError("shares", f"router '{router}' splits traffic {dict(config.shares)}; a rollout starts "
                                        f"from version {current} at 100% (`dspark route set --share {current}=100`)",
                              self.deployment.routing_file)
        parameters = self.servers[0].client.get_model_config(router).get("parameters", {})
        flat = {k: v.get("string_value", "") for k, v in parameters.items()}
        if flat.get("target_model") != self.deployment.model:
            raise ConfigError("router", f"'{router}' fronts '{flat.get('target_model')}', not '{self.deployment.model}'")
        allowed = parse_parameters(RouterParameters, flat).versions()
        if allowed is not None and new not in allowed:
            raise ConfigError("parameter 'target_versions'", f"router '{router}' may route only to versions "
                                                             f"{sorted(allowed)}; set it to \"*\" so rollouts can add version {new}")

    def _accuracy(self, model: str, version: int) -> float:
        accuracy = self.plan.analysis.accuracy
        try:
            data = dict(np.load(accuracy.dataset))
        except (OSError, ValueError) as error:
            raise ConfigError("analysis.accuracy.dataset", str(error), accuracy.dataset) from None
        if "labels" not in data:
            raise ConfigError("analysis.accuracy.dataset", "needs an array named 'labels'", accuracy.dataset)
        labels = data.pop("labels")
        server = self.servers[0]
        batched = server.client.get_model_config(model, str(version)).get("max_batch_size", 0) > 0
        right = 0
        for i, label in enumerate(labels):
            row = {name: (array[i:i + 1] if batched else array[i]) for name, array in data.items()}
            output = server.infer(model, version, row)
            if accuracy.output not in output:
                raise ConfigError("analysis.accuracy.output", f"'{model}' has no output '{accuracy.output}' "
                                                              f"(outputs: {', '.join(output)})")
            right += int(np.argmax(output[accuracy.output]) == int(label))
        return right / max(1, len(labels))

    def _on_all(self, action: Callable[[Server], None], what: str, tolerate: bool = False) -> None:
        """Run ``action`` on every server at once; the first failure is raised (after all finished)."""
        with concurrent.futures.ThreadPoolExecutor(len(self.servers)) as pool:
            futures = {pool.submit(action, s): s for s in self.servers}
            errors = []
            for future, server in futures.items():
                try:
                    future.result()
                except DsparkError as error:
                    errors.append(error)
        if errors and not tolerate:
            raise errors[0] if isinstance(errors[0], UnavailableError) else UnavailableError(str(errors[0]), what)
        for error in errors:
            self._event("warning", f"{what}: {error}")

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
        for server in self.servers:
            server.close()


def instance_warmup(config: mc.ModelConfig, count: int) -> str:
    """A ``model_warmup`` entry (config.pbtxt text) that has Triton send ``count`` requests of
    zeros to each new instance before its version is ready; empty when ``count`` is 0 or the
    config has its own warm-up."""
    if not count or config.model_warmup:
        return ""
    sample = mc.ModelWarmup(name="dspark_rollout_warmup", batch_size=1, count=count)
    for tensor in config.input:
        if not tensor.optional:
            sample.inputs[tensor.name].CopyFrom(mc.ModelWarmup.Input(
                data_type=tensor.data_type, dims=[1 if d < 0 else d for d in tensor.dims], zero_data=True))
    return text_format.MessageToString(mc.ModelConfig(model_warmup=[sample]))


def _changed(config, **changes):
    """A copy of a routing config (a dataclass, or a pydantic model) with ``changes``."""
    if dataclasses.is_dataclass(config):
        return dataclasses.replace(config, **changes)
    return config.model_copy(update=changes)


class _Rollback(Exception):
    """Raised inside a rollout to roll it back; the message is the reason."""

