"""RouterCore end to end with a fake asynchronous target (no server)."""

import asyncio
import threading
import time
from collections import Counter

import numpy as np
import pytest

from dspark.routing.config import RoutingConfig, ShadowPolicy, TierPolicy
from dspark.routing.runtime import Job, RouterCore, RouterMetrics


class Recorder(RouterMetrics):
    def __init__(self):
        self.events = []
        self.lock = threading.Lock()

    def _add(self, *e):
        with self.lock:
            self.events.append(e)

    def request(self, tier, version, count=1):
        for _ in range(count):
            self._add("request", tier, version)
    def rejection(self, tier, reason): self._add("rejection", tier, reason)
    def shadow(self, version, outcome, seconds): self._add("shadow", version, outcome)
    def config_version(self, version): self._add("config_version", version)

    def count(self, *prefix):
        with self.lock:
            return sum(1 for e in self.events if e[: len(prefix)] == prefix)


class Client:
    """Collects answers; each job must be answered exactly once."""

    def __init__(self):
        self.answers = {}
        self.expected = 0
        self.lock = threading.Lock()

    def job(self, name, tier=None, user_id=None, x=1.0):
        def respond(outputs, error):
            with self.lock:
                assert name not in self.answers, f"{name} answered twice"
                self.answers[name] = (outputs, error, time.monotonic())
        self.expected += 1
        return Job(payload={"x": np.array([x], np.float32)}, respond=respond, tier=tier,
                   user_id=user_id, request_id=name)

    def wait(self, timeout=10):
        assert eventually(lambda: len(self.answers) == self.expected, timeout), \
            f"{self.expected - len(self.answers)} requests never answered"


