"""A rollout over a fleet of three servers sharing one S3 model repository (a moto server on
loopback): published once, each step applied on every server, metrics read through a real
Prometheus scraping the fleet; a server that cannot load the version rolls it back everywhere
(regressions are rolled back on the fleet by the benchmark, on one server by test_rollout.py). Zero failed client requests throughout."""
from __future__ import annotations

import shutil
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import TEST_EXIT_TIMEOUT_S, TEST_ROUTER_POLL_MS, dump_log_on_failure
from dspark.rollout import demo
from dspark.rollout.controller import Controller
from dspark.rollout.deployment import Deployment
from dspark.rollout.fleet import Endpoint, Server
from dspark.rollout.plan import Plan
from dspark.rollout.state import StateStore
from dspark.rollout.store import S3Store
from dspark.routing.config import RoutingConfig
from dspark.server.launcher import TritonServer
from dspark.server.access import DEFAULT_HEADER_PATTERN, header_forward_args, new_api_key

pytestmark = pytest.mark.integration
SERVERS = 3
BROKEN_ENV = "ROLLOUT_DEMO_CANNOT_LOAD"
PLAN = {
    "steps": [{"shadow": 30, "hold_s": 1.5}, {"canary": 50, "hold_s": 1.5}],
    "analysis": {"interval_s": 1.0, "min_requests": 10},
    "warmup": {"requests": 2},
    "drain_timeout_s": 10,
}


class BrokenServer(TritonServer):
    """A server whose environment has BROKEN_ENV: versions built with broken_where=BROKEN_ENV fail to load."""

    def environment(self, install):
        return {**super().environment(install), BROKEN_ENV: "1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def fleet(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    s3 = demo.serve_s3(free_port())
    url = f"s3://127.0.0.1:{s3._port}/models/repo"
    local = demo.build_repository(root / "local", routing_file=root / "local" / "routing.yaml", poll_interval_ms=TEST_ROUTER_POLL_MS)
    demo.publish_to_s3(local, url)
    shutil.rmtree(local / demo.MODEL)  # the model lives in S3 only; the router stays local
    servers = []
    key = new_api_key()  # one key for the fleet: the controller presents it to every server
    failed_before = request.session.testsfailed
    try:
        # the last server lacks what a broken version needs
        servers = [(BrokenServer if i == SERVERS - 1 else TritonServer)(
            [local], model_control="explicit", load_models=[demo.MODEL, demo.ROUTER],
            exit_timeout_s=TEST_EXIT_TIMEOUT_S, api_key=key,
            extra_args=[f"--model-repository={url}", *header_forward_args(DEFAULT_HEADER_PATTERN)])
            for i in range(SERVERS)]
        with ThreadPoolExecutor(SERVERS) as pool:
            list(pool.map(TritonServer.start, servers))
        prometheus, prometheus_url = demo.serve_prometheus(
            [s.metrics_url.split("//")[1].split("/")[0] for s in servers], root / "prometheus", free_port())
        load = demo.LoadGenerator([s.http_url for s in servers], threads_per_server=1).start()
        site = type("Fleet", (), {})()
        site.root, site.url, site.local, site.servers, site.load = root, url, local, servers, load
        site.key = key
        site.prometheus_url = prometheus_url
        site.endpoints = [Endpoint.parse(s.http_url, s.metrics_url, s.grpc_url) for s in servers]
        site.n = 0
        yield site
        load.stop()
        prometheus.terminate()
        prometheus.wait(10)
    finally:
        for server in servers:
            dump_log_on_failure(request, server, failed_before)
        with ThreadPoolExecutor(SERVERS) as pool:
            list(pool.map(TritonServer.stop, servers))
        s3.stop()


def rollout(fleet, prometheus: bool = False, plan: dict = PLAN, **behaviour):
    fleet.n += 1
    semver = f"1.{fleet.n}.0"
    path = demo.model_artifact(fleet.root / f"model-{fleet.n}.py", semver, **behaviour)
    deployment = Deployment(demo.MODEL, demo.ROUTER, fleet.url, fleet.endpoints,
                            routing_file=str(fleet.local / "routing.yaml"),
                            prometheus=fleet.prometheus_url if prometheus else None)
    state = StateStore(fleet.root / "state.sqlite")
    controller = Controller(deployment, Plan.from_dict(plan), state, fleet.key, say=print)
    try:
        return controller.start(path, semver), state
    finally:
        controller.close()


def fleet_versions(fleet) -> list[set[int]]:
    out = []
    for endpoint in fleet.endpoints:
        server = Server(endpoint, fleet.key)
        out.append({int(i["version"]) for i in server.index() if i["name"] == demo.MODEL and i.get("state") == "READY"})
        server.close()
    return out


def assert_consistent(fleet, serving: int):
    """Every server serves exactly `serving`, every router sends all traffic there, no client failed."""
    assert fleet_versions(fleet) == [{serving}] * SERVERS
    config = RoutingConfig.load(fleet.local / "routing.yaml")
    assert dict(config.shares) == {serving: 100.0} and not config.shadow.percent
    assert not fleet.load.failures(), fleet.load.failures()[:3]


def test_fleet_promotes_with_metrics_from_prometheus(fleet):
    outcome, state = rollout(fleet, prometheus=True)
    assert outcome.promoted, outcome.reason
    judged = [e["data"] for e in state.events(outcome.rollout.id, ("analysis",))]
    assert judged and all(d["breach"] is None for d in judged)
    assert sum(d["new"]["requests"] for d in judged) > 20  # Prometheus did carry the new version's traffic
    assert_consistent(fleet, outcome.rollout.new_version)
    spec = S3Store(fleet.url).read_text(f"{demo.MODEL}/modelspec.yaml")
    assert outcome.rollout.semver in spec  # published once, to the shared repository


def test_a_server_that_cannot_load_rolls_back_everywhere(fleet):
    """The servers load at once (the other test loads them one at a time, the default): the two
    that loaded the version unload it again."""
    before = fleet_versions(fleet)[0]
    outcome, state = rollout(fleet, plan={**PLAN, "parallel_loads": SERVERS}, broken_where=BROKEN_ENV)
    assert not outcome.promoted
    assert fleet.servers[-1].http_url in outcome.reason and "loading" in outcome.reason, outcome.reason
    assert not state.events(outcome.rollout.id, ("route",))[:-1]  # no traffic ever went to it
    assert_consistent(fleet, next(iter(before)))
