"""Serving pieces of the speculative backend that need no Triton: the bounded worker pool
requests run on, and the process's heap settings."""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from dspark._ext import probes
from dspark.errors import UnavailableError


@dataclass
class _Job:
    run: Callable[[], None]
    reject: Callable[[BaseException], None]
    deadline: float


class RequestPool:
    """``workers`` threads run requests; up to ``max_queued`` more wait, each at most
    ``max_wait_s``; beyond that a request is answered UNAVAILABLE at once. ``close`` answers
    what still waits and joins the workers (whose requests see ``closing`` and end)."""

    def __init__(self, workers: int, max_queued: int, max_wait_s: float, name: str = "request"):
        self.max_wait_s = max_wait_s
        self.name = name
        self.closing = threading.Event()
        self._jobs: "queue.Queue[Optional[_Job]]" = queue.Queue(maxsize=max_queued + workers)
        self._workers = workers
        self._busy = 0
        self._lock = threading.Lock()
        self._max_queued = max_queued
        self._waiting = 0
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, run: Callable[[], None], reject: Callable[[BaseException], None]) -> None:
        """Run ``run`` on a worker, or call ``reject`` with an UnavailableError."""
        with self._lock:
            if self.closing.is_set():
                error = UnavailableError("the model is shutting down", "shutdown")
            elif self._busy + self._waiting >= self._workers + self._max_queued:
                error = UnavailableError(
                    f"busy: {self._workers} requests running and {self._max_queued} waiting; "
                    "retry later", "busy")
            else:
                self._waiting += 1
                self._jobs.put_nowait(_Job(run, reject, time.monotonic() + self.max_wait_s))
                return
        reject(error)

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._lock:
            return self._busy, self._waiting

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                self._waiting -= 1
                self._busy += 1
            probes.queue_wait(self.name, time.monotonic() - job.deadline + self.max_wait_s)
            try:
                if self.closing.is_set():
                    job.reject(UnavailableError("the model is shutting down", "shutdown"))
                elif time.monotonic() > job.deadline:
                    job.reject(UnavailableError(
                        f"busy: waited {self.max_wait_s:g} s for one of {self._workers} workers; "
                        "retry later", "queue_timeout"))
                else:
                    job.run()
            except BaseException as error:  # noqa: BLE001 - a job's own handler failed; keep serving
                try:
                    job.reject(error)
                except BaseException:  # noqa: BLE001
                    pass
            finally:
                with self._lock:
                    self._busy -= 1

    def close(self, timeout_s: float) -> bool:
        """Stop: queued requests are rejected, running ones see ``closing``; True when every
        worker ended within ``timeout_s``."""
        self.closing.set()
        for _ in self._threads:
            self._jobs.put(None)  # after the queued jobs, which are rejected on the way
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)


_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # glibc mallopt parameters


def limit_heap_growth(mmap_threshold: int = 128 * 1024, arenas: int = 2) -> bool:
    """Keep a long-running generation process's memory flat (glibc only; False elsewhere).

    Decoding allocates and frees large temporaries every round (logits rows of a 49,152-token
    vocabulary, distributions, cache slots). glibc raises its mmap threshold each time such a
    block is freed, so later ones come from per-thread heaps that fragment and never shrink:
    in a 4-thread run the process grew 457 -> 766 MB over 100 requests. A fixed threshold keeps
    them on mmap (returned to the OS on free) and two arenas bound the heaps: 421 -> 443 MB
    over 133 requests (docs/speculative.md, "Soak")."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_ARENA_MAX, arenas))
