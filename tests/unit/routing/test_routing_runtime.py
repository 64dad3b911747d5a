"""RouterCore end to end with a fake target (no server), on a ManualClock: the time a request
waits or a call takes is set by the test (``clock.advance``), never slept through, so no assertion
depends on how fast this machine is. Threads still run for real; ``eventually`` polls for what
they do next."""

import itertools
import re
import threading
import time
from collections import Counter

import numpy as np
import pytest

from dspark.errors import CancelledError, DsparkError, RequestError, UnavailableError
from dspark.routing.clock import ManualClock
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
    """y = 2x. A call waits for ``gate`` (an Event) when one is given, then takes ``service_s``
    of ``clock`` (a test advances it) or moves ``clock`` on by ``takes_s`` itself (one call at a
    time); ``behaviour[version](payload)`` replaces all that for a version."""

    def __init__(self, clock=None, service_s=0.0, behaviour=None, gate=None, takes_s=0.0):
        self.clock = clock
        self.service_s = service_s
        self.takes_s = takes_s
        self.behaviour = behaviour or {}
        self.gate = gate
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
            if self.gate is not None:
                self.gate.wait(10)
            if self.service_s:
                self.clock.sleep(self.service_s)
            if self.takes_s:
                self.clock.advance(self.takes_s)
            return {"y": payload["x"] * 2}
        finally:
            with self.lock:
                self.running -= 1

    def detach(self, payload):
        return {name: np.array(a, copy=True) for name, a in payload.items()}

    def arrays(self, outputs):
        return outputs


class Client:
    """Records every answer, in order and at ``clock``'s time; ``wait`` fails unless each job got
    exactly one (and the ``run_core`` fixture checks that again once its routers stopped)."""

    made = []
    _order = itertools.count()

    def __init__(self, clock=None):
        self.answers = {}
        self.expected = []
        self.clock = clock or time.monotonic
        self.lock = threading.Lock()
        Client.made.append(self)

    def job(self, name, tier=None, user_id=None, x=1.0, cancelled=None):
        def respond(outputs, error):
            with self.lock:
                self.answers.setdefault(name, []).append((outputs, error, next(self._order), self.clock()))
        self.expected.append(name)
        return Job(payload={"x": np.array([x], np.float32)}, respond=respond, tier=tier,
                   user_id=user_id, request_id=name, is_cancelled=cancelled)

    def wait(self, timeout=10):
        assert eventually(lambda: len(self.answers) == len(self.expected), timeout), \
            f"never answered: {sorted(set(self.expected) - set(self.answers))}"
        self.check_once()

    def check_once(self):
        twice = {name: len(a) for name, a in self.answers.items() if len(a) != 1}
        assert not twice, f"answered more than once: {twice}"

    def outputs(self, name):
        return self.answers[name][0][0]

    def error(self, name):
        return self.answers[name][0][1]

    def order(self):
        return sorted(self.answers, key=lambda name: self.answers[name][0][2])

    def finished(self, name):
        """The clock's time when ``name`` was answered."""
        return self.answers[name][0][3]


_NEVER = threading.Event()


