"""Tier scheduler with a fake clock: weights, fluctuation factor, deadlines, starvation freedom."""

from collections import Counter
from dataclasses import replace

import pytest

from dspark.routing.config import MAX_INFLIGHT, FluctuationPolicy, RoutingConfig, TierPolicy
from dspark.errors import RequestError, UnavailableError
from dspark.routing.scheduler import FluctuationMeter, TierScheduler


def make_config(**kw) -> RoutingConfig:
    tiers = kw.pop("tiers", {
        "diamond": TierPolicy(weight=8, deadline_ms=1000, max_queue=10_000),
        "gold": TierPolicy(weight=3, deadline_ms=1000, max_queue=10_000),
        "standard": TierPolicy(weight=1, deadline_ms=1000, max_queue=10_000),
    })
    return RoutingConfig(tiers=tiers, max_inflight=kw.pop("max_inflight", MAX_INFLIGHT), **kw).validate()


def steady_meter(policy: FluctuationPolicy, qps: float, seconds: float, start: float = 0.0) -> float:
    meter = FluctuationMeter(policy, start)
    t = start
    while t < start + seconds:
        meter.record(t)
        t += 1.0 / qps
    return meter, t


def test_fluctuation_factor_is_zero_for_steady_traffic():
    meter, t = steady_meter(FluctuationPolicy(window_s=10, short_window_s=1), qps=50, seconds=20)
    assert abs(meter.factor(t)) < 0.05


def test_fluctuation_factor_matches_definition_for_a_burst():
    policy = FluctuationPolicy(window_s=10, short_window_s=1, min=-0.5, max=5.0)
    meter, t = steady_meter(policy, qps=10, seconds=9)
    for i in range(40):  # then 40 arrivals within one second: short-window rate 40 qps
        meter.record(t + i / 40)
    now = t + 39 / 40 + 1e-6
    short, long = meter.qps(now)
    assert short == 40 and long == pytest.approx(130 / 10, abs=0.2)
    assert meter.factor(now) == pytest.approx((short - long) / long)
    assert meter.factor(now) > 2


def test_fluctuation_factor_is_clamped():
    policy = FluctuationPolicy(window_s=10, short_window_s=1, min=-0.5, max=1.0)
    meter, t = steady_meter(policy, qps=10, seconds=9)
    for i in range(500):
        meter.record(t + i / 1000)
    assert meter.factor(t + 0.5) == 1.0
    # traffic stops: short rate 0, long rate positive -> f = -1 before the clamp
    assert meter.factor(t + 2.0) == -0.5


def test_fluctuation_factor_without_traffic_is_zero():
    meter = FluctuationMeter(FluctuationPolicy(), 0.0)
    assert meter.factor(100.0) == 0.0


def test_weighted_round_robin_follows_base_weights():
    sched = TierScheduler(make_config(), now=0.0)
    for i in range(1200):
        for tier in ("diamond", "gold", "standard"):
            sched.submit(i, tier, now=0.0)
    picks = Counter()
    for _ in range(1200):
        picks[sched.pop_next(now=0.0).tier] += 1
        sched.release()
    # all tiers surge equally, so f is the same for all and shares follow 8:3:1
    assert picks["diamond"] == pytest.approx(1200 * 8 / 12, abs=2)
    assert picks["gold"] == pytest.approx(1200 * 3 / 12, abs=2)
    assert picks["standard"] == pytest.approx(1200 * 1 / 12, abs=2)


def test_weights_include_fluctuation_factor():
    config = make_config(fluctuation=FluctuationPolicy(window_s=10, short_window_s=1, min=-0.5, max=1.0))
    sched = TierScheduler(config, now=0.0)
    t = 0.0
    while t < 9.0:  # steady 10 qps of standard and diamond
        sched.submit(0, "standard", now=t)
        sched.submit(0, "diamond", now=t)
        t += 0.1
    for i in range(200):  # a standard burst; diamond stays at 10 qps
        sched.submit(0, "standard", now=t + i / 400)
        if i % 40 == 0:
            sched.submit(0, "diamond", now=t + i / 400)
    now = t + 0.5
    weights = sched.weights(now)
    w_std, f_std = weights["standard"]
    w_dia, f_dia = weights["diamond"]
    assert f_std == 1.0 and w_std == pytest.approx(1 * (1 + 1.0))
    assert f_dia == pytest.approx(0, abs=0.2) and w_dia == pytest.approx(8 * (1 + f_dia))


def test_diamond_is_never_starved_by_a_standard_flood():
    sched = TierScheduler(make_config(), now=0.0)
    for i in range(5000):
        sched.submit(("s", i), "standard", now=0.0)
    # one diamond request arrives while standard floods: it is served within ceil(W/w_d)+1 picks
    served_before_diamond = []
    sched.submit(("d", 0), "diamond", now=0.0)
    while True:
        p = sched.pop_next(now=0.0)
        sched.release()
        if p.tier == "diamond":
            break
        served_before_diamond.append(p)
    assert len(served_before_diamond) <= 2
    # a steady diamond stream under a standard flood keeps at least its share 8/9
    for i in range(900):
        sched.submit(("d", i), "diamond", now=0.0)
    picks = Counter()
    for _ in range(900):
        picks[sched.pop_next(now=0.0).tier] += 1
        sched.release()
    assert picks["diamond"] >= 900 * 8 / 9 - 2
    # and standard is not starved either
    assert picks["standard"] >= 900 / 9 - 2


