"""RouterCore end to end with a fake blocking target (no server)."""

import threading
import time
from collections import Counter

import numpy as np
import pytest

from dspark.errors import CancelledError, DsparkError, RequestError, UnavailableError
from dspark.routing.config import ConfigWatcher, RoutingConfig, ShadowPolicy, TierPolicy
from dspark.routing.metrics import RouterMetrics
from dspark.routing.runtime import Job, RouterCore


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
    def rejection(self, tier, reason, count=1):
        for _ in range(count):
            self._add("rejection", tier, reason)
    def shadow(self, version, outcome, seconds): self._add("shadow", version, outcome)
    def config_version(self, version): self._add("config_version", version)
    def fast_path(self, count): self._add("fast_path", count)
    def target_error(self, version, count=1):
        for _ in range(count):
            self._add("target_error", version)

    def count(self, *prefix):
        with self.lock:
            return sum(1 for e in self.events if e[: len(prefix)] == prefix)


class FakeTarget:
    """y = 2x after ``service_s``; ``behaviour[version](payload)`` replaces that for a version."""

    def __init__(self, service_s=0.01, behaviour=None):
        self.service_s = service_s
        self.behaviour = behaviour or {}
        self.calls = []  # versions, in call order
        self.running = 0
        self.most_running = 0
        self.lock = threading.Lock()

    def call(self, payload, version, timeout_s):
        with self.lock:
            self.calls.append(version)
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            if version in self.behaviour:
                return self.behaviour[version](payload)
            time.sleep(self.service_s)
            return {"y": payload["x"] * 2}
        finally:
            with self.lock:
                self.running -= 1

    def detach(self, payload):
        return {name: np.array(a, copy=True) for name, a in payload.items()}

    def arrays(self, outputs):
        return outputs


class Client:
    """Records every answer; ``wait`` fails unless each job got exactly one."""

    def __init__(self):
        self.answers = {}
        self.expected = []
        self.lock = threading.Lock()

    def job(self, name, tier=None, user_id=None, x=1.0, cancelled=None):
        def respond(outputs, error):
            with self.lock:
                self.answers.setdefault(name, []).append((outputs, error, time.monotonic()))
        self.expected.append(name)
        return Job(payload={"x": np.array([x], np.float32)}, respond=respond, tier=tier,
                   user_id=user_id, request_id=name, is_cancelled=cancelled)

    def wait(self, timeout=10, settle=0.05):
        assert eventually(lambda: len(self.answers) == len(self.expected), timeout), \
            f"never answered: {sorted(set(self.expected) - set(self.answers))}"
        time.sleep(settle)  # a second answer would land now
        twice = {name: len(a) for name, a in self.answers.items() if len(a) != 1}
        assert not twice, f"answered more than once: {twice}"

    def outputs(self, name):
        return self.answers[name][0][0]

    def error(self, name):
        return self.answers[name][0][1]

    def finished(self, name):
        return self.answers[name][0][2]


