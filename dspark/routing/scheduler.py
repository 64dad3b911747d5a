"""Tier scheduler: per-tier FIFO queues, smooth weighted round-robin, deadlines, bounded concurrency.

Pure and clock-free: every method takes ``now`` (seconds, monotonic), so tests drive it with a
fake clock. The threaded runtime (``runtime.py``) calls it under its one lock.

Weights follow the seed's formula: ``weight = base × (1 + f)``, where ``f`` is the tier's QPS
fluctuation factor (``FluctuationMeter``), clamped to ``[fluctuation.min, fluctuation.max]``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from dspark.errors import RequestError, UnavailableError
from dspark.routing.config import FluctuationPolicy, RoutingConfig, TierPolicy

T = TypeVar("T")


class RateWindow:
    """Arrivals in the last ``span_s`` seconds (a deque of timestamps, O(1) amortized)."""

    def __init__(self, span_s: float):
        self.span_s = span_s
        self._times: deque[float] = deque()

    def add(self, now: float) -> None:
        self._times.append(now)
        self._prune(now)

    def count(self, now: float) -> int:
        self._prune(now)
        return len(self._times)

    def _prune(self, now: float) -> None:
        horizon = now - self.span_s
        times = self._times
        while times and times[0] <= horizon:
            times.popleft()


class FluctuationMeter:
    """The QPS fluctuation factor f of one tier.

    ``qps_short`` = arrivals in the last ``short_window_s`` / ``short_window_s``;
    ``qps_long`` = arrivals in the last ``window_s`` / ``min(window_s, time since start)``
    (never less than ``short_window_s``);
    ``f = clamp((qps_short - qps_long) / max(qps_long, min_qps), min, max)``.

    f > 0 when the tier's traffic surges above its recent average, f < 0 when it falls off,
    0 for steady (or no) traffic.
    """

    def __init__(self, policy: FluctuationPolicy, start: float):
        self.policy = policy
        self.start = start
        self._short = RateWindow(policy.short_window_s)
        self._long = RateWindow(policy.window_s)

    def reconfigure(self, policy: FluctuationPolicy) -> None:
        self.policy = policy
        self._short.span_s = policy.short_window_s
        self._long.span_s = policy.window_s

    def record(self, now: float) -> None:
        self._short.add(now)
        self._long.add(now)

    def qps(self, now: float) -> tuple[float, float]:
        p = self.policy
        long_span = max(p.short_window_s, min(p.window_s, now - self.start))
        return self._short.count(now) / p.short_window_s, self._long.count(now) / long_span

    def factor(self, now: float) -> float:
        p = self.policy
        qps_short, qps_long = self.qps(now)
        raw = (qps_short - qps_long) / max(qps_long, p.min_qps)
        return min(p.max, max(p.min, raw))


@dataclass
class Pending(Generic[T]):
    item: T
    tier: str
    enqueued_at: float
    deadline_at: float


@dataclass
class _Tier:
    policy: TierPolicy
    meter: FluctuationMeter
    queue: deque = field(default_factory=deque)
    current: float = 0.0  # smooth-WRR running credit

    def weight(self, now: float) -> tuple[float, float]:
        """(effective weight = base x (1 + f), f)."""
        f = self.meter.factor(now)
        return self.policy.weight * (1.0 + f), f


class TierScheduler(Generic[T]):
    """Picks which queued request goes to the target next.

    Concurrency: any tier may have a call dispatched while fewer than ``limit + early`` calls
    are in flight (``max_inflight``, "auto" = ``target_instances``; ``early``, set by the
    runtime, counts running calls expected to end within the hand-off lead, whose instance would
    otherwise wait for the router); the top tier (highest base weight) also while fewer than
    ``limit + early + headroom``. So the target's instances are kept busy by whatever is queued,
    and a top-tier request finds a free slot (and at most the calls already running ahead of it
    at the target) instead of waiting behind lower-tier calls that Triton has queued for it.
    """

    def __init__(self, config: RoutingConfig, now: float, target_instances: int | None = None):
        self.config = config
        self.target_instances = target_instances
        self.inflight = 0
        self.early = 0  # extra calls any tier may send now (running calls about to end)
        self._tiers: dict[str, _Tier] = {}
        self._start = now
        self.reconfigure(config)

    def reconfigure(self, config: RoutingConfig) -> None:
        """Apply new weights/deadlines/limits; queued requests keep their place and deadline.

        A tier missing from the new config keeps draining its queue with the smallest weight.
        """
        self.config = config
        self.limit = config.slots(self.target_instances)
        self.top = config.top_tier
        self.headroom = config.top_tier_headroom
        self.most_inflight = 2 * self.limit + self.headroom  # with every running call about to end
        for name, policy in config.tiers.items():
            if name in self._tiers:
                self._tiers[name].policy = policy
                self._tiers[name].meter.reconfigure(config.fluctuation)
            else:
                self._tiers[name] = _Tier(policy, FluctuationMeter(config.fluctuation, self._start))
        floor = min(t.weight for t in config.tiers.values())
        for name, tier in self._tiers.items():
            if name not in config.tiers:
                tier.policy = TierPolicy(weight=floor, deadline_ms=tier.policy.deadline_ms, max_queue=0)

    def resolve_tier(self, tier: str | None) -> str:
        """The request's tier (the default tier when it names none); RequestError if unknown."""
        if tier is None or tier == "":
            return self.config.default_tier
        if tier not in self.config.tiers:
            raise RequestError("parameter 'tier'",
                               f"unknown tier '{tier}'; expected one of {', '.join(self.config.tiers)}")
        return tier

    def submit(self, item: T, tier: str, now: float) -> Pending[T]:
        """Queue a request; UnavailableError (reason queue_full) if its tier's queue is full."""
        state = self._tiers[tier]
        state.meter.record(now)
        if len(state.queue) >= state.policy.max_queue:
            raise UnavailableError(f"tier '{tier}' queue is full ({len(state.queue)} waiting, "
                                   f"max_queue {state.policy.max_queue})", reason="queue_full")
        pending = Pending(item, tier, now, now + state.policy.deadline_ms / 1000.0)
        state.queue.append(pending)
        return pending

    def expire(self, now: float) -> list[Pending[T]]:
        """Remove and return requests whose queue deadline has passed."""
        expired = []
        for state in self._tiers.values():
            q = state.queue
            while q and q[0].deadline_at <= now:
                expired.append(q.popleft())
        return expired

    def next_deadline(self) -> float | None:
        heads = [s.queue[0].deadline_at for s in self._tiers.values() if s.queue]
        return min(heads) if heads else None

    def weights(self, now: float) -> dict[str, tuple[float, float]]:
        """Per tier: (effective weight = base × (1 + f), f)."""
        return {name: state.weight(now) for name, state in self._tiers.items()}

    def may_dispatch(self, tier: str) -> bool:
        """Whether a call of ``tier`` fits in the concurrency limits now."""
        shared = self.limit + self.early
        return self.inflight < (shared + self.headroom if tier == self.top else shared)

    def dispatchable(self) -> int:
        """How many queued requests the limits let go out now (at most: beyond ``limit + early``
        only the top tier's): the lanes worth waking."""
        free = self.limit + self.early + self.headroom - self.inflight
        return max(0, min(free, sum(len(s.queue) for s in self._tiers.values())))

    def pop_next(self, now: float) -> Pending[T] | None:
        """Next request by smooth weighted round-robin over non-empty tiers, if a slot is free
        (beyond ``limit + early`` only the top tier's)."""
        shared = self.limit + self.early
        if self.inflight >= shared + self.headroom:
            return None
        if self.inflight >= shared:
            top = self._tiers.get(self.top)
            eligible = [(self.top, top)] if top is not None and top.queue else []
        else:
            eligible = [(name, s) for name, s in self._tiers.items() if s.queue]
        if not eligible:
            return None
        total = 0.0
        best: _Tier | None = None
        for name, state in eligible:
            w, _ = state.weight(now)
            state.current += w
            total += w
            if best is None or state.current > best.current:
                best = state
        assert best is not None
        best.current -= total
        pending = best.queue.popleft()
        if not best.queue:
            best.current = 0.0  # an emptied tier restarts without banked credit or debt
        self.inflight += 1
        return pending

    def try_admit(self, tier: str, now: float) -> bool:
        """Take a slot for a request that goes to the target at once, bypassing the queues.

        Only when that overtakes no one: nothing queued in any tier and a slot free. Counts the
        arrival for the fluctuation factor like ``submit``; the caller ``release``s the slot.
        """
        if not self.may_dispatch(tier) or self.has_queued():
            return False
        self._tiers[tier].meter.record(now)
        self.inflight += 1
        return True

    def release(self) -> None:
        """A dispatched request finished (answer or error); frees its concurrency slot."""
        self.inflight -= 1

    def has_queued(self) -> bool:
        return any(s.queue for s in self._tiers.values())

    def queued(self) -> dict[str, int]:
        return {name: len(s.queue) for name, s in self._tiers.items()}

    def drain(self) -> list[Pending[Any]]:
        """Remove everything queued (used at shutdown so each request gets an answer)."""
        out = []
        for state in self._tiers.values():
            out.extend(state.queue)
            state.queue.clear()
        return out