def test_bounded_concurrency():
    sched = TierScheduler(make_config(max_inflight=2), now=0.0)
    for i in range(5):
        sched.submit(i, "gold", now=0.0)
    assert [sched.pop_next(0.0).item, sched.pop_next(0.0).item] == [0, 1]
    assert sched.pop_next(0.0) is None
    sched.release()
    assert sched.pop_next(0.0).item == 2
    assert sched.inflight == 2


def test_deadlines_expire_waiting_requests_only():
    config = make_config(tiers={
        "diamond": TierPolicy(weight=8, deadline_ms=100),
        "standard": TierPolicy(weight=1, deadline_ms=500),
    })
    sched = TierScheduler(config, now=0.0)
    sched.submit("d", "diamond", now=0.0)
    sched.submit("s", "standard", now=0.0)
    assert sched.next_deadline() == pytest.approx(0.1)
    assert sched.expire(now=0.099) == []
    expired = sched.expire(now=0.1)
    assert [p.item for p in expired] == ["d"]
    assert sched.next_deadline() == pytest.approx(0.5)
    assert [p.item for p in sched.expire(now=0.6)] == ["s"]
    assert sched.queued() == {"diamond": 0, "standard": 0}


def test_queue_full_and_unknown_tier():
    config = make_config(tiers={"standard": TierPolicy(weight=1, deadline_ms=100, max_queue=2)})
    sched = TierScheduler(config, now=0.0)
    sched.submit(1, "standard", 0.0)
    sched.submit(2, "standard", 0.0)
    with pytest.raises(UnavailableError, match="'standard' queue is full") as full:
        sched.submit(3, "standard", 0.0)
    assert full.value.reason == "queue_full" and full.value.code == "UNAVAILABLE"
    with pytest.raises(RequestError, match="parameter 'tier': unknown tier 'platinum'") as unknown:
        sched.resolve_tier("platinum")
    assert unknown.value.code == "INVALID_ARG"
    assert sched.resolve_tier(None) == "standard"


def test_reconfigure_keeps_queued_requests():
    sched = TierScheduler(make_config(), now=0.0)
    for i in range(10):
        sched.submit(i, "standard", 0.0)
    new = make_config(tiers={
        "diamond": TierPolicy(weight=1, deadline_ms=1000),
        "gold": TierPolicy(weight=1, deadline_ms=1000),
    }, default_tier="gold")
    sched.reconfigure(new)
    # the removed tier drains; nothing is lost
    items = []
    while (p := sched.pop_next(0.0)) is not None:
        items.append(p.item)
        sched.release()
    assert items == list(range(10))
    with pytest.raises(RequestError):
        sched.resolve_tier("standard")


def test_try_admit_takes_a_slot_only_when_nothing_is_queued():
    cfg = RoutingConfig(max_inflight=2, top_tier_headroom=0).validate()
    s = TierScheduler(cfg, 0.0)
    assert s.try_admit("standard", 0.0) and s.inflight == 1
    s.submit("queued", "gold", 0.1)
    assert not s.try_admit("diamond", 0.1), "would overtake the queued gold request"
    assert s.pop_next(0.2).item == "queued"
    assert not s.try_admit("diamond", 0.2), "both slots taken"
    s.release()
    assert s.try_admit("diamond", 0.3)


def test_headroom_is_for_the_top_tier_only():
    cfg = RoutingConfig(max_inflight="auto", top_tier_headroom=1).validate()
    s = TierScheduler(cfg, 0.0, target_instances=2)
    assert (s.limit, s.headroom, s.top) == (2, 1, "diamond")
    for i in range(5):
        s.submit(("s", i), "standard", 0.0)
        s.submit(("g", i), "gold", 0.0)
    assert {s.pop_next(0.0).tier for _ in range(2)} <= {"gold", "standard"}
    assert s.pop_next(0.0) is None, "lower tiers use the target's 2 instances, not the headroom"
    assert not s.try_admit("gold", 0.0)
    s.submit(("d", 0), "diamond", 0.1)
    assert s.pop_next(0.1).item == ("d", 0), "the top tier gets the third slot at once"
    assert s.pop_next(0.1) is None and s.inflight == 3
    s.release()  # one call done: 2 in flight, lower tiers may not refill beyond the limit
    assert s.pop_next(0.2) is None
    s.release()
    assert s.pop_next(0.3).item[0] in ("s", "g") and s.inflight == 2


def test_max_inflight_auto_follows_the_target_instances():
    cfg = RoutingConfig(top_tier_headroom=0).validate()
    assert TierScheduler(cfg, 0.0, target_instances=6).limit == 6
    assert TierScheduler(cfg, 0.0, target_instances=None).limit == 1
    assert TierScheduler(replace(cfg, max_inflight=3), 0.0, target_instances=6).limit == 3
