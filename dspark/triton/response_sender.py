"""A decoupled request's response sender, safe to share between threads.

Triton 2.51's Python backend frees a request's response factory once the final response is
sent; an ``is_cancelled()`` that reaches the server after that (or while it happens, from another
thread) dereferences the freed factory and the whole server dies (SIGSEGV in
``TRITONBACKEND_ResponseFactoryIsCancelled``, seen in CI when a request stopped at a stop string
while the round batcher was asking whether it was cancelled). Here asking and sending take one
lock, and once the final response is sent ``is_cancelled`` answers True without asking the server.

Asking is an IPC round trip to the server; a decode loop that asks every round (a few ms) would
pay it on its critical path, so an answer "not cancelled" is reused for ``recheck_s``, and with
``ask_on`` (a one-thread executor's ``submit``) a stale answer is refreshed on that thread while
the caller goes on with the one it has: the round batcher, which asks for every request of a
round, spent ~18 % of a served 4-request run waiting for these round trips.

A model's ``StreamLedger`` counts its streams: an unload that hangs (Triton calls ``finalize``
only when no response factory is left) then says whether every request had its final response."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


@dataclass
class StreamLedger:
    """Response streams opened, closed by a final response, and sends that raised."""
    opened: int = 0
    closed: int = 0
    failed: int = 0
    last_error: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, opened: int = 0, closed: int = 0, error: Optional[BaseException] = None) -> None:
        with self._lock:
            self.opened += opened
            self.closed += closed
            if error is not None:
                self.failed += 1
                self.last_error = repr(error)

    @property
    def open_streams(self) -> int:
        with self._lock:
            return self.opened - self.closed

    def summary(self) -> str:
        with self._lock:
            text = (f"{self.opened - self.closed} of {self.opened} response streams without a final "
                    f"response, {self.failed} sends raised")
            return text + (f" (last: {self.last_error})" if self.failed else "")


class GuardedSender:
    def __init__(self, sender: Any, final_flag: int, recheck_s: float = 0.0,
                 ledger: Optional[StreamLedger] = None,
                 ask_on: Optional[Callable[[Callable[[], None]], Any]] = None):
        self._sender = sender
        self._ask_on = ask_on
        self._asking = False
        self._ledger = ledger or StreamLedger()
        self._ledger.count(opened=1)
        self._final_flag = final_flag
        self._recheck_s = recheck_s
        self._lock = threading.Lock()
        self._asked = float("-inf")
        self._cancelled = False
        self.closed = False

    @property
    def known_cancelled(self) -> bool:
        """Cancelled or closed as last asked (no IPC)."""
        return self.closed or self._cancelled

    def is_cancelled(self, ask_here: bool = False) -> bool:
        """Whether the client cancelled. A stale answer is refreshed on ``ask_on``'s thread
        while the caller goes on, or on this thread with ``ask_here`` (a streaming request's
        sending thread, awake anyway), which refreshes it at half that age: the decode loop then
        rarely finds it stale, and no other thread is woken to ask."""
        # a known answer needs no lock: the decode loop must not wait for a send in flight
        if self.known_cancelled:
            return True
        if time.monotonic() - self._asked < (self._recheck_s / 2 if ask_here else self._recheck_s):
            return False
        if self._ask_on is None or ask_here:
            self._ask()
        elif not self._asking:
            self._asking = True
            try:
                self._ask_on(self._ask)
            except RuntimeError:  # the executor was shut down (the model finalized): ask here
                self._ask()
        return self.known_cancelled

    def _ask(self) -> None:
        with self._lock:
            if not self.known_cancelled:
                self._cancelled = bool(self._sender.is_cancelled())
                self._asked = time.monotonic()
            self._asking = False

    def send(self, response: Any = None, final: bool = False) -> bool:
        """Send ``response`` (and/or the final flag); False when the stream was already closed
        (the response is dropped: its request has had its final answer)."""
        with self._lock:
            if self.closed:
                return False
            self.closed = final
            try:
                self._sender.send(response, flags=self._final_flag if final else 0)
            except Exception as error:
                self._ledger.count(error=error)
                raise
            self._ledger.count(closed=int(final))
            return True