def eventually(condition, timeout=5.0):
    """Poll for what other threads do next (their answers, metrics flushed in the background)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        _NEVER.wait(0.002)
    return True


def ticked(clock, condition):
    """``condition`` once the router's clock has ticked (counters exported, routing file read):
    moves ``clock`` one poll interval (0.05 s) at a time until it holds."""
    def check():
        if condition():
            return True
        clock.advance(0.05)
        return False
    return eventually(check)


def settle(clock, core, busy=0):
    """Wait until the router's clock thread and every lane but ``busy`` (held in a call that
    does not wait on the clock) wait on ``clock`` again: what the last ``advance`` asked is done."""
    assert eventually(lambda: clock.waiters() >= 1 + core._lanes - busy), (clock.waiters(), core._lanes)


def run_for(clock, core, seconds, step=0.01):
    for _ in range(round(seconds / step)):
        settle(clock, core)
        clock.advance(step)
    settle(clock, core)


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
def clock():
    return ManualClock()


@pytest.fixture
def run_core(clock):
    cores = []
    Client.made = []

    def make(cfg, target, metrics=None, **kw):
        if target.clock is None:
            target.clock = clock
        core = RouterCore(cfg, target, metrics or Recorder(), poll_interval_s=0.05, clock=clock, **kw)
        core.start()
        cores.append(core)
        return core
    yield make
    for core in cores:
        stopper = threading.Thread(target=core.stop, kwargs={"timeout_s": 2})
        stopper.start()
        assert eventually(lambda: (stopper.is_alive() and clock.advance(0.1)) or not stopper.is_alive())
    for client in Client.made:
        client.check_once()  # a late second answer would be here by now


def test_answers_every_request_once_with_its_outputs(run_core):
    gate = threading.Event()
    target = FakeTarget(gate=gate)
    core = run_core(config(max_inflight=4), target)
    client = Client()
    for i in range(40):
        core.submit(client.job(f"r{i}", tier="gold", x=float(i)))
    assert eventually(lambda: target.running == 4), "max_inflight calls run at once"
    gate.set()
    client.wait()
    for i in range(40):
        assert client.error(f"r{i}") is None and client.outputs(f"r{i}")["y"][0] == 2.0 * i
    assert target.most_running == 4, "no more than max_inflight"


def test_client_wait_fails_on_a_double_answer():
    client = Client()
    job = client.job("r")
    job.respond({"y": 1}, None)
    job.respond({"y": 1}, None)
    with pytest.raises(AssertionError, match="answered more than once"):
        client.wait(timeout=1)
    Client.made.remove(client)


def test_diamond_overtakes_a_standard_backlog(run_core):
    gate = threading.Event()
    target = FakeTarget(gate=gate)
    core = run_core(config(max_inflight=1), target)
    client = Client()
    for i in range(40):
        core.submit(client.job(f"s{i}", tier="standard"))
    assert eventually(lambda: target.running == 1)
    core.submit(client.job("d", tier="diamond"))
    gate.set()
    client.wait()
    assert client.order().index("d") <= 2  # served next or nearly, not after 40 standard


def test_top_tier_headroom_dispatches_diamond_past_a_full_target(run_core):
    """max_inflight auto = the target's 2 instances, +1 only diamond may use: with both
    instances busy with standard calls a diamond request goes out at once."""
    gate = threading.Event()
    target = FakeTarget(gate=gate)
    core = run_core(config(max_inflight="auto", top_tier_headroom=1), target, target_instances=2)
    client = Client()
    for i in range(6):
        core.submit(client.job(f"s{i}", tier="standard"))
    assert eventually(lambda: target.running == 2)
    with core._lock:
        assert core.scheduler.inflight == 2 and not core.scheduler.may_dispatch("standard"), \
            "standard keeps exactly the target's instances busy"
    core.submit(client.job("d", tier="diamond"))
    assert eventually(lambda: target.running == 3), "diamond is dispatched while the others still run"
    assert "d" not in client.answers
    gate.set()
    client.wait()
    assert target.most_running == 3


def test_the_next_call_goes_out_just_before_a_running_call_ends(run_core, clock):
    """max_inflight 1 and a 30 ms hand-off lead: once the router knows the target takes 100 ms,
    each next call is sent 70 ms into the running one (never earlier, never more than one)."""
    target = FakeTarget(clock, service_s=0.1)
    core = run_core(config(max_inflight=1, handoff_lead_ms=30, inline_max_ms=0), target)
    client = Client(clock)
    core.submit(client.job("warm-up"))
    run_for(clock, core, 0.12)
    client.wait()
    starts = []
    original = target.call

    def timed(payload, version, timeout_s):
        starts.append(clock())
        return original(payload, version, timeout_s)
    target.call = timed
    for i in range(4):
        core.submit(client.job(f"r{i}"))
    run_for(clock, core, 0.5)
    client.wait()
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(gaps) == 3 and all(0.065 < gap < 0.085 for gap in gaps), gaps  # 70 ms: before the call ends
    assert target.most_running == 2


def test_deadline_and_queue_full_give_explained_errors(run_core, clock):
    tiers = {"standard": TierPolicy(weight=1, deadline_ms=80, max_queue=5)}
    metrics = Recorder()
    target = FakeTarget(clock, service_s=0.05)
    core = run_core(config(tiers=tiers, max_inflight=1, inline_max_ms=0), target, metrics)
    client = Client(clock)
    core.submit(client.job("r0"))
    assert eventually(lambda: target.running == 1)
    for i in range(1, 8):
        core.submit(client.job(f"r{i}"))
    run_for(clock, core, 0.2)
    client.wait()
    errors = {n: client.error(n) for n in client.answers if client.error(n) is not None}
    # 1 in flight + 5 queued, 2 turned away; r1 starts at 50 ms, the other 4 wait past 80 ms
    assert {n: e.reason for n, e in errors.items()} == {
        "r2": "deadline", "r3": "deadline", "r4": "deadline", "r5": "deadline", "r6": "queue_full", "r7": "queue_full"}
    for e in errors.values():
        assert isinstance(e, UnavailableError) and e.code == "UNAVAILABLE"
        if e.reason == "deadline":
            # the clock moves in 10 ms steps: the request is expired at the first step past 80 ms
            assert re.search(r"waited (80|90) ms in the 'standard' queue, past the tier's queue deadline of 80 ms$", str(e))
        else:
            assert "router 'router': tier 'standard' queue is full (5 waiting, max_queue 5)" == str(e)
    assert ticked(clock, lambda: metrics.count("rejection", "standard", "deadline") == 4)
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


def test_a_failing_version_is_answered_by_the_fallback_and_still_counted_against_it(run_core, clock):
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
    assert ticked(clock, lambda: metrics.count("target_error", 2) == failed)
    assert metrics.count("rejection") == 0

    release = threading.Event()

    def held_then_broken(payload):
        release.wait(10)
        raise RuntimeError("version 2 exploded")
    target.behaviour[2] = held_then_broken
    core.apply(config(shares={2: 100}, fallback_version=1, max_inflight=2))
    client = Client()
    core.submit(client.job("in-flight", x=5.0))
    assert eventually(lambda: target.calls[-1] == 2 and target.running == 1)
    core.apply(config(shares={1: 100}, max_inflight=2))  # a rollback: the fallback is cleared
    release.set()
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


def test_fast_path_falls_back_too(run_core, clock):
    def broken(payload):
        raise RuntimeError("version 2 exploded")
    metrics = Recorder()
    target = FakeTarget(behaviour={2: broken})
    core = run_core(config(shares={2: 100}, fallback_version=1), target, metrics)
    ticket = core.try_inline("gold", None, "r")
    assert core.run_inline(ticket, {"x": np.array([3.0], np.float32)})["y"][0] == 6.0
    assert target.calls == [2, 1]
    assert ticked(clock, lambda: metrics.count("target_error", 2) == 1) and metrics.count("rejection") == 0


def test_a_hanging_target_times_out_with_unavailable_and_keeps_its_slot(run_core, clock):
    release = threading.Event()

    def hang(payload):
        release.wait(10)
        return {"y": payload["x"] * 2}
    tiers = {"gold": TierPolicy(weight=3, deadline_ms=150, timeout_ms=100),
             "standard": TierPolicy(weight=1, deadline_ms=150)}
    metrics = Recorder()
    target = FakeTarget(behaviour={1: hang})
    core = run_core(config(tiers=tiers, max_inflight=1, inline_max_ms=0), target, metrics)
    client = Client(clock)
    start = clock()
    core.submit(client.job("hung", tier="gold"))
    core.submit(client.job("queued", tier="standard"))
    assert eventually(lambda: target.running == 1)
    for _ in range(20):
        settle(clock, core, busy=1)
        clock.advance(0.01)
    client.wait()
    hung, queued = client.error("hung"), client.error("queued")
    assert isinstance(hung, UnavailableError) and hung.reason == "target_timeout"
    assert str(hung) == ("router 'router': target 'target' version 1 did not answer within 100 ms "
                         "(the 'gold' tier's timeout)")
    assert 0.1 <= client.finished("hung") - start < 0.115, "answered at the first step past the timeout"
    # the hung call still holds the only slot: the queued request is not sent, it expires
    assert queued.reason == "deadline" and target.calls == [1]
    release.set()
    assert eventually(lambda: core.scheduler.inflight == 0)
    assert ticked(clock, lambda: metrics.count("rejection", "gold", "target_timeout") == 1)
    client.check_once()  # the late answer of the hung call is dropped (the fixture checks again)


def test_cancelled_requests_are_not_sent_to_the_target(run_core, clock):
    gate = threading.Event()
    target = FakeTarget(gate=gate)
    metrics = Recorder()
    core = run_core(config(max_inflight=1, cancel_check_ms=0), target, metrics)
    client = Client()
    gone = threading.Event()
    core.submit(client.job("first"))
    assert eventually(lambda: target.running == 1)
    core.submit(client.job("left", cancelled=gone.is_set))
    core.submit(client.job("stayed", cancelled=lambda: False))
    gone.set()
    gate.set()
    client.wait()
    error = client.error("left")
    assert isinstance(error, CancelledError) and error.code == "CANCELLED"
    assert "not sent to the target" in str(error)
    assert client.error("stayed") is None and len(target.calls) == 2
    assert ticked(clock, lambda: metrics.count("rejection", "standard", "cancelled") == 1)


def test_shadow_that_hangs_or_fails_never_delays_the_primary(run_core, clock):
    held = threading.Event()

    def hang(payload):
        held.wait(10)
        return {"y": payload["x"] * 2}

    def broken(payload):
        raise RuntimeError("shadow exploded")

    try:
        for behaviour, outcome in ((hang, None), (broken, "error")):
            target = FakeTarget(behaviour={2: behaviour})
            metrics = Recorder()
            shadow = ShadowPolicy(version=2, percent=100, max_inflight=100)
            core = run_core(config(shares={1: 100}, shadow=shadow, max_inflight=4), target, metrics)
            client = Client()
            for i in range(20):
                core.submit(client.job(f"r{i}"))
            client.wait()  # while the shadow calls hang: they do not hold the answers
            assert all(client.error(n) is None for n in client.answers)
            if outcome:
                assert ticked(clock, lambda: metrics.count("shadow", 2, "error") == 20)
            else:  # 8 shadow threads: they all run, the rest wait for a thread, none was skipped
                assert eventually(lambda: target.calls.count(2) == 8)
                assert metrics.count("shadow", 2, "skipped") == 0
    finally:
        held.set()


def test_shadow_comparison_counts_disagreements(run_core, clock):
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
    target = FakeTarget()
    core = run_core(config(shares={1: 100}, max_inflight=2), target)
    client = Client()
    for i in range(300):
        core.submit(client.job(f"r{i}", user_id=f"u{i}"))
        if i == 150:
            core.apply(config(shares={1: 0, 2: 100}, max_inflight=3))
    client.wait()
    assert all(client.error(n) is None for n in client.answers)
    assert target.calls.count(2) > 100 and target.calls.count(1) > 0


def stop_in_background(core):
    stopper = threading.Thread(target=core.stop, kwargs={"timeout_s": 0.2})
    stopper.start()
    assert eventually(lambda: core._stopping)
    return stopper


def test_stop_answers_queued_and_running_requests(run_core):
    gate = threading.Event()
    target = FakeTarget(gate=gate)
    core = run_core(config(max_inflight=1), target)
    client = Client()
    for i in range(10):
        core.submit(client.job(f"r{i}"))
    assert eventually(lambda: target.running == 1)
    stopper = stop_in_background(core)
    assert eventually(lambda: len(client.answers) == 9), "the queued requests are answered at once"
    gate.set()  # the running call ends: stop waits for it
    stopper.join(5)
    assert not stopper.is_alive() and len(client.answers) == 10, "every request is answered when stop returns"
    client.wait(1)
    reasons = Counter(client.error(n).reason if client.error(n) else "ok" for n in client.answers)
    assert reasons == {"shutdown": 9, "ok": 1}
    late = Client()
    core.submit(late.job("late"))
    late.wait(1)
    assert late.error("late").reason == "shutdown"


def test_stop_answers_a_hung_call(run_core, clock):
    release = threading.Event()
    target = FakeTarget(behaviour={1: lambda payload: release.wait(10)})
    core = run_core(config(max_inflight=1, inline_max_ms=0), target)
    client = Client()
    core.submit(client.job("hung"))
    assert eventually(lambda: target.running == 1)
    stopper = stop_in_background(core)
    clock.advance(0.1)
    assert "hung" not in client.answers, "stop waits for the call up to its timeout"
    assert eventually(lambda: clock.advance(0.1) or not stopper.is_alive())
    client.wait(1)
    assert client.error("hung").reason == "shutdown"
    release.set()


@pytest.mark.parametrize("garbage", [b"- 1\n- 2\n", b"42\n", b"{1: 2, version: 3}\n", b"\xff\xfe not text",
                                     b"tiers: {gold: {weight: .inf, deadline_ms: 1}}\ndefault_tier: gold\n"])
def test_routing_file_garbage_is_ignored_and_the_next_valid_file_applies(run_core, clock, tmp_path, garbage):
    path = tmp_path / "routing.yaml"
    config(shares={1: 100}).save(path)
    target = FakeTarget()
    core = run_core(ConfigWatcher(path, {1, 2}), target)
    client = Client()
    core.submit(client.job("before"))
    client.wait()
    path.write_bytes(garbage)
    run_for(clock, core, 0.2, step=0.05)  # several polls of the bad file
    core.submit(client.job("still-v1"))
    client.wait()
    config(shares={2: 100}, version=7).save(path)
    assert ticked(clock, lambda: core.config.version == 7)
    core.submit(client.job("after"))
    client.wait()
    assert target.calls == [1, 1, 2]


def test_fast_path_only_when_idle_and_target_fast_and_never_overtakes_the_queue(run_core, clock):
    target = FakeTarget()
    core = run_core(config(max_inflight=1), target)
    ticket = core.try_inline("gold", None, "inline-1")
    assert (ticket.tier, ticket.version) == ("gold", 1)
    assert core.try_inline("diamond", None, "inline-2") is None, "the only slot is taken"
    client = Client()
    core.submit(client.job("queued", tier="standard"))
    run_for(clock, core, 0.1, step=0.05)
    assert client.answers == {} and target.calls == [], "the ticket holds the slot"
    assert core.try_inline("diamond", None, "inline-3") is None, "a request is queued"
    outputs = core.run_inline(ticket, {"x": np.array([4.0], np.float32)})
    assert outputs["y"][0] == 8.0
    client.wait()
    assert client.error("queued") is None and target.calls == [1, 1]
    assert core.try_inline("platinum", None, "x") is None, "unknown tiers take the queued path (which explains)"


def test_fast_path_closes_for_a_slow_target_and_when_turned_off(run_core, clock):
    target = FakeTarget(takes_s=0.05)
    core = run_core(config(inline_max_ms=5), target)
    ticket = core.try_inline("standard", None, "r")
    core.run_inline(ticket, {"x": np.array([1.0], np.float32)})  # one 50 ms call sets the estimate
    assert core.target_ms > 5 and core.try_inline("standard", None, "r") is None
    target.takes_s = 0.0
    client = Client()
    for i in range(20):  # queued calls keep the estimate current, so the path reopens
        core.submit(client.job(f"r{i}"))
    client.wait()
    ticket = core.try_inline("standard", None, "r")
    assert ticket.tier == "standard"
    core.run_inline(ticket, {"x": np.array([1.0], np.float32)})
    core.apply(config(inline_max_ms=0))
    assert core.try_inline("standard", None, "r") is None


def test_fast_path_times_out_a_hanging_target_and_closes(run_core, clock):
    release = threading.Event()
    target = FakeTarget(behaviour={1: lambda payload: release.wait(10)})
    tiers = {"standard": TierPolicy(weight=1, deadline_ms=1000, timeout_ms=80)}
    core = run_core(config(tiers=tiers, max_inflight=2), target)
    ticket = core.try_inline("standard", None, "r")
    start, raised = clock(), []

    def call():
        try:
            core.run_inline(ticket, {"x": np.array([1.0], np.float32)})
        except UnavailableError as exc:
            raised.append((exc, clock()))
    caller = threading.Thread(target=call)
    caller.start()
    assert eventually(lambda: target.running == 1)
    assert eventually(lambda: clock.advance(0.01) or not caller.is_alive())
    (error, at), = raised
    assert "did not answer within 80 ms" in str(error) and error.reason == "target_timeout"
    assert 0.08 <= at - start < 0.1, "raised at the first step past the timeout"
    assert core.try_inline("standard", None, "r2") is None, "the fast path closes"
    assert core.scheduler.inflight == 1, "the hung call keeps its slot"
    release.set()
    assert eventually(lambda: core.scheduler.inflight == 0)


def test_fast_path_shadow_runs_after_the_answer_and_errors_count(run_core, clock):
    def broken(payload):
        raise RuntimeError("primary exploded")
    target = FakeTarget(behaviour={3: broken})
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
    assert ticked(clock, lambda: metrics.count("rejection", "diamond", "target_error") == 1)
    assert target.calls == [1, 2, 3], "no shadow for a failed primary"
    assert core.scheduler.inflight == 0
    assert ticked(clock, lambda: metrics.count("request", "diamond", 1) == 1 and metrics.count("request", "diamond", 3) == 1)
    assert ticked(clock, lambda: sum(e[1] for e in metrics.events if e[0] == "fast_path") == 2)


def test_lanes_start_on_demand(run_core):
    """A large max_inflight costs no threads until calls need them."""
    before = threading.active_count()
    gate = threading.Event()
    target = FakeTarget(gate=gate)
    core = run_core(config(max_inflight=256, inline_max_ms=0), target)
    client = Client()
    for i in range(6):
        core.submit(client.job(f"r{i}"))
    assert eventually(lambda: target.running == 6)
    gate.set()
    client.wait()
    assert threading.active_count() - before < 20


def test_a_higher_limit_applied_with_requests_queued_wakes_one_lane_per_request_and_lanes_end_later(run_core, clock):
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
    assert ticked(clock, lambda: threading.active_count() - before < 8), "idle lanes above the limit end"
