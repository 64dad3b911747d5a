"""The router's runtime: admits requests, schedules them by tier, calls the target, shadows.

Threads, no event loop (a thread hop costs ~0.05-0.2 ms in a Python backend stub):

- ``submit`` runs on the caller's thread (the Triton ``execute``): it resolves the tier, picks
  the version and queues the request, then wakes a lane.
- **lanes** (one per concurrency slot): a lane pops the next request by tier, calls the target
  (blocking), and answers. When more work is queued it takes the next request at once and hands
  its answer to the **sender** thread, so the target never waits for a response to be sent.
- the **clock** thread answers requests whose queue deadline passed and calls that overran
  their tier's timeout (the call keeps its slot until it returns: a hung target cannot be
  oversubscribed), wakes a lane when a running call comes within the hand-off lead of its
  expected end (the next call then waits in the target's queue instead of arriving after the
  router's hand-off), re-reads the routing file and exports counters every ``poll_interval_s``.
- the **fast path**: when nothing is queued, a slot is free and the target recently answered
  within ``inline_max_ms``, the caller (``execute``) runs the call on a pool thread and waits
  for it with the tier's timeout (``run_inline``), then returns the answer itself: no response
  sender, which costs ~0.3-0.5 ms per request in the Python backend.

Every request is answered exactly once through its job's ``respond(outputs, error)``: the
target's outputs, or a ``dspark.errors`` error (RequestError: unknown tier; UnavailableError:
queue full, deadline, target timeout, shutdown; CancelledError; DsparkError: target failed).
Nothing here imports pb_utils: the target is an object with ``call``/``detach``/``arrays``.

Why one module of ~600 lines: the queues, the calls in flight, the lanes, the clock and the fast
path read and change one state under one lock; split, each part would reach into the others'.
What needs none of that state lives beside it: which request goes next (scheduler.py), the
version split (graying.py), shadow calls (shadow.py) and the metric hooks (metrics.py).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Protocol

import numpy as np

from dspark._ext import probes
from dspark.errors import CancelledError, DsparkError, RequestError, UnavailableError
from dspark.routing.clock import Clock
from dspark.routing.config import ConfigWatcher, RoutingConfig
from dspark.routing.graying import VersionSplitter, routing_key, shadow_sampled
from dspark.routing.metrics import DeferredMetrics, RouterMetrics, StageTimes
from dspark.routing.scheduler import Pending, TierScheduler
from dspark.routing.shadow import Shadower

log = logging.getLogger("dspark.routing")
_EWMA_ALPHA = 0.2  # weight of the newest target latency in the fast path's estimate
TARGET_FAILURES = ("target_error", "target_timeout")  # rejection reasons that count against a target version


class Target(Protocol):
    """What the router calls. ``call`` blocks and returns the outputs (opaque to the core) or
    raises; ``detach`` copies a payload so it outlives the client's request (shadow calls run
    after the answer); ``arrays`` gives outputs as numpy arrays by name (shadow comparison)."""

    def call(self, payload: Any, version: int, timeout_s: float) -> Any: ...
    def detach(self, payload: Any) -> Any: ...
    def arrays(self, outputs: Any) -> Mapping[str, np.ndarray]: ...


@dataclass(eq=False)
class Job:
    payload: Any
    respond: Callable[[Any, Optional[DsparkError]], None]
    tier: str | None = None
    user_id: str | None = None
    request_id: str | None = None
    is_cancelled: Callable[[], bool] | None = None  # the client went away (checked before dispatch)
    submitted_at: float = 0.0
    answered: bool = False  # under RouterCore._lock


@dataclass(eq=False)
class _Routed:
    job: Job
    version: int
    shadow: bool
    timeout_s: float
    fallback: int | None  # the routing's fallback_version when the request arrived


@dataclass(eq=False)
class _Call:
    """A target call in flight, watched for its timeout."""

    job: Job
    tier: str
    version: int
    timeout_s: float
    done: bool = False


@dataclass
class Inline:
    """A request admitted to the fast path: the caller runs it with ``run_inline``."""

    tier: str
    version: int
    shadow: bool
    timeout_s: float
    started: float
    fallback: int | None = None


class RouterCore:
    """One router: its queues, version split and shadow, served by lane threads.

    ``IDLE_LANE_S``: an idle lane looks at the queues at least this often (a safety net; lanes
    are woken when work arrives); a lane idle that long ends while more lanes than
    ``max_inflight`` remain.

    ``target_instances`` (from the target's config) sizes ``max_inflight: auto``.
    """

    IDLE_LANE_S = 1.0

    def __init__(
        self,
        config: RoutingConfig | ConfigWatcher,
        target: Target,
        metrics: RouterMetrics | None = None,
        clock: Clock | None = None,
        poll_interval_s: float = 0.5,
        name: str = "router",
        target_name: str = "target",
        target_instances: int | None = None,
        stage_times: StageTimes | None = None,
    ):
        self.watcher = config if isinstance(config, ConfigWatcher) else None
        self.config = self.watcher.config if self.watcher else config
        self.target = target
        self.metrics = DeferredMetrics(metrics or RouterMetrics())
        self.clock = clock or Clock()  # the time and every wait (tests pass a ManualClock)
        self.poll_interval_s = poll_interval_s
        self.name = name
        self.target_name = target_name
        self.stages = stage_times
        self.scheduler: TierScheduler[_Routed] = TierScheduler(self.config, self.clock(), target_instances)
        self.splitter = VersionSplitter(self.config.shares)
        self.target_ms = 0.0  # EWMA of primary target call latency; gates the fast path
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # lanes wait here for queued requests
        self._wake_clock = threading.Condition(self._lock)
        self._clock_due = float("inf")  # when the clock thread wakes next
        self._calls: list[tuple[float, int, _Call]] = []  # heap of (timeout at, seq, call)
        self._running: dict[int, tuple[float, int]] = {}  # primary calls at the target: seq -> (start, version)
        self._completed = 0  # primary calls that returned
        self._version_s: dict[int, float] = {}  # EWMA of each version's call latency (the hand-off lead)
        self._seq = itertools.count()
        self._counts: Counter[tuple[str, int]] = Counter()  # dispatches, exported per tick
        self._rejections: Counter[tuple[str, str]] = Counter()  # (tier, reason), exported per tick
        self._target_errors: Counter[int] = Counter()  # version -> failed or timed-out calls, per tick
        self._fast_path = 0
        self._stopping = False  # no new work; queued requests answered
        self._stopped = False  # threads exit
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # answers the sender thread sends
        self._threads: list[threading.Thread] = []
        self._lanes = 0  # lane threads started (on demand, at most scheduler.most_inflight)
        self._idle_lanes = 0
        self._wakeups = 0  # lanes _wake_lanes took off the idle count that have not woken yet
        self._inline_pool = ThreadPoolExecutor(thread_name_prefix=f"{name}-inline")
        self.shadower = Shadower(target, self.metrics, name, self.clock)

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        for target, label in ((self._clock_loop, "clock"), (self._sender_loop, "sender")):
            self._spawn(target, label)
        self.metrics.config_version(self.config.version)

    def _spawn(self, target: Callable[[], None], label: str) -> None:
        thread = threading.Thread(target=target, name=f"{self.name}-{label}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _wake_lanes(self, count: int = 1) -> None:
        """Under the lock: wake idle lanes for ``count`` dispatches, starting lanes where none is
        idle (at most one per slot: a lane stuck in a hung call keeps its slot, so that is enough)."""
        for _ in range(count):
            if self._idle_lanes > 0:
                self._idle_lanes -= 1
                self._wakeups += 1
                self._work.notify()
            elif self._lanes < self.scheduler.most_inflight and not self._stopping:
                self._lanes += 1
                threading.Thread(target=self._lane_loop, name=f"{self.name}-lane{self._lanes}", daemon=True).start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Answer queued requests (shutdown), let calls in flight finish for up to ``timeout_s``,
        answer the rest (shutdown), stop the threads. Every request is answered when this returns."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            drained = self.scheduler.drain()
            self._work.notify_all()
        for pending in drained:
            self._reject(pending.item.job, pending.tier, self._shutdown_error(), "shutdown")
        deadline = self.clock() + timeout_s
        with self._lock:
            while self.scheduler.inflight > 0 and self.clock() < deadline:
                self.clock.wait(self._work, deadline - self.clock())
            hung = [call for _, _, call in self._calls if not call.done]
            self._stopped = True
            self._work.notify_all()
            self._wake_clock.notify_all()
        for call in hung:
            self._reject(call.job, call.tier, self._shutdown_error(), "shutdown")
        self._outbox.put(None)
        for thread in self._threads:
            thread.join(timeout_s)
        self._export_counts()
        self.metrics.close()
        self._inline_pool.shutdown(wait=False)
        self.shadower.stop()

    def _shutdown_error(self) -> UnavailableError:
        return UnavailableError(f"router '{self.name}' is shutting down", reason="shutdown")

    def apply(self, config: RoutingConfig) -> None:
        """Apply a new config (thread-safe); queued and in-flight requests are unaffected."""
        with self._lock:
            self.config = config
            self.scheduler.reconfigure(config)
            self.splitter = VersionSplitter(config.shares)
            self._wake_lanes(self.scheduler.dispatchable())
        self.metrics.config_version(config.version)
        log.info("%s: routing config version %d applied (shares %s, shadow %s %.3g%%, %d calls in flight "
                 "+ %d for %s)", self.name, config.version, dict(config.shares), config.shadow.version,
                 config.shadow.percent, self.scheduler.limit, config.top_tier_headroom, self.scheduler.top)

    # --- the queued path ---------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue a request (thread-safe, returns at once); its answer comes from another thread,
        or at once for an unknown tier, a full queue or a router that is shutting down."""
        now = self.clock()
        job.submitted_at = now
        error, label, tier = None, "", "unknown"  # a metric label: never the client's own string
        with self._lock:
            try:
                if self._stopping:
                    raise self._shutdown_error()
                tier = self.scheduler.resolve_tier(job.tier)
                policy = self.config.tiers[tier]
                routed = _Routed(job, *self._route(job.user_id, job.request_id), policy.call_timeout_s,
                                 self.config.fallback_version)
                pending = self.scheduler.submit(routed, tier, now)
            except RequestError as exc:
                error, label = exc, "unknown_tier"
            except UnavailableError as exc:
                error, label = exc, exc.reason
            else:
                self._refresh_early(now)
                due = pending.deadline_at
                if self.scheduler.may_dispatch(tier):
                    self._wake_lanes()
                else:  # the clock sends it early when a running call is about to end
                    due = min(due, self._next_early(now) or due)
                if due < self._clock_due:
                    self._wake_clock.notify()
        if error is not None:
            if label == "queue_full":
                error = UnavailableError(f"router '{self.name}': {error}", label)
            self._reject(job, tier, error, label)

    def _route(self, user_id: str | None, request_id: str | None) -> tuple[int, bool]:
        """Under the lock: the request's version and whether the shadow copies it. The routing
        key (a hash, or a random id) is made only where a split or a shadow needs it."""
        shadow = self.config.shadow
        shadowed = shadow.version is not None and shadow.percent > 0
        if self.splitter.only is not None and not shadowed:
            return self.splitter.only, False
        key = routing_key(user_id, request_id)
        return self.splitter.version_for(key), shadowed and shadow_sampled(key, shadow.percent)

    def _lane_loop(self) -> None:
        pending, previous_end = None, None
        while True:
            if pending is None:
                with self._lock:
                    idle, idle_until = False, None
                    while (pending := None if self._stopped else self._pop(self.clock())) is None:
                        if self._stopped:
                            return
                        if idle and self._lanes > self.scheduler.limit:
                            self._lanes -= 1  # left over from a burst or a higher limit: end the thread
                            return
                        if idle or idle_until is None:  # a new idle period (not after a wake to look at the time)
                            idle_until = self.clock() + self.IDLE_LANE_S
                        self._idle_lanes += 1
                        self.clock.wait(self._work, max(0.0, idle_until - self.clock()))
                        if self._wakeups > 0:  # woken for work (_wake_lanes took a lane off the idle count)
                            self._wakeups -= 1
                            idle, idle_until = False, None
                        else:  # timed out, or woken to look at the time or to stop
                            self._idle_lanes -= 1
                            idle = self.clock() >= idle_until
                previous_end = None
            try:
                pending, previous_end = self._serve(pending, previous_end)
            except Exception:  # a bug here must not lose the lane (the request is answered by then)
                log.exception("%s: lane failed", self.name)
                pending = None

    def _serve(self, pending: Pending[_Routed], previous_end: float | None) -> tuple[Pending[_Routed] | None, float]:
        """Call the target for one request and answer it; returns the next request this lane
        took (its slot is taken) or None, and when this call ended. ``previous_end``: when the
        lane's previous call ended, if this request followed it at once."""
        routed, tier = pending.item, pending.tier
        job = routed.job
        started = self.clock()
        waited = started - pending.enqueued_at
        self.metrics.queue_time(tier, waited)
        probes.route(self.name, tier, "queued", routed.version, waited)
        if self.stages is not None and previous_end is None:
            self.stages.add("queued: submit to lane", started - job.submitted_at)
        outputs, error, label, version = None, None, "", routed.version
        if job.is_cancelled is not None and 1000 * waited >= self.config.cancel_check_ms and self._client_gone(job):
            error, label = CancelledError(f"router '{self.name}': the client cancelled the request after "
                                          f"{1000 * waited:.0f} ms in the '{tier}' queue; not sent to the target"), "cancelled"
        else:
            call = _Call(job, tier, routed.version, routed.timeout_s)
            with self._lock:
                self._counts[(tier, routed.version)] += 1
                heapq.heappush(self._calls, (started + routed.timeout_s, next(self._seq), call))
                if started + routed.timeout_s < self._clock_due:
                    self._wake_clock.notify()
            if self.stages is not None and previous_end is not None:
                self.stages.add("lane: a call's end to its next call", self.clock() - previous_end)
            outputs, error, version = self._call_or_fall_back(job.payload, routed.version, routed.timeout_s,
                                                              routed.fallback)
            label = "target_error"
            call.done = True
        finished = self.clock()
        with self._lock:
            self.scheduler.release()
            following = None if self._stopping else self._pop(finished)
            if self._stopping:
                self._work.notify_all()  # stop() waits for the calls in flight
        shadow = (self.shadower.copies(job.payload, outputs)
                  if routed.shadow and error is None and not job.answered else None)
        if following is not None:
            self._outbox.put((job, tier, version, outputs, error, label))
        else:
            self._answer(job, tier, version, outputs, error, label)
        if shadow is not None:
            self.shadower.send(self.config.shadow, *shadow)
        return following, finished

    def _pop(self, now: float) -> Pending[_Routed] | None:
        self._refresh_early(now)
        return self.scheduler.pop_next(now)

    def _ends_within_lead(self, now: float) -> list[float]:
        """Under the lock: for each running call, when it comes within the hand-off lead of its
        expected end (its start plus its version's average latency, less the lead)."""
        lead = self.config.handoff_lead_ms / 1000
        if lead <= 0:
            return []
        return [start + self._version_s[version] - lead for start, version in self._running.values()
                if version in self._version_s]

    def _refresh_early(self, now: float) -> None:
        """Under the lock: how many running calls are about to end, i.e. within the lead of their
        expected latency and not later than that by more than the lead (a slow or hung call
        frees nothing): the scheduler may send that many further calls, which reach the target's
        queue as its instances free up."""
        lead = self.config.handoff_lead_ms / 1000
        self.scheduler.early = sum(at <= now <= at + 2 * lead for at in self._ends_within_lead(now))

    def _next_early(self, now: float) -> float | None:
        """Under the lock: when the next running call comes within the hand-off lead of its
        expected end (None when nothing is queued: then nothing would go out early)."""
        if not self.scheduler.has_queued():
            return None
        return min((at for at in self._ends_within_lead(now) if at > now), default=None)

    def _client_gone(self, job: Job) -> bool:
        try:
            return bool(job.is_cancelled())
        except Exception:
            return False

    def _call(self, payload: Any, version: int, timeout_s: float) -> tuple[Any, DsparkError | None]:
        """A primary call, timed for the fast path's estimate and the hand-off lead; failures
        become DsparkErrors."""
        start = self.clock()
        seq = next(self._seq)
        with self._lock:
            self._running[seq] = (start, version)
        try:
            outputs = self.target.call(payload, version, timeout_s)
        except DsparkError as exc:
            return None, exc
        except Exception as exc:
            return None, DsparkError(f"target '{self.target_name}' version {version} failed: {exc}")
        finally:
            elapsed = self.clock() - start
            with self._lock:
                # the first call sets an estimate; later ones move it by _EWMA_ALPHA
                self.target_ms += (_EWMA_ALPHA if self._completed else 1.0) * (1000 * elapsed - self.target_ms)
                known = self._version_s.get(version, elapsed)
                self._version_s[version] = known + _EWMA_ALPHA * (elapsed - known)
                del self._running[seq]
                self._completed += 1
            if self.stages is not None:
                self.stages.add("target call", elapsed)
        return outputs, None

    def _call_or_fall_back(self, payload: Any, version: int, timeout_s: float,
                           fallback: int | None) -> tuple[Any, DsparkError | None, int]:
        """A primary call; when it fails and the routing named a ``fallback_version`` when the
        request arrived (a rollout's current version during its canary steps: a rollback that
        clears it does not strand the canary's calls in flight), the request goes once more to
        that version within the time it has left. The failure still counts against its version
        (``dspark_router_target_errors_total``; a client saw it only where ``rejections_total``
        counts it too). Returns the outputs or the error, and the version that gave them."""
        start = self.clock()
        outputs, error = self._call(payload, version, timeout_s)
        left = timeout_s - (self.clock() - start)
        if error is None or fallback is None or fallback == version or left <= 0:
            return outputs, error, version
        with self._lock:
            self._target_errors[version] += 1
        outputs, error = self._call(payload, fallback, left)
        return outputs, error, fallback

    def _answer(self, job: Job, tier: str, version: int, outputs: Any, error: DsparkError | None,
                label: str) -> None:
        start = self.clock()
        if error is not None:
            self._reject(job, tier, error, label, version)
        elif self._respond(job, outputs, None):
            self.metrics.latency(tier, version, self.clock() - job.submitted_at)
        if self.stages is not None:
            self.stages.add("answer (response sender)", self.clock() - start)

    def _reject(self, job: Job, tier: str, error: DsparkError, label: str, version: int | None = None) -> bool:
        if self._respond(job, None, error):
            self._count_rejection(tier, label, version)
            return True
        return False

    def _count_rejection(self, tier: str, reason: str, version: int | None = None) -> None:
        """Counted here, exported once per tick (_export_counts). A failed or timed-out target
        call also counts against its version: Triton counts a Python model's error responses as
        successes, so this is the per-version error rate a rollout reads."""
        with self._lock:
            self._rejections[(tier, reason)] += 1
            if version is not None and reason in TARGET_FAILURES:
                self._target_errors[version] += 1

    def _respond(self, job: Job, outputs: Any, error: DsparkError | None) -> bool:
        """Answer a job unless it was answered already (a timed-out call that returned later)."""
        with self._lock:
            if job.answered:
                return False
            job.answered = True
        try:
            job.respond(outputs, error)
        except Exception:  # a broken client connection must not stop the router
            log.exception("%s: sending a response failed", self.name)
        return True

    def _sender_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            try:
                self._answer(*item)
            except Exception:
                log.exception("%s: sender failed", self.name)

    # --- the clock: deadlines, call timeouts, routing file, counters ----------------------

    def _clock_loop(self) -> None:
        next_tick = self.clock()
        while True:
            with self._lock:
                if self._stopped:
                    return
                now = self.clock()
                expired = self.scheduler.expire(now)
                overdue = self._overdue(now)
                early = self.scheduler.early
                self._refresh_early(now)
                if self.scheduler.early > early and self.scheduler.has_queued():
                    self._wake_lanes(self.scheduler.early - early)  # calls about to end: send the next ones
                if not expired and not overdue and now < next_tick:
                    heads = [t for t in (self.scheduler.next_deadline(), self._calls[0][0] if self._calls else None,
                                         self._next_early(now)) if t is not None]
                    self._clock_due = min([next_tick, *heads])
                    self.clock.wait(self._wake_clock, max(0.0, self._clock_due - now))
                    self._clock_due = float("-inf")  # awake: no need to be woken
                    continue
            try:
                for pending in expired:
                    self._expire(pending, now)
                for call in overdue:
                    self._time_out(call)
                if now >= next_tick:
                    if now - next_tick > 1.0:
                        log.warning("%s: the router's clock ran %.1f s late (CPU starved?)", self.name, now - next_tick)
                    next_tick = now + self.poll_interval_s
                    self._tick()
            except Exception:  # the clock must outlive any bug: deadlines depend on it
                log.exception("%s: clock tick failed", self.name)

    def _overdue(self, now: float) -> list[_Call]:
        overdue = []
        while self._calls and (self._calls[0][2].done or self._calls[0][0] <= now):
            _, _, call = heapq.heappop(self._calls)
            if not call.done:
                overdue.append(call)
        return overdue

    def _expire(self, pending: Pending[_Routed], now: float) -> None:
        deadline_ms = (pending.deadline_at - pending.enqueued_at) * 1000
        waited_ms = (now - pending.enqueued_at) * 1000
        self._outbox.put((pending.item.job, pending.tier, pending.item.version, None, UnavailableError(
            f"router '{self.name}': request waited {waited_ms:.0f} ms in the '{pending.tier}' queue, "
            f"past the tier's queue deadline of {deadline_ms:.0f} ms", reason="deadline"), "deadline"))

    def _time_out(self, call: _Call) -> None:
        """A call overran its tier's timeout: answer the client now; the call keeps its slot
        until the target returns, and the fast path closes."""
        self.target_ms = max(self.target_ms, 1000 * call.timeout_s)
        self._outbox.put((call.job, call.tier, call.version, None,
                          self._timeout_error(call.tier, call.version, call.timeout_s), "target_timeout"))

    def _timeout_error(self, tier: str, version: int, timeout_s: float) -> UnavailableError:
        return UnavailableError(
            f"router '{self.name}': target '{self.target_name}' version {version} did not answer within "
            f"{1000 * timeout_s:.0f} ms (the '{tier}' tier's timeout)", reason="target_timeout")

    def _tick(self) -> None:
        if self.watcher is not None:
            new = self.watcher.poll()
            if new is not None:
                self.apply(new)
            elif self.watcher.last_error:
                log.error("%s: routing file rejected, keeping version %d: %s",
                          self.name, self.config.version, self.watcher.last_error)
                self.watcher.last_error = None
        with self._lock:
            weights = self.scheduler.weights(self.clock())
        for tier, (weight, factor) in weights.items():
            self.metrics.weights(tier, weight, factor)
        self._export_counts()
        if self.stages is not None:
            self.stages.dump()

    def _export_counts(self) -> None:
        """Counters reach the metrics once per tick: each metric update is an IPC round trip that
        would otherwise compete with the next request."""
        with self._lock:
            counts, self._counts = self._counts, Counter()
            rejections, self._rejections = self._rejections, Counter()
            target_errors, self._target_errors = self._target_errors, Counter()
            fast, self._fast_path = self._fast_path, 0
        for (tier, version), n in counts.items():
            self.metrics.request(tier, version, n)
        for (tier, reason), n in rejections.items():
            self.metrics.rejection(tier, reason, n)
        for version, n in target_errors.items():
            self.metrics.target_error(version, n)
        if fast:
            self.metrics.fast_path(fast)

    # --- the fast path -----------------------------------------------------------------

    def try_inline(self, tier: str | None, user_id: str | None, request_id: str | None) -> Inline | None:
        """Admit a request to the fast path, or None (then ``submit`` it).

        Admitted only when that cannot overtake or delay anyone much: nothing queued, a slot
        free, and the target's recent latency at most ``inline_max_ms`` (the caller waits for
        the call, and requests arriving meanwhile wait in Triton's queue in front of the router).
        """
        config = self.config
        if self._stopping or config.inline_max_ms <= 0 or self.target_ms > config.inline_max_ms:
            return None
        now = self.clock()
        with self._lock:
            try:
                tier = self.scheduler.resolve_tier(tier)
            except RequestError:
                return None  # the queued path answers it with the error
            self._refresh_early(now)
            if not self.scheduler.try_admit(tier, now):
                return None
            version, shadow = self._route(user_id, request_id)
            self._counts[(tier, version)] += 1
            self._fast_path += 1
            timeout_s = self.config.tiers[tier].call_timeout_s
        probes.route(self.name, tier, "inline", version, 0.0)
        return Inline(tier, version, shadow, timeout_s, now, self.config.fallback_version)

    def run_inline(self, ticket: Inline, payload: Any) -> Any:
        """Call the target for a fast-path ticket on a pool thread and wait for it up to the
        tier's timeout; returns the outputs or raises a DsparkError (UnavailableError on
        timeout: the caller answers at once, the call keeps its slot until it returns)."""
        future = self._inline_pool.submit(self._inline_call, ticket, payload)
        try:
            outputs, error, version = self.clock.result(future, ticket.timeout_s)
        except FutureTimeout:
            self.target_ms = max(self.target_ms, 1000 * ticket.timeout_s)
            self._count_rejection(ticket.tier, "target_timeout", ticket.version)
            raise self._timeout_error(ticket.tier, ticket.version, ticket.timeout_s) from None
        if error is not None:
            self._count_rejection(ticket.tier, "target_error", version)
            raise error
        self.metrics.latency(ticket.tier, version, self.clock() - ticket.started)
        if ticket.shadow:
            self.shadower.send(self.config.shadow, *self.shadower.copies(payload, outputs))
        return outputs

    def _inline_call(self, ticket: Inline, payload: Any) -> tuple[Any, DsparkError | None, int]:
        if self.stages is not None:
            self.stages.add("fast path: execute to pool thread", self.clock() - ticket.started)
        try:
            return self._call_or_fall_back(payload, ticket.version, ticket.timeout_s, ticket.fallback)
        finally:
            with self._lock:
                self.scheduler.release()
                if self._stopping:
                    self._work.notify_all()
                elif self.scheduler.has_queued():
                    self._wake_lanes()
