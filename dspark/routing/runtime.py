"""The router's event loop: admits requests, schedules them by tier, calls the target, shadows.

``RouterCore`` runs an asyncio loop in a background thread. The Triton adapter (``execute``)
hands each request over with ``submit`` and returns at once; the loop answers every request
exactly once through the job's ``respond`` callback: the target's outputs, or a ``RouteError``
(queue deadline passed, queue full, unknown tier, target failure, shutdown). Nothing here
imports pb_utils: the target call and the answer are callables, so tests drive it directly.

Fast path: when nothing is queued, a slot is free and the target has recently answered within
``inline_max_ms``, ``try_inline`` lets the caller (``execute``) call the target on its own
thread and return the answer itself (``finish_inline``): no thread hop, no response sender.
The scheduler's state is shared with that thread under ``_lock``.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import queue
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

import numpy as np

from dspark.routing.config import ConfigWatcher, RoutingConfig, ShadowPolicy
from dspark.routing.graying import VersionSplitter, outputs_agree, routing_key, shadow_sampled
from dspark.routing.scheduler import Pending, QueueFull, TierScheduler, UnknownTier

Outputs = Mapping[str, np.ndarray]
log = logging.getLogger("dspark.routing")


class RouteError(Exception):
    """A request the router answers with an error. ``code`` is a Triton error code name,
    ``reason`` the metric label (deadline, queue_full, unknown_tier, target_error, shutdown)."""

    def __init__(self, message: str, code: str = "UNAVAILABLE", reason: str = "target_error"):
        super().__init__(message)
        self.code = code
        self.reason = reason


@dataclass
class Job:
    payload: Any
    respond: Callable[[Outputs | None, RouteError | None], None]
    tier: str | None = None
    user_id: str | None = None
    request_id: str | None = None
    arrived_at: float = field(default_factory=time.monotonic)


class RouterMetrics:
    """Metric hooks; the default records nothing. The Triton adapter maps them to MetricFamily."""

    def request(self, tier: str, version: int, count: int = 1) -> None: ...
    def rejection(self, tier: str, reason: str) -> None: ...
    def target_error(self, version: int) -> None: ...  # per version: what a rollout's analysis reads
    def queue_time(self, tier: str, seconds: float) -> None: ...
    def latency(self, tier: str, version: int, seconds: float) -> None: ...
    def shadow(self, version: int, outcome: str, seconds: float | None) -> None: ...
    def weights(self, tier: str, weight: float, factor: float) -> None: ...
    def config_version(self, version: int) -> None: ...
    def fast_path(self, count: int) -> None: ...


class _DeferredMetrics:
    """Hands metric calls to a background thread, off the request's path and off the event
    loop (each pb_utils metric update is a round trip to the Triton process)."""

    def __init__(self, target: RouterMetrics):
        self._target = target
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._drain, name="router-metrics", daemon=True)
        self._thread.start()

    def __getattr__(self, name: str):
        def record(*args):
            self._calls.put((name, args))
        return record

    def _drain(self) -> None:
        while (call := self._calls.get()) is not None:
            name, args = call
            try:
                getattr(self._target, name)(*args)
            except Exception:
                log.exception("metric update %s failed", name)

    def close(self, timeout_s: float = 5.0) -> None:
        self._calls.put(None)
        self._thread.join(timeout_s)


@dataclass
class _Routed:
    job: Job
    version: int
    key: str


@dataclass
class Inline:
    """A request admitted to the fast path: the caller calls the target version itself."""

    tier: str
    version: int
    key: str
    shadow: bool  # the caller must keep a copy of the inputs and outputs for the shadow call
    started: float


_EWMA_ALPHA = 0.2  # weight of the newest target latency in the fast path's estimate
_PRIMARY_CALL = contextvars.ContextVar("dspark_router_primary_call", default=True)


def is_primary_call() -> bool:
    """Inside ``call_target``: True for a client's request, False for a shadow copy (whose
    latency must not steer the fast path)."""
    return _PRIMARY_CALL.get()


class RouterCore:
    """One router: its queues, version split and shadow, driven by an event loop thread.

    ``call_target(payload, version)`` is awaited for each dispatched request (and for shadow
    copies) and returns the output tensors by name; with a ``ConfigWatcher`` the routing file is
    re-read every ``poll_interval_s``.
    """

    def __init__(
        self,
        config: RoutingConfig | ConfigWatcher,
        call_target: Callable[[Any, int], Awaitable[Outputs]],
        metrics: RouterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll_interval_s: float = 0.5,
        name: str = "router",
    ):
        self.watcher = config if isinstance(config, ConfigWatcher) else None
        self.config = self.watcher.config if self.watcher else config
        self.call_target = call_target
        self.loop = asyncio.new_event_loop()
        self.metrics = _DeferredMetrics(metrics or RouterMetrics())
        self.clock = clock
        self.poll_interval_s = poll_interval_s
        self.name = name
        self.scheduler: TierScheduler[_Routed] = TierScheduler(self.config, clock())
        self.splitter = VersionSplitter(self.config.shares)
        self.shadow_inflight = 0
        self._thread = threading.Thread(target=self._run, name=f"{name}-loop", daemon=True)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False
        self._shadow_logged_at = float("-inf")
        self._lock = threading.Lock()  # scheduler state, shared by the loop and the fast path
        self._handoffs = 0  # submitted requests the loop has not queued yet
        self.target_ms = 0.0  # EWMA of primary target call latency; gates the fast path
        self._inline_requests: Counter[tuple[str, int]] = Counter()  # exported per tick, not per request

    # --- called from other threads -----------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Hand a request to the router (thread-safe, returns at once)."""
        with self._lock:
            self._handoffs += 1
        self.loop.call_soon_threadsafe(self._accept, job)

    def try_inline(self, tier: str | None, user_id: str | None, request_id: str | None) -> Inline | None:
        """Admit a request to the fast path, or None (then ``submit`` it).

        Admitted only when that cannot overtake or delay anyone much: nothing queued or being
        handed over, a concurrency slot free, and the target's recent latency at most
        ``inline_max_ms`` (the caller blocks for the call, and requests arriving meanwhile wait
        in Triton's queue in front of the router). The caller must call ``finish_inline``.
        """
        config = self.config
        if self._stopping or config.inline_max_ms <= 0 or self.target_ms > config.inline_max_ms:
            return None
        now = self.clock()
        with self._lock:
            if self._handoffs:
                return None
            try:
                tier = self.scheduler.resolve_tier(tier)
            except UnknownTier:
                return None  # the loop answers it with the error
            if not self.scheduler.try_admit(tier, now):
                return None
        key = routing_key(user_id, request_id)
        version = self.splitter.version_for(key)
        shadow = config.shadow.version is not None and shadow_sampled(key, config.shadow.percent)
        with self._lock:
            self._inline_requests[(tier, version)] += 1
        return Inline(tier, version, key, shadow, now)

    def finish_inline(self, ticket: Inline, payload: Any = None, outputs: Outputs | None = None,
                      failed: bool = False) -> None:
        """The fast-path call is done (the caller answers the client): free the slot, record it,
        and start the shadow call if the ticket asked for one (``payload`` and ``outputs``)."""
        elapsed = self.clock() - ticket.started
        self.observe_target(elapsed)
        with self._lock:
            self.scheduler.release()
            waiting = self.scheduler.has_queued()
        if failed:
            self.metrics.rejection(ticket.tier, "target_error")
            self.metrics.target_error(ticket.version)
        else:
            self.metrics.latency(ticket.tier, ticket.version, elapsed)
        if waiting:
            self.loop.call_soon_threadsafe(self._pump)
        if ticket.shadow and not failed and payload is not None and outputs is not None:
            self.loop.call_soon_threadsafe(self._maybe_shadow, ticket.key, payload, outputs)

    def observe_target(self, seconds: float) -> None:
        """Report how long a target call took, thread hops excluded (the adapter times its
        blocking call); the fast path is open while the running average is <= inline_max_ms."""
        self.target_ms += _EWMA_ALPHA * (1000 * seconds - self.target_ms)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Answer queued requests with an error, let in-flight ones finish, stop the loop."""
        if not self._thread.is_alive():
            return
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(timeout_s), self.loop)
        try:
            fut.result(timeout_s + 1)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
            self.metrics.close()

    def apply(self, config: RoutingConfig) -> None:
        """Apply a new config (thread-safe); queued and in-flight requests are unaffected."""
        self.loop.call_soon_threadsafe(self._apply, config)

    # --- loop thread ---------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        # the adapter runs the blocking BLS call in the loop's default executor, whose
        # default size (cores + 4) would cap the calls in flight; threads start only when needed.
        self.loop.set_default_executor(ThreadPoolExecutor(max_workers=128, thread_name_prefix=f"{self.name}-bls"))
        self.loop.call_soon(self._apply, self.config)
        self.loop.call_soon(self._tick)
        self.loop.run_forever()

    def _apply(self, config: RoutingConfig) -> None:
        with self._lock:
            self.config = config
            self.scheduler.reconfigure(config)
        self.splitter = VersionSplitter(config.shares)
        self.metrics.config_version(config.version)
        log.info("%s: routing config version %d applied (shares %s, shadow %s %.3g%%)",
                 self.name, config.version, dict(config.shares), config.shadow.version, config.shadow.percent)
        self._pump()

    def _tick(self) -> None:
        if self._stopping:
            return
        if self.watcher is not None:
            new = self.watcher.poll()
            if new is not None:
                self._apply(new)
            elif self.watcher.last_error:
                log.error("%s: routing file rejected, keeping version %d: %s",
                          self.name, self.config.version, self.watcher.last_error)
                self.watcher.last_error = None
        with self._lock:
            weights = self.scheduler.weights(self.clock())
        for tier, (weight, factor) in weights.items():
            self.metrics.weights(tier, weight, factor)
        self._export_inline_counts()
        self._pump()
        self.loop.call_later(self.poll_interval_s, self._tick)

    def _export_inline_counts(self) -> None:
        """Fast-path requests reach the counters once per tick: each metric update is an IPC
        round trip that would otherwise compete with the next request (~0.1 ms each)."""
        with self._lock:
            counts, self._inline_requests = self._inline_requests, Counter()
        total = sum(counts.values())
        for (tier, version), n in counts.items():
            self.metrics.request(tier, version, n)
        if total:
            self.metrics.fast_path(total)

    def _accept(self, job: Job) -> None:
        error = None
        with self._lock:
            self._handoffs -= 1
            if self._stopping:
                error = RouteError(f"router '{self.name}' is shutting down", reason="shutdown")
            else:
                try:
                    tier = self.scheduler.resolve_tier(job.tier)
                except UnknownTier as exc:
                    self.metrics.rejection("unknown", "unknown_tier")  # not the client's string: bounded labels
                    error = RouteError(f"parameter 'tier': {exc}", "INVALID_ARG", "unknown_tier")
                else:
                    key = routing_key(job.user_id, job.request_id)
                    routed = _Routed(job, self.splitter.version_for(key), key)
                    try:
                        self.scheduler.submit(routed, tier, self.clock())
                    except QueueFull as exc:
                        self.metrics.rejection(tier, "queue_full")
                        error = RouteError(f"router '{self.name}': {exc}", reason="queue_full")
        if error is not None:
            self._reply(job, None, error)
            return
        self._pump()

    def _pump(self) -> None:
        now = self.clock()
        ready = []
        with self._lock:
            expired = self.scheduler.expire(now)
            while (pending := self.scheduler.pop_next(now)) is not None:
                ready.append(pending)
            due = self.scheduler.next_deadline()
        for pending in expired:
            self._expire(pending, now)
        for pending in ready:
            self._spawn(self._dispatch(pending, now))
        self._arm_timer(due)

    def _expire(self, pending: Pending[_Routed], now: float) -> None:
        tier = pending.tier
        deadline_ms = (pending.deadline_at - pending.enqueued_at) * 1000
        waited_ms = (now - pending.enqueued_at) * 1000
        self.metrics.rejection(tier, "deadline")
        self._reply(pending.item.job, None, RouteError(
            f"router '{self.name}': request waited {waited_ms:.0f} ms in the '{tier}' queue, "
            f"past the tier's queue deadline of {deadline_ms:.0f} ms", reason="deadline"))

    def _arm_timer(self, due: float | None) -> None:
        if due is None or (self._timer is not None and self._timer_at <= due):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = due
        self._timer = self.loop.call_later(max(0.0, due - self.clock()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self._pump()

    def _spawn(self, coro) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _dispatch(self, pending: Pending[_Routed], started: float) -> None:
        routed, tier = pending.item, pending.tier
        job = routed.job
        self.metrics.queue_time(tier, started - pending.enqueued_at)
        self.metrics.request(tier, routed.version)
        outputs: Outputs | None = None
        try:
            outputs = await self.call_target(job.payload, routed.version)
        except Exception as exc:  # the target's failure goes back to this client only
            self.metrics.rejection(tier, "target_error")
            self.metrics.target_error(routed.version)
            self._reply(job, None, RouteError(str(exc), "INTERNAL", "target_error"))
        else:
            self._reply(job, outputs, None)
            self.metrics.latency(tier, routed.version, self.clock() - job.arrived_at)
        finally:
            with self._lock:
                self.scheduler.release()
            self._pump()
        if outputs is not None:
            self._maybe_shadow(routed.key, job.payload, outputs)

    def _maybe_shadow(self, key: str, payload: Any, primary: Outputs) -> None:
        shadow = self.config.shadow
        if shadow.version is None or not shadow_sampled(key, shadow.percent):
            return
        if self.shadow_inflight >= shadow.max_inflight:
            self.metrics.shadow(shadow.version, "skipped", None)
            return
        self.shadow_inflight += 1
        self._spawn(self._shadow(payload, primary, shadow))

    async def _shadow(self, payload: Any, primary: Outputs, policy: ShadowPolicy) -> None:
        version = policy.version
        _PRIMARY_CALL.set(False)  # this task's own context
        start = self.clock()
        try:
            outputs = await self.call_target(payload, version)
        except Exception as exc:
            self.metrics.shadow(version, "error", self.clock() - start)
            self._log_shadow(logging.WARNING, "%s: shadow version %d failed: %s", self.name, version, exc)
            return
        finally:
            self.shadow_inflight -= 1
        agree, why = outputs_agree(primary, outputs, policy.atol, policy.rtol, policy.ignore_outputs)
        self.metrics.shadow(version, "agree" if agree else "disagree", self.clock() - start)
        if not agree:
            self._log_shadow(logging.INFO, "%s: shadow version %d disagrees: %s", self.name, version, why)

    def _log_shadow(self, level: int, message: str, *args: Any) -> None:
        """At most one shadow log line per second: the counts are in the metrics."""
        now = self.clock()
        if now - self._shadow_logged_at >= 1.0:
            self._shadow_logged_at = now
            log.log(level, message, *args)

    def _reply(self, job: Job, outputs: Outputs | None, error: RouteError | None) -> None:
        try:
            job.respond(outputs, error)
        except Exception:  # a broken client connection must not stop the loop
            log.exception("%s: sending a response failed", self.name)

    async def _shutdown(self, timeout_s: float) -> None:
        with self._lock:
            self._stopping = True
            drained = self.scheduler.drain()
        self._export_inline_counts()
        for pending in drained:
            self.metrics.rejection(pending.tier, "shutdown")
            self._reply(pending.item.job, None,
                        RouteError(f"router '{self.name}' is shutting down", reason="shutdown"))
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