def eventually(condition, timeout=3.0):
    """Metrics and shadow calls happen after the answer; wait for them."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def make_target(service_s=0.01, behaviour=None):
    log = []

    async def call(payload, version):
        log.append(version)
        if behaviour and version in behaviour:
            return await behaviour[version](payload)
        await asyncio.sleep(service_s)
        return {"y": payload["x"] * 2}
    return call, log


def config(**kw):
    tiers = kw.pop("tiers", {
        "diamond": TierPolicy(weight=8, deadline_ms=2000),
        "gold": TierPolicy(weight=3, deadline_ms=2000),
        "standard": TierPolicy(weight=1, deadline_ms=2000),
    })
    return RoutingConfig(tiers=tiers, **kw).validate()


@pytest.fixture
def run_core():
    cores = []

    def make(cfg, target, metrics=None):
        core = RouterCore(cfg, target, metrics or Recorder(), poll_interval_s=0.05)
        core.start()
        cores.append(core)
        return core
    yield make
    for core in cores:
        core.stop()


def test_answers_every_request_with_target_outputs(run_core):
    target, _ = make_target()
    core = run_core(config(max_inflight=4), target)
    client = Client()
    for i in range(20):
        core.submit(client.job(f"r{i}", tier="gold", x=float(i)))
    client.wait()
    for i in range(20):
        outputs, error, _ = client.answers[f"r{i}"]
        assert error is None and outputs["y"][0] == 2.0 * i


def test_diamond_overtakes_a_standard_backlog(run_core):
    target, _ = make_target(service_s=0.01)
    core = run_core(config(max_inflight=1), target)
    client = Client()
    for i in range(40):
        core.submit(client.job(f"s{i}", tier="standard"))
    time.sleep(0.02)
    core.submit(client.job("d", tier="diamond"))
    client.wait()
    order = sorted(client.answers, key=lambda k: client.answers[k][2])
    assert order.index("d") <= 4  # served within a few slots, not after 40 standard


def test_deadline_and_queue_full_give_explained_errors(run_core):
    target, _ = make_target(service_s=0.05)
    tiers = {"standard": TierPolicy(weight=1, deadline_ms=80, max_queue=5)}
    metrics = Recorder()
    core = run_core(config(tiers=tiers, max_inflight=1), target, metrics)
    client = Client()
    for i in range(8):
        core.submit(client.job(f"r{i}"))
    client.wait()
    errors = [e for _, e, _ in client.answers.values() if e is not None]
    reasons = Counter(e.reason for e in errors)
    assert reasons["queue_full"] == 2  # 1 in flight + 5 queued, 2 turned away
    assert reasons["deadline"] >= 3
    for e in errors:
        assert e.code == "UNAVAILABLE"
        if e.reason == "deadline":
            assert "past the tier's queue deadline of 80 ms" in str(e) and "'standard' queue" in str(e)
    assert eventually(lambda: metrics.count("rejection", "standard", "deadline") == reasons["deadline"])


def test_unknown_tier_is_invalid_argument(run_core):
    target, _ = make_target()
    core = run_core(config(), target)
    client = Client()
    core.submit(client.job("r", tier="platinum"))
    client.wait()
    _, error, _ = client.answers["r"]
    assert error.code == "INVALID_ARG" and "parameter 'tier': unknown tier 'platinum'" in str(error)


def test_target_error_reaches_only_that_client(run_core):
    async def broken(payload):
        raise RuntimeError("version 2 exploded")
    target, _ = make_target(behaviour={2: broken})
    core = run_core(config(shares={1: 50, 2: 50}), target)
    client = Client()
    for i in range(40):
        core.submit(client.job(f"r{i}", user_id=f"u{i}"))
    client.wait()
    errors = [e for _, e, _ in client.answers.values() if e is not None]
    assert 0 < len(errors) < 40 and all("version 2 exploded" in str(e) for e in errors)


def test_shadow_that_sleeps_or_fails_never_delays_the_primary(run_core):
    async def slow(payload):
        await asyncio.sleep(1.0)
        return {"y": payload["x"] * 2}

    async def broken(payload):
        raise RuntimeError("shadow exploded")

    for behaviour, outcome in ((slow, None), (broken, "error")):
        target, calls = make_target(service_s=0.005, behaviour={2: behaviour})
        metrics = Recorder()
        shadow = ShadowPolicy(version=2, percent=100, max_inflight=100)
        core = run_core(config(shares={1: 100}, shadow=shadow), target, metrics)
        client = Client()
        start = time.monotonic()
        for i in range(20):
            core.submit(client.job(f"r{i}"))
        client.wait()
        assert time.monotonic() - start < 0.5
        assert all(e is None for _, e, _ in client.answers.values())
        if outcome:
            assert eventually(lambda: metrics.count("shadow", 2, "error") == 20)
        assert eventually(lambda: calls.count(2) == 20)


def test_shadow_comparison_counts_disagreements(run_core):
    async def off_by_a_bit(payload):
        return {"y": payload["x"] * 2 + 0.01}
    target, _ = make_target(behaviour={2: off_by_a_bit})
    for atol, outcome in ((0.0, "disagree"), (0.1, "agree")):
        metrics = Recorder()
        core = run_core(config(shadow=ShadowPolicy(version=2, percent=100, atol=atol, max_inflight=50)),
                        target, metrics)
        client = Client()
        for i in range(10):
            core.submit(client.job(f"r{i}"))
        client.wait()
        assert eventually(lambda: metrics.count("shadow", 2, outcome) == 10)


def test_live_reconfiguration_keeps_every_request(run_core):
    target, calls = make_target(service_s=0.002)
    core = run_core(config(shares={1: 100}, max_inflight=2), target)
    client = Client()
    for i in range(300):
        core.submit(client.job(f"r{i}", user_id=f"u{i}"))
        if i == 150:
            core.apply(config(shares={1: 0, 2: 100}, max_inflight=3))
    client.wait()
    assert all(e is None for _, e, _ in client.answers.values())
    assert calls.count(2) > 100 and calls.count(1) > 0


def test_stop_answers_queued_requests(run_core):
    target, _ = make_target(service_s=0.05)
    core = run_core(config(max_inflight=1), target)
    client = Client()
    for i in range(10):
        core.submit(client.job(f"r{i}"))
    time.sleep(0.01)
    core.stop()
    client.wait(2)
    reasons = Counter(e.reason if e else "ok" for _, e, _ in client.answers.values())
    assert reasons["shutdown"] >= 8 and reasons["ok"] >= 1


def test_routing_file_change_is_picked_up(run_core, tmp_path):
    from dspark.routing.config import ConfigWatcher

    path = tmp_path / "routing.yaml"
    config(shares={1: 100}).save(path)
    target, calls = make_target(service_s=0.001)
    core = run_core(ConfigWatcher(path, {1, 2}), target)
    client = Client()
    core.submit(client.job("before"))
    client.wait()
    path.write_text("shares: {1: 50, 2: 70}\n")  # invalid: the old config stays
    time.sleep(0.2)
    core.submit(client.job("still-v1"))
    client.wait()
    replace_config = config(shares={2: 100}, version=7)
    replace_config.save(path)
    deadline = time.monotonic() + 3
    while core.config.version != 7 and time.monotonic() < deadline:
        time.sleep(0.02)
    core.submit(client.job("after"))
    client.wait()
    assert calls == [1, 1, 2]


def test_fast_path_only_when_idle_and_target_fast_and_never_overtakes_the_queue(run_core):
    target, log = make_target(service_s=0.01)
    core = run_core(config(max_inflight=1), target)
    ticket = core.try_inline("gold", None, "inline-1")
    assert ticket is not None and ticket.tier == "gold" and ticket.version == 1
    assert core.try_inline("diamond", None, "inline-2") is None, "the only slot is taken"
    client = Client()
    core.submit(client.job("queued", tier="standard"))
    time.sleep(0.1)
    assert client.answers == {} and log == []
    assert core.try_inline("diamond", None, "inline-3") is None, "a request is queued"
    core.finish_inline(ticket)
    client.wait()
    assert client.answers["queued"][1] is None and log == [1]
    assert core.try_inline("platinum", None, "x") is None, "unknown tiers take the queued path (which explains)"


def test_fast_path_closes_for_a_slow_target_and_when_turned_off(run_core):
    target, _ = make_target()
    core = run_core(config(inline_max_ms=5), target)
    for _ in range(3):
        core.observe_target(0.2)  # 200 ms calls: execute must not block that long
    assert core.try_inline("standard", None, "r") is None
    for _ in range(40):
        core.observe_target(0.001)
    ticket = core.try_inline("standard", None, "r")
    assert ticket is not None
    core.finish_inline(ticket)
    core.apply(config(inline_max_ms=0))
    assert eventually(lambda: core.config.inline_max_ms == 0)
    assert core.try_inline("standard", None, "r") is None


def test_fast_path_shadow_runs_after_the_answer_and_errors_count(run_core):
    target, log = make_target()
    metrics = Recorder()
    core = run_core(config(shares={1: 100}, shadow=ShadowPolicy(version=2, percent=100, max_inflight=5)),
                    target, metrics)
    ticket = core.try_inline("diamond", "alice", None)
    assert ticket.shadow
    payload = {"x": np.array([3.0], np.float32)}
    core.finish_inline(ticket, payload, {"y": payload["x"] * 2})
    assert eventually(lambda: metrics.count("shadow", 2, "agree") == 1)
    assert log == [2]
    failed = core.try_inline("diamond", "bob", None)
    core.finish_inline(failed, failed=True)
    assert eventually(lambda: metrics.count("rejection", "diamond", "target_error") == 1)
    assert log == [2], "no shadow for a failed primary"
    assert core.scheduler.inflight == 0
    assert eventually(lambda: metrics.count("request", "diamond", 1) == 2), "fast-path requests are counted"