def eventually(condition, timeout=3.0):
    """Metrics and shadow calls happen after the answer; wait for them."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def config(**kw):
    tiers = kw.pop("tiers", {
        "diamond": TierPolicy(weight=8, deadline_ms=2000),
        "gold": TierPolicy(weight=3, deadline_ms=2000),
        "standard": TierPolicy(weight=1, deadline_ms=2000),
    })
    kw.setdefault("top_tier_headroom", 0)
    kw.setdefault("handoff_lead_ms", 0)
    return RoutingConfig(tiers=tiers, **kw).validate()


@pytest.fixture
def run_core():
    cores = []

    def make(cfg, target, metrics=None, **kw):
        core = RouterCore(cfg, target, metrics or Recorder(), poll_interval_s=0.05, **kw)
        core.start()
        cores.append(core)
        return core
    yield make
    for core in cores:
        core.stop(timeout_s=2)


def test_answers_every_request_once_with_its_outputs(run_core):
    target = FakeTarget()
    core = run_core(config(max_inflight=4), target)
    client = Client()
    for i in range(40):
        core.submit(client.job(f"r{i}", tier="gold", x=float(i)))
    client.wait()
    for i in range(40):
        assert client.error(f"r{i}") is None and client.outputs(f"r{i}")["y"][0] == 2.0 * i
    assert target.most_running == 4, "max_inflight calls run at once, no more"


def test_client_wait_fails_on_a_double_answer():
    client = Client()
    job = client.job("r")
    job.respond({"y": 1}, None)
    job.respond({"y": 1}, None)
    with pytest.raises(AssertionError, match="answered more than once"):
        client.wait(timeout=1)


def test_diamond_overtakes_a_standard_backlog(run_core):
    core = run_core(config(max_inflight=1), FakeTarget(service_s=0.01))
    client = Client()
    for i in range(40):
        core.submit(client.job(f"s{i}", tier="standard"))
    time.sleep(0.02)
    core.submit(client.job("d", tier="diamond"))
    client.wait()
    order = sorted(client.answers, key=client.finished)
    assert order.index("d") <= 4  # served within a few slots, not after 40 standard


def test_top_tier_headroom_dispatches_diamond_past_a_full_target(run_core):
    """max_inflight auto = the target's 2 instances, +1 only diamond may use: with both
    instances busy with standard calls a diamond request goes out at once."""
    target = FakeTarget(service_s=0.2)
    core = run_core(config(max_inflight="auto", top_tier_headroom=1), target, target_instances=2)
    client = Client()
    for i in range(6):
        core.submit(client.job(f"s{i}", tier="standard"))
    assert eventually(lambda: target.running == 2)
    time.sleep(0.05)
    assert target.running == 2, "standard keeps exactly the target's instances busy"
    sent = time.monotonic()
    core.submit(client.job("d", tier="diamond"))
    assert eventually(lambda: target.running == 3, timeout=0.1), "diamond is dispatched at once"
    client.wait()
    assert client.finished("d") - sent < 0.3
    assert target.most_running == 3


def test_the_next_call_goes_out_just_before_a_running_call_ends(run_core):
    """max_inflight 1 and a 30 ms hand-off lead: once the router knows the target takes ~100 ms,
    each next call is sent ~70 ms into the running one (never earlier, never more than one)."""
    target = FakeTarget(service_s=0.1)
    core = run_core(config(max_inflight=1, handoff_lead_ms=30, inline_max_ms=0), target)
    client = Client()
    core.submit(client.job("warm-up"))
    client.wait()
    starts = []
    original = target.call

    def timed(payload, version, timeout_s):
        starts.append(time.monotonic())
        return original(payload, version, timeout_s)
    target.call = timed
    for i in range(4):
        core.submit(client.job(f"r{i}"))
    client.wait()
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert all(0.04 < gap < 0.099 for gap in gaps), gaps  # ~70 ms: before the 100 ms call ends
    assert target.most_running == 2


def test_deadline_and_queue_full_give_explained_errors(run_core):
    tiers = {"standard": TierPolicy(weight=1, deadline_ms=80, max_queue=5)}
    metrics = Recorder()
    target = FakeTarget(service_s=0.05)
    core = run_core(config(tiers=tiers, max_inflight=1, inline_max_ms=0), target, metrics)
    client = Client()
    core.submit(client.job("r0"))
    assert eventually(lambda: target.running == 1)
    for i in range(1, 8):
        core.submit(client.job(f"r{i}"))
    client.wait()
    errors = [client.error(n) for n in client.answers if client.error(n) is not None]
    reasons = Counter(e.reason for e in errors)
    # 1 in flight + 5 queued, 2 turned away; r1 starts at 50 ms, the rest wait past 80 ms
    assert reasons["queue_full"] == 2 and reasons["deadline"] >= 3 and len(errors) <= 6
    for e in errors:
        assert isinstance(e, UnavailableError) and e.code == "UNAVAILABLE"
        if e.reason == "deadline":
            assert "past the tier's queue deadline of 80 ms" in str(e) and "'standard' queue" in str(e)
        else:
            assert "router 'router': tier 'standard' queue is full (5 waiting, max_queue 5)" == str(e)
    assert eventually(lambda: metrics.count("rejection", "standard", "deadline") == reasons["deadline"])
    assert metrics.count("rejection", "standard", "queue_full") == 2


def test_unknown_tier_is_invalid_argument(run_core):
    core = run_core(config(), FakeTarget())
    client = Client()
    core.submit(client.job("r", tier="platinum"))
    client.wait()
    error = client.error("r")
    assert isinstance(error, RequestError) and error.code == "INVALID_ARG"
    assert str(error) == "parameter 'tier': unknown tier 'platinum'; expected one of diamond, gold, standard"


def test_target_error_reaches_only_that_client(run_core):
    def broken(payload):
        raise RuntimeError("version 2 exploded")
    core = run_core(config(shares={1: 50, 2: 50}), FakeTarget(behaviour={2: broken}))
    client = Client()
    for i in range(40):
        core.submit(client.job(f"r{i}", user_id=f"u{i}"))
    client.wait()
    errors = [client.error(n) for n in client.answers if client.error(n) is not None]
    assert 5 < len(errors) < 35
    assert {str(e) for e in errors} == {"target 'target' version 2 failed: version 2 exploded"}
    assert all(type(e) is DsparkError and e.code == "INTERNAL" for e in errors)


def test_a_failing_version_is_answered_by_the_fallback_and_still_counted_against_it(run_core):
    def broken(payload):
        raise RuntimeError("version 2 exploded")
    metrics = Recorder()
    target = FakeTarget(behaviour={2: broken})
    core = run_core(config(shares={1: 50, 2: 50}, fallback_version=1, max_inflight=2), target, metrics)
    client = Client()
    for i in range(40):
        core.submit(client.job(f"r{i}", user_id=f"u{i}", x=float(i)))
    client.wait()
    assert all(client.error(f"r{i}") is None and client.outputs(f"r{i}")["y"][0] == 2.0 * i for i in range(40))
    failed = Counter(target.calls)[2]
    assert 5 < failed < 35 and Counter(target.calls)[1] == 40, "each failed call went once more to version 1"
    assert eventually(lambda: metrics.count("target_error", 2) == failed)
    assert metrics.count("rejection") == 0

    def slow_and_broken(payload):
        time.sleep(0.2)
        raise RuntimeError("version 2 exploded")
    target.behaviour[2] = slow_and_broken
    core.apply(config(shares={2: 100}, fallback_version=1, max_inflight=2))
    client = Client()
    core.submit(client.job("in-flight", x=5.0))
    assert eventually(lambda: target.calls[-1] == 2)
    core.apply(config(shares={1: 100}, max_inflight=2))  # a rollback: the fallback is cleared
    client.wait()
    assert client.error("in-flight") is None and client.outputs("in-flight")["y"][0] == 10.0, \
        "a request keeps the fallback that was set when it arrived"

    target.behaviour[2] = broken
    core.apply(config(shares={2: 100}, fallback_version=3, max_inflight=2))
    target.behaviour[3] = broken
    client = Client()
    core.submit(client.job("both-fail"))
    client.wait()
    assert str(client.error("both-fail")) == "target 'target' version 3 failed: version 2 exploded", \
        "when the fallback fails too, the client gets its error"


def test_fast_path_falls_back_too(run_core):
    def broken(payload):
        raise RuntimeError("version 2 exploded")
    metrics = Recorder()
    target = FakeTarget(service_s=0.001, behaviour={2: broken})
    core = run_core(config(shares={2: 100}, fallback_version=1), target, metrics)
    ticket = core.try_inline("gold", None, "r")
    assert core.run_inline(ticket, {"x": np.array([3.0], np.float32)})["y"][0] == 6.0
    assert target.calls == [2, 1]
    assert eventually(lambda: metrics.count("target_error", 2) == 1) and metrics.count("rejection") == 0


def test_a_hanging_target_times_out_with_unavailable_and_keeps_its_slot(run_core):
    release = threading.Event()

    def hang(payload):
        release.wait(10)
        return {"y": payload["x"] * 2}
    tiers = {"gold": TierPolicy(weight=3, deadline_ms=150, timeout_ms=100),
             "standard": TierPolicy(weight=1, deadline_ms=150)}
    metrics = Recorder()
    target = FakeTarget(behaviour={1: hang})
    core = run_core(config(tiers=tiers, max_inflight=1, inline_max_ms=0), target, metrics)
    client = Client()
    start = time.monotonic()
    core.submit(client.job("hung", tier="gold"))
    core.submit(client.job("queued", tier="standard"))
    client.wait(timeout=3)
    hung, queued = client.error("hung"), client.error("queued")
    assert isinstance(hung, UnavailableError) and hung.reason == "target_timeout"
    assert str(hung) == ("router 'router': target 'target' version 1 did not answer within 100 ms "
                         "(the 'gold' tier's timeout)")
    assert 0.09 < client.finished("hung") - start < 0.5
    # the hung call still holds the only slot: the queued request is not sent, it expires
    assert queued.reason == "deadline" and target.calls == [1]
    release.set()
    assert eventually(lambda: core.scheduler.inflight == 0)
    assert eventually(lambda: metrics.count("rejection", "gold", "target_timeout") == 1)
    client.wait(settle=0.1)  # the late answer of the hung call is dropped, not sent twice


def test_cancelled_requests_are_not_sent_to_the_target(run_core):
    target = FakeTarget(service_s=0.1)
    metrics = Recorder()
    core = run_core(config(max_inflight=1, cancel_check_ms=0), target, metrics)
    client = Client()
    gone = threading.Event()
    core.submit(client.job("first"))
    core.submit(client.job("left", cancelled=gone.is_set))
    core.submit(client.job("stayed", cancelled=lambda: False))
    gone.set()
    client.wait()
    error = client.error("left")
    assert isinstance(error, CancelledError) and error.code == "CANCELLED"
    assert "not sent to the target" in str(error)
    assert client.error("stayed") is None and len(target.calls) == 2
    assert eventually(lambda: metrics.count("rejection", "standard", "cancelled") == 1)


def test_shadow_that_sleeps_or_fails_never_delays_the_primary(run_core):
    def slow(payload):
        time.sleep(1.0)
        return {"y": payload["x"] * 2}

    def broken(payload):
        raise RuntimeError("shadow exploded")

    for behaviour, outcome in ((slow, None), (broken, "error")):
        target = FakeTarget(service_s=0.005, behaviour={2: behaviour})
        metrics = Recorder()
        shadow = ShadowPolicy(version=2, percent=100, max_inflight=100)
        core = run_core(config(shares={1: 100}, shadow=shadow, max_inflight=4), target, metrics)
        client = Client()
        start = time.monotonic()
        for i in range(20):
            core.submit(client.job(f"r{i}"))
        client.wait()
        assert time.monotonic() - start < 0.5
        assert all(client.error(n) is None for n in client.answers)
        if outcome:
            assert eventually(lambda: metrics.count("shadow", 2, "error") == 20)
        else:  # 8 shadow threads: some ran, the rest wait for a thread, none was skipped
            assert eventually(lambda: target.calls.count(2) >= 8)
            assert metrics.count("shadow", 2, "skipped") == 0


def test_shadow_comparison_counts_disagreements(run_core):
    def off_by_a_bit(payload):
        return {"y": payload["x"] * 2 + 0.01}
    for atol, outcome in ((0.0, "disagree"), (0.1, "agree")):
        metrics = Recorder()
        core = run_core(config(shadow=ShadowPolicy(version=2, percent=100, atol=atol, rtol=0, max_inflight=50)),
                        FakeTarget(behaviour={2: off_by_a_bit}), metrics)
        client = Client()
        for i in range(10):
            core.submit(client.job(f"r{i}"))
        client.wait()
        assert eventually(lambda: metrics.count("shadow", 2, outcome) == 10)


def test_live_reconfiguration_keeps_every_request(run_core):
    target = FakeTarget(service_s=0.002)
    core = run_core(config(shares={1: 100}, max_inflight=2), target)
    client = Client()
    for i in range(300):
        core.submit(client.job(f"r{i}", user_id=f"u{i}"))
        if i == 150:
            core.apply(config(shares={1: 0, 2: 100}, max_inflight=3))
    client.wait()
    assert all(client.error(n) is None for n in client.answers)
    assert target.calls.count(2) > 100 and target.calls.count(1) > 0


def test_stop_answers_queued_and_running_requests(run_core):
    core = run_core(config(max_inflight=1), FakeTarget(service_s=0.05))
    client = Client()
    for i in range(10):
        core.submit(client.job(f"r{i}"))
    time.sleep(0.01)
    core.stop()
    assert len(client.answers) == 10, "every request is answered when stop returns"
    client.wait(1)
    reasons = Counter(client.error(n).reason if client.error(n) else "ok" for n in client.answers)
    assert reasons == {"shutdown": 9, "ok": 1}
    late = Client()
    core.submit(late.job("late"))
    late.wait(1)
    assert late.error("late").reason == "shutdown"


def test_stop_answers_a_hung_call(run_core):
    release = threading.Event()
    target = FakeTarget(behaviour={1: lambda payload: release.wait(10)})
    core = run_core(config(max_inflight=1, inline_max_ms=0), target)
    client = Client()
    core.submit(client.job("hung"))
    assert eventually(lambda: target.running == 1)
    start = time.monotonic()
    core.stop(timeout_s=0.2)
    assert time.monotonic() - start < 1.0
    client.wait(1)
    assert client.error("hung").reason == "shutdown"
    release.set()


@pytest.mark.parametrize("garbage", [b"- 1\n- 2\n", b"42\n", b"{1: 2, version: 3}\n", b"\xff\xfe not text",
                                     b"tiers: {gold: {weight: .inf, deadline_ms: 1}}\ndefault_tier: gold\n"])
def test_routing_file_garbage_is_ignored_and_the_next_valid_file_applies(run_core, tmp_path, garbage):
    path = tmp_path / "routing.yaml"
    config(shares={1: 100}).save(path)
    target = FakeTarget(service_s=0.001)
    core = run_core(ConfigWatcher(path, {1, 2}), target)
    client = Client()
    core.submit(client.job("before"))
    client.wait()
    path.write_bytes(garbage)
    time.sleep(0.2)  # several polls of the bad file
    core.submit(client.job("still-v1"))
    client.wait()
    config(shares={2: 100}, version=7).save(path)
    assert eventually(lambda: core.config.version == 7)
    core.submit(client.job("after"))
    client.wait()
    assert target.calls == [1, 1, 2]


def test_fast_path_only_when_idle_and_target_fast_and_never_overtakes_the_queue(run_core):
    target = FakeTarget(service_s=0.01)
    core = run_core(config(max_inflight=1), target)
    ticket = core.try_inline("gold", None, "inline-1")
    assert (ticket.tier, ticket.version) == ("gold", 1)
    assert core.try_inline("diamond", None, "inline-2") is None, "the only slot is taken"
    client = Client()
    core.submit(client.job("queued", tier="standard"))
    time.sleep(0.1)
    assert client.answers == {} and target.calls == []
    assert core.try_inline("diamond", None, "inline-3") is None, "a request is queued"
    outputs = core.run_inline(ticket, {"x": np.array([4.0], np.float32)})
    assert outputs["y"][0] == 8.0
    client.wait()
    assert client.error("queued") is None and target.calls == [1, 1]
    assert core.try_inline("platinum", None, "x") is None, "unknown tiers take the queued path (which explains)"


def test_fast_path_closes_for_a_slow_target_and_when_turned_off(run_core):
    target = FakeTarget(service_s=0.05)
    core = run_core(config(inline_max_ms=5), target)
    ticket = core.try_inline("standard", None, "r")
    core.run_inline(ticket, {"x": np.array([1.0], np.float32)})  # one 50 ms call: average 10 ms
    assert core.target_ms > 5 and core.try_inline("standard", None, "r") is None
    target.service_s = 0.0
    client = Client()
    for i in range(20):  # queued calls keep the estimate current, so the path reopens
        core.submit(client.job(f"r{i}"))
    client.wait()
    ticket = core.try_inline("standard", None, "r")
    assert ticket.tier == "standard"
    core.run_inline(ticket, {"x": np.array([1.0], np.float32)})
    core.apply(config(inline_max_ms=0))
    assert core.try_inline("standard", None, "r") is None


def test_fast_path_times_out_a_hanging_target_and_closes(run_core):
    release = threading.Event()
    target = FakeTarget(behaviour={1: lambda payload: release.wait(10)})
    tiers = {"standard": TierPolicy(weight=1, deadline_ms=1000, timeout_ms=80)}
    core = run_core(config(tiers=tiers, max_inflight=2), target)
    ticket = core.try_inline("standard", None, "r")
    start = time.monotonic()
    with pytest.raises(UnavailableError, match="did not answer within 80 ms") as info:
        core.run_inline(ticket, {"x": np.array([1.0], np.float32)})
    assert info.value.reason == "target_timeout" and time.monotonic() - start < 0.5
    assert core.try_inline("standard", None, "r2") is None, "the fast path closes"
    assert core.scheduler.inflight == 1, "the hung call keeps its slot"
    release.set()
    assert eventually(lambda: core.scheduler.inflight == 0)


def test_fast_path_shadow_runs_after_the_answer_and_errors_count(run_core):
    def broken(payload):
        raise RuntimeError("primary exploded")
    target = FakeTarget(service_s=0.001, behaviour={3: broken})
    metrics = Recorder()
    core = run_core(config(shares={1: 100}, shadow=ShadowPolicy(version=2, percent=100, max_inflight=5)),
                    target, metrics)
    ticket = core.try_inline("diamond", "alice", None)
    assert ticket.shadow
    outputs = core.run_inline(ticket, {"x": np.array([3.0], np.float32)})
    assert outputs["y"][0] == 6.0
    assert eventually(lambda: metrics.count("shadow", 2, "agree") == 1)
    assert target.calls == [1, 2]
    core.apply(config(shares={3: 100}, shadow=ShadowPolicy(version=2, percent=100, max_inflight=5)))
    failed = core.try_inline("diamond", "bob", None)
    with pytest.raises(DsparkError, match="target 'target' version 3 failed: primary exploded"):
        core.run_inline(failed, {"x": np.array([3.0], np.float32)})
    assert eventually(lambda: metrics.count("rejection", "diamond", "target_error") == 1)
    assert target.calls == [1, 2, 3], "no shadow for a failed primary"
    assert core.scheduler.inflight == 0
    assert eventually(lambda: metrics.count("request", "diamond", 1) == 1 and metrics.count("request", "diamond", 3) == 1)
    assert eventually(lambda: sum(e[1] for e in metrics.events if e[0] == "fast_path") == 2)


def test_lanes_start_on_demand(run_core):
    """A large max_inflight costs no threads until calls need them."""
    before = threading.active_count()
    core = run_core(config(max_inflight=256, inline_max_ms=0), FakeTarget(service_s=0.05))
    client = Client()
    for i in range(6):
        core.submit(client.job(f"r{i}"))
    client.wait()
    assert threading.active_count() - before < 20


def test_a_higher_limit_applied_with_requests_queued_wakes_one_lane_per_request_and_lanes_end_later(run_core):
    release = threading.Event()
    target = FakeTarget(behaviour={1: lambda payload: release.wait(10) and {"y": payload["x"] * 2}})
    before = threading.active_count()
    core = run_core(config(max_inflight=1, inline_max_ms=0), target)
    core.IDLE_LANE_S = 0.1
    client = Client()
    for i in range(12):
        core.submit(client.job(f"r{i}"))
    assert eventually(lambda: target.running == 1)
    core.apply(config(max_inflight=256, inline_max_ms=0))
    assert eventually(lambda: target.running == 12)
    assert threading.active_count() - before < 25, "a lane per queued request, not one per slot"
    release.set()
    client.wait()
    assert all(client.error(n) is None for n in client.answers)
    core.apply(config(max_inflight=1, inline_max_ms=0))
    assert eventually(lambda: threading.active_count() - before < 8), "idle lanes above the limit end"
