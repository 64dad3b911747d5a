"""A decoupled request's response sender, safe to share between threads.

Triton 2.51's Python backend frees a request's response factory once the final response is
sent; an ``is_cancelled()`` that reaches the server after that (or while it happens, from another
thread) dereferences the freed factory and the whole server dies (SIGSEGV in
``TRITONBACKEND_ResponseFactoryIsCancelled``, seen in CI when a request stopped at a stop string
while the round batcher was asking whether it was cancelled). Here every call takes one lock,
and once the final response is sent ``is_cancelled`` answers True without asking the server."""
from __future__ import annotations

import threading
from typing import Any


class GuardedSender:
    def __init__(self, sender: Any, final_flag: int):
        self._sender = sender
        self._final_flag = final_flag
        self._lock = threading.Lock()
        self.closed = False

    def is_cancelled(self) -> bool:
        with self._lock:
            return self.closed or bool(self._sender.is_cancelled())

    def send(self, response: Any = None, final: bool = False) -> bool:
        """Send ``response`` (and/or the final flag); False when the stream was already closed
        (the response is dropped: its request has had its final answer)."""
        with self._lock:
            if self.closed:
                return False
            self.closed = final
            self._sender.send(response, flags=self._final_flag if final else 0)
            return True
