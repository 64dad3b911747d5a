"""Where a rollout acts (``Deployment``) and what it does there (``Fleet``): the model spec in the
shared repository, loads on every server, the routing file and its confirmation by every
router, draining, the checks before a rollout starts. The controller (controller.py) decides the
order; everything here is one idempotent action, so a recovered rollout can redo it.

Loads go to ``Plan.parallel_loads`` servers at a time (default one): a load starts new Python
stubs for every version of the model, seconds of CPU, and the next server starts only once the
last one's versions are where the step wants them. Servers that share a host then never start
their stubs at once, and at most one server at a time serves from freshly started instances.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from dspark.errors import ConfigError, DsparkError, UnavailableError
from dspark.params import parse_parameters
from dspark.repository.modelspec import CONFIG_FILENAME, SPEC_FILENAME, ModelSpec, SpecError, check_model_name
from dspark.rollout.fleet import Endpoint, Server, connect
from dspark.rollout.metrics import PrometheusSource, ScrapeSource, delta
from dspark.rollout.plan import Plan
from dspark.rollout.store import load_routing, open_store, save_routing
from dspark.triton.params import RouterParameters

CONFIRM_TIMEOUT_S = 15.0
ANSWERED = ("nv_inference_request_success", "nv_inference_request_failure")  # counters a drain watches
DRAIN_FAMILIES = (*ANSWERED, "nv_inference_pending_request_count")


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


class Fleet:
    """The actions of a rollout on every server of ``deployment``; ``event(kind, message)``
    records what happened."""

    def __init__(self, deployment: Deployment, plan: Plan, api_key: Optional[str],
                 event: Callable[[str, str], None]):
        self.deployment = deployment
        self.plan = plan
        self.event = event
        self.store = open_store(deployment.repository)
        self.servers: list[Server] = connect(deployment.endpoints, api_key, plan.load_timeout_s)
        self.direct = ScrapeSource([e.metrics_url for e in deployment.endpoints])
        self.metrics = PrometheusSource(deployment.prometheus) if deployment.prometheus else self.direct

    # ------------------------------------------------------------------ the model spec
    def spec(self) -> ModelSpec:
        model = self.deployment.model
        text = self.store.read_text(f"{model}/{SPEC_FILENAME}")
        if text is None:
            raise SpecError("", f"no {SPEC_FILENAME} for '{model}' in {self.store.url}: run "
                                f"`dspark repo init` to adopt the model first")
        return ModelSpec.from_dict(yaml.safe_load(text))

    def write_spec(self, spec: ModelSpec) -> None:
        model = self.deployment.model
        self.store.write_text(f"{model}/{SPEC_FILENAME}", yaml.safe_dump(spec.to_dict(), sort_keys=False))
        self.store.write_text(f"{model}/{CONFIG_FILENAME}", spec.config_text() + instance_warmup(
            spec.to_model_config(), self.plan.warmup.instance_requests))

    @staticmethod
    def current_folder(spec: ModelSpec) -> int:
        if not spec.versions:
            raise SpecError("versions", "the model has no version yet: add its first with `dspark repo add`")
        if spec.serve_versions == "latest":
            return max(r.folder for r in spec.versions)
        if isinstance(spec.serve_versions, list) and len(spec.serve_versions) == 1:
            return spec.folder_of(spec.serve_versions[0])
        raise SpecError("serve_versions", f"serves {spec.serve_versions!r}: a rollout starts from one served "
                                          "version (finish or undo the last change first)")

    # ------------------------------------------------------------------ loads
    def load(self, settled: Callable[[Server], None], tolerate: bool = False) -> None:
        """Load the model as its config now says on every server, ``plan.parallel_loads`` at a
        time; ``settled(server)`` waits until that server's versions are as wanted (raising
        UnavailableError when they do not get there) before the next servers load."""
        model, step = self.deployment.model, self.plan.parallel_loads

        def load_and_settle(server: Server) -> None:
            server.load(model)
            settled(server)

        for first in range(0, len(self.servers), step):
            self.on_all(load_and_settle, f"load {model}", tolerate, self.servers[first:first + step])

    def on_all(self, action: Callable[[Server], None], what: str, tolerate: bool = False,
               servers: Optional[Sequence[Server]] = None) -> None:
        """Run ``action`` on every server (or on ``servers``) at once; the first failure is
        raised after all finished, or with ``tolerate`` recorded as a warning."""
        servers = self.servers if servers is None else servers
        errors = []
        with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
            for future in [pool.submit(action, s) for s in servers]:
                try:
                    future.result()
                except DsparkError as error:
                    errors.append(error)
        if errors and not tolerate:
            raise errors[0] if isinstance(errors[0], UnavailableError) else UnavailableError(str(errors[0]), what)
        for error in errors:
            self.event("warning", f"{what}: {error}")

    # ------------------------------------------------------------------ routing
    def route(self, new_version: int, shares: dict[int, float], shadow_percent: Optional[float],
              fallback: Optional[int] = None) -> int:
        """Write the routing file (``shadow_percent`` copied to ``new_version``, failed calls
        answered by ``fallback``) and wait until every reachable server's router applies it;
        returns its routing version."""
        config = load_routing(self.deployment.routing_file)
        shadow = _changed(config.shadow, version=new_version if shadow_percent else None,
                          percent=shadow_percent or 0.0)
        wanted = _changed(config, shares=shares, shadow=shadow, fallback_version=fallback)
        if dict(config.shares) == shares and config.shadow == shadow and config.fallback_version == fallback:
            wanted = config  # already written (a recovery): only confirm it
        else:
            wanted = _changed(wanted, version=config.version + 1).validate()
            save_routing(wanted, self.deployment.routing_file)
        self.confirm(wanted.version)
        return wanted.version

    def confirm(self, version: int) -> None:
        deadline = time.monotonic() + CONFIRM_TIMEOUT_S
        router = self.deployment.router
        down: set[str] = set()
        while True:
            snapshot = self.direct.snapshot(("dspark_router_config_version",))  # polled: parse no more
            lagging = []
            for server, endpoint in zip(self.servers, self.deployment.endpoints):
                if endpoint.metrics_url in snapshot.errors:
                    if endpoint.url not in down and not server.healthy():
                        down.add(endpoint.url)  # a server that is down routes nothing
                        self.event("warning", f"{endpoint.url} is down: routing version {version} not confirmed there")
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

    def drain(self, version: int) -> None:
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
        previous = self.direct.snapshot(DRAIN_FAMILIES)
        while time.monotonic() - started < self.plan.drain_timeout_s:
            time.sleep(quiet)
            snapshot = self.direct.snapshot(DRAIN_FAMILIES)
            labels = {"model": model, "version": str(version)}
            moved = sum(delta(snapshot, previous, name, **labels) for name in ANSWERED)
            pending = snapshot.total("nv_inference_pending_request_count", **labels)
            if moved == 0 and pending == 0:
                self.event("drain", f"version {version} drained in {time.monotonic() - started:.1f} s")
                return
            previous = snapshot
        self.event("drain", f"version {version} still had requests after {self.plan.drain_timeout_s:g} s; going on")

    # ------------------------------------------------------------------ checks
    def check_servers(self, current: int) -> None:
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

    def check_routing(self, current: int, new: int) -> None:
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

    def accuracy(self, version: int) -> float:
        """The share of the plan's labelled set that ``version`` gets right (on the first server)."""
        accuracy, model = self.plan.analysis.accuracy, self.deployment.model
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
