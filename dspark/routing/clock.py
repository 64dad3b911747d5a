"""The router's clock: what time it is and how long to wait, in one object, so tests drive time.

``Clock`` is the monotonic clock and real waits. ``ManualClock`` holds the time still until
``advance`` moves it; waits on it end when they are notified or when ``advance`` passes their
timeout, never by the wall clock. RouterCore takes one (``clock=``), so its unit tests set the
time a request waits or a call takes instead of sleeping through it.

A wait may return early with nothing to report (``ManualClock.advance`` wakes every waiter to
look at the time): callers loop on their own condition, as they would for any Condition.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Optional


class Clock:
    """Monotonic seconds (``clock()``) and waits measured in them."""

    def __call__(self) -> float:
        return time.monotonic()

    def wait(self, condition: threading.Condition, timeout: Optional[float]) -> bool:
        """Wait on ``condition`` (its lock held) up to ``timeout`` seconds of this clock; False
        when the timeout passed."""
        return condition.wait(timeout)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def result(self, future: Future, timeout: float) -> Any:
        """``future.result()``, or concurrent.futures.TimeoutError after ``timeout`` of this clock."""
        done = threading.Condition()

        def finished(_: Future) -> None:
            with done:
                done.notify_all()
        future.add_done_callback(finished)
        deadline = self() + timeout
        with done:
            while not future.done():
                left = deadline - self()
                if left <= 0:
                    raise FutureTimeout()
                self.wait(done, left)
        return future.result()


class ManualClock(Clock):
    """A clock that moves only by ``advance`` (tests). ``waiters()`` counts the threads that
    went (back) to waiting on it since the last ``advance``: a test waits for that count to know
    the threads it woke have done what the new time asks."""

    def __init__(self, start: float = 1000.0):
        self._now = start
        self._lock = threading.Lock()
        self._waiting: dict[object, threading.Condition] = {}  # one entry per waiting thread
        self._moved = threading.Condition()  # sleepers wait here

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move the time on and wake every waiter to look at it."""
        with self._lock:
            self._now += seconds
            woken, self._waiting = self._waiting, {}
        for condition in {id(c): c for c in woken.values()}.values():
            with condition:
                condition.notify_all()

    def waiters(self) -> int:
        with self._lock:
            return len(self._waiting)

    def wait(self, condition: threading.Condition, timeout: Optional[float]) -> bool:
        if timeout is not None and timeout <= 0:
            return False
        deadline = None if timeout is None else self._now + timeout
        token = object()
        with self._lock:
            self._waiting[token] = condition
        try:
            condition.wait()
        finally:
            with self._lock:
                self._waiting.pop(token, None)
        return deadline is None or self._now < deadline

    def sleep(self, seconds: float) -> None:
        with self._moved:
            deadline = self._now + seconds
            while self._now < deadline:
                self.wait(self._moved, deadline - self._now)
