"""The router's event loop: admits requests, schedules them by tier, calls the target, shadows.

``RouterCore`` runs an asyncio loop in a background thread. The Triton adapter (``execute``)
hands each request over with ``submit`` and returns at once; the loop answers every request
exactly once through the job's ``respond`` callback: the target's outputs, or a ``RouteError``
(queue deadline passed, queue full, unknown tier, target failure, shutdown). Nothing here
imports pb_utils: the target call and the answer are callables, so tests drive it directly.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
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

    def request(self, tier: str, version: int) -> None: ...
    def rejection(self, tier: str, reason: str) -> None: ...
    def queue_time(self, tier: str, seconds: float) -> None: ...
    def latency(self, tier: str, version: int, seconds: float) -> None: ...
    def shadow(self, version: int, outcome: str, seconds: float | None) -> None: ...
    def weights(self, tier: str, weight: float, factor: float) -> None: ...
    def config_version(self, version: int) -> None: ...


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
    tier: str
    version: int
    key: str


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

    # --- called from other threads -----------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Hand a request to the router (thread-safe, returns at once)."""
        self.loop.call_soon_threadsafe(self._accept, job)

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
        # pb_utils' async_exec runs the blocking BLS call in the loop's default executor, whose
        # default size (cores + 4) would cap the calls in flight; threads start only when needed.
        self.loop.set_default_executor(ThreadPoolExecutor(max_workers=128, thread_name_prefix=f"{self.name}-bls"))
        self.loop.call_soon(self._apply, self.config)
        self.loop.call_soon(self._tick)
        self.loop.run_forever()

    def _apply(self, config: RoutingConfig) -> None:
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
        for tier, (weight, factor) in self.scheduler.weights(self.clock()).items():
            self.metrics.weights(tier, weight, factor)
        self._pump()
        self.loop.call_later(self.poll_interval_s, self._tick)

    def _accept(self, job: Job) -> None:
        if self._stopping:
            self._reply(job, None, RouteError(f"router '{self.name}' is shutting down", reason="shutdown"))
            return
        try:
            tier = self.scheduler.resolve_tier(job.tier)
        except UnknownTier as exc:
            self.metrics.rejection("unknown", "unknown_tier")  # not the client's string: bounded labels
            self._reply(job, None, RouteError(f"parameter 'tier': {exc}", "INVALID_ARG", "unknown_tier"))
            return
        key = routing_key(job.user_id, job.request_id)
        routed = _Routed(job, tier, self.splitter.version_for(key), key)
        try:
            self.scheduler.submit(routed, tier, self.clock())
        except QueueFull as exc:
            self.metrics.rejection(tier, "queue_full")
            self._reply(job, None, RouteError(f"router '{self.name}': {exc}", reason="queue_full"))
            return
        self._pump()

    def _pump(self) -> None:
        now = self.clock()
        for pending in self.scheduler.expire(now):
            self._expire(pending, now)
        while (pending := self.scheduler.pop_next(now)) is not None:
            self._spawn(self._dispatch(pending, now))
        self._arm_timer()

    def _expire(self, pending: Pending[_Routed], now: float) -> None:
        tier = pending.tier
        deadline_ms = (pending.deadline_at - pending.enqueued_at) * 1000
        waited_ms = (now - pending.enqueued_at) * 1000
        self.metrics.rejection(tier, "deadline")
        self._reply(pending.item.job, None, RouteError(
            f"router '{self.name}': request waited {waited_ms:.0f} ms in the '{tier}' queue, "
            f"past the tier's queue deadline of {deadline_ms:.0f} ms", reason="deadline"))

    def _arm_timer(self) -> None:
        due = self.scheduler.next_deadline()
        if due is None or (self._timer_at is not None and self._timer_at <= due and self._timer is not None):
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
        routed = pending.item
        job = routed.job
        self.metrics.queue_time(routed.tier, started - pending.enqueued_at)
        self.metrics.request(routed.tier, routed.version)
        outputs: Outputs | None = None
        try:
            outputs = await self.call_target(job.payload, routed.version)
        except Exception as exc:  # the target's failure goes back to this client only
            self.metrics.rejection(routed.tier, "target_error")
            self._reply(job, None, RouteError(str(exc), "INTERNAL", "target_error"))
        else:
            self._reply(job, outputs, None)
            self.metrics.latency(routed.tier, routed.version, self.clock() - job.arrived_at)
        finally:
            self.scheduler.release()
            self._pump()
        if outputs is not None:
            self._maybe_shadow(routed, outputs)

    def _maybe_shadow(self, routed: _Routed, primary: Outputs) -> None:
        shadow = self.config.shadow
        if shadow.version is None or not shadow_sampled(routed.key, shadow.percent):
            return
        if self.shadow_inflight >= shadow.max_inflight:
            self.metrics.shadow(shadow.version, "skipped", None)
            return
        self.shadow_inflight += 1
        self._spawn(self._shadow(routed.job.payload, primary, shadow))

    async def _shadow(self, payload: Any, primary: Outputs, policy: ShadowPolicy) -> None:
        version = policy.version
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
        self._stopping = True
        for pending in self.scheduler.drain():
            self.metrics.rejection(pending.tier, "shutdown")
            self._reply(pending.item.job, None,
                        RouteError(f"router '{self.name}' is shutting down", reason="shutdown"))
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
