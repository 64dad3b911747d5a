"""An open-loop client load on a background thread: requests sent at a fixed rate (evenly spaced
or Poisson arrivals) whatever the server does, spread over servers, each with its own user id and
a client timeout; every request is recorded with the time it was meant to go out and the time it
was answered. A closed loop (a thread calling again as soon as it is answered) slows down when
the server does and so hides a stall; this load keeps arriving, so a stall shows as a gap between
answers, as queued requests and, past the timeout, as failures.

Used by `bench rollout` and the rollout tests, where the load must run while the (synchronous)
controller drives a rollout on the main thread.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from dspark.bench.client import HttpTransport, Record
from dspark.bench.inputs import InputSpec, ModelInfo

ARRIVALS = ("fixed", "poisson")


@dataclass(frozen=True)
class Answer:
    """One request: ``scheduled`` (when it was due), ``done`` (answered or failed), both
    time.monotonic(); ``error`` None when answered."""

    server: str
    scheduled: float
    done: float
    error: Optional[str] = None

    @property
    def latency(self) -> float:
        """From when the request was due, so time spent waiting to be sent counts too."""
        return self.done - self.scheduled


class OpenLoopLoad:
    """``rate`` requests/s in all, round-robin over ``urls``, to ``model`` (an input ``x`` of 3
    floats, as the rollout demo's model and router take), each request with the next of
    ``users`` user ids (``user_id`` parameter) and a ``timeout_s`` client timeout."""

    def __init__(self, urls: Sequence[str], model: str, rate: float = 60.0, arrivals: str = "fixed",
                 timeout_s: float = 1.0, users: int = 1000, seed: int = 0):
        if rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s, not {rate}")
        if arrivals not in ARRIVALS:
            raise ValueError(f"arrivals must be one of {', '.join(ARRIVALS)}, not {arrivals!r}")
        self.urls, self.model, self.rate, self.arrivals = list(urls), model, rate, arrivals
        self.timeout_s, self.users = timeout_s, users
        self.answers: list[Answer] = []
        self._rng = random.Random(seed)
        self._stop: Optional[asyncio.Event] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="open-loop-load", daemon=True)

    def start(self) -> "OpenLoopLoad":
        self._thread.start()
        if not self._started.wait(30):
            raise RuntimeError("the open-loop load did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(self.timeout_s + 30)

    def __enter__(self) -> "OpenLoopLoad":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        info = ModelInfo(self.model, 0, (InputSpec("x", "TYPE_FP32", (-1,)),), ("y", "version"), False)
        x = {"x": np.array([1.0, 2.0, 3.0], dtype=np.float32)}
        transports = []
        for url in self.urls:
            transport = HttpTransport(url, self.timeout_s)
            await transport.open(0)
            payloads = [transport.prepare(info, x, {"user_id": f"user-{u}"}) for u in range(self.users)]
            transports.append((url, transport, payloads))
        pending: set[asyncio.Task] = set()
        self._started.set()
        due = time.perf_counter()
        offset = time.monotonic() - due  # perf_counter -> monotonic (the controller's clock)
        sent = 0
        while not self._stop.is_set():
            due += self._rng.expovariate(self.rate) if self.arrivals == "poisson" else 1.0 / self.rate
            delay = due - time.perf_counter()
            if delay > 0:
                try:
                    await asyncio.wait_for(self._stop.wait(), delay)
                    break
                except asyncio.TimeoutError:
                    pass
            url, transport, payloads = transports[sent % len(transports)]
            task = asyncio.ensure_future(self._one(url, transport, payloads[(sent // len(transports)) % len(payloads)],
                                                   due, offset))
            pending.add(task)
            task.add_done_callback(pending.discard)
            sent += 1
        if pending:
            await asyncio.wait(pending, timeout=self.timeout_s + 5)
        for _, transport, _ in transports:
            await transport.close()

    async def _one(self, url: str, transport: HttpTransport, payload: bytes, due: float, offset: float) -> None:
        record: Record = await transport.send(self.model, self.model, payload, due)
        error = None if record.error is None else f"{record.error}: {record.detail}"
        self.answers.append(Answer(url, due + offset, record.done + offset, error))

    # ------------------------------------------------------------------ what was seen
    def between(self, start: float, end: float) -> list[Answer]:
        """Requests due in [start, end) (time.monotonic())."""
        return [a for a in list(self.answers) if start <= a.scheduled < end]

    def failures(self, start: float = 0.0, end: float = float("inf")) -> list[Answer]:
        return [a for a in self.between(start, end) if a.error is not None]


def largest_gap(answers: Sequence[Answer], start: float, end: float) -> float:
    """The longest time in [start, end] without an answer (a failure is no answer): between
    consecutive answers, and from ``start`` to the first and from the last to ``end``."""
    times = sorted(a.done for a in answers if a.error is None and start <= a.done <= end)
    edges = [start, *times, end]
    return max(b - a for a, b in zip(edges, edges[1:]))


def percentile_ms(answers: Sequence[Answer], q: float) -> float:
    """The ``q`` percentile of the answered requests' latency (ms), nan without any."""
    latencies = [1000 * a.latency for a in answers if a.error is None]
    return float(np.percentile(latencies, q)) if latencies else float("nan")
