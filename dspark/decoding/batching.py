"""Verification passes of concurrent requests in one target call.

Decode on a CPU is bound by memory bandwidth: a pass reads every weight once however many rows
it has, so the rows of several requests' rounds verified together cost little more than one
request's. ``RoundBatcher`` runs the rounds of all active generations in lockstep on one
thread: each plans (proposes), the target's ``forward_batch`` scores all their rows, each
commits. The prompt's prefill runs on the request's own thread before it joins (it is long, and
would stall everyone's rounds). Greedy output stays identical to plain decoding as long as the
runtime's batched rows equal its single rows bit for bit (contract C1).
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Optional

from dspark.decoding.engine import Generation
from dspark.errors import UnavailableError

_DONE = object()


class RoundBatcher:
    def __init__(self, engine, max_batch: int = 8):
        self.engine = engine
        self.target = engine.target
        self.max_batch = max_batch
        self._arrivals: "queue.Queue[tuple[Generation, queue.Queue]]" = queue.Queue()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def run(self, generation: Generation) -> Iterator[list[int]]:
        """The generation's new tokens per round, its rounds batched with the others'."""
        out: queue.Queue = queue.Queue()
        try:
            generation.prefill()
            self._submit(generation, out)
            while True:
                item = out.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            generation.stop()  # the consumer left early: the loop drops it at its next round
            if self._thread is None or not self._thread.is_alive():
                generation.finish("stopped")

    def _submit(self, generation: Generation, out: queue.Queue) -> None:
        with self._lock:
            if self._closed:
                raise UnavailableError("the model is shutting down", "shutdown")
            self._arrivals.put((generation, out))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="round-batcher", daemon=True)
                self._thread.start()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop after the current round; every generation still active ends as cancelled."""
        with self._lock:
            self._closed = True
            self._arrivals.put(None)
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _loop(self) -> None:
        active: list[tuple[Generation, queue.Queue]] = []
        closing = False
        while True:
            try:  # block only while idle
                while True:
                    arrival = self._arrivals.get(block=not active and not closing)
                    if arrival is None:
                        closing = True
                    else:
                        active.append(arrival)
            except queue.Empty:
                pass
            if closing:
                for generation, out in active:
                    generation.finish("cancelled")
                    out.put(_DONE)
                return
            planned = []
            for generation, out in active:
                try:
                    item = None if len(planned) >= self.max_batch else generation.plan()
                except BaseException as error:  # noqa: BLE001 - handed to the request's thread
                    generation.finish("error")
                    out.put(error)
                    continue
                if item is None and generation.done:
                    out.put(_DONE)
                elif item is not None:
                    planned.append((generation, out, item))
            active = [(g, o) for g, o in active if not g.done]
            if not planned:
                continue
            want_taps = any(generation.want_taps for generation, _, _ in planned)
            items = [(i.cache, i.tokens, i.positions, i.tree_mask) for _, _, i in planned]
            start = time.perf_counter()
            try:
                if want_taps:
                    results = self.target.forward_batch(items, want_taps=True)
                else:
                    results = [(logits, None) for logits in self.target.forward_batch(items)]
            except BaseException as error:  # noqa: BLE001 - every request of the call fails
                for generation, out, _ in planned:
                    generation.finish("error")
                    out.put(error)
                active = [(g, o) for g, o in active if not g.done]
                continue
            seconds = time.perf_counter() - start
            self.engine.verified_call(sum(len(i.tokens) for _, _, i in planned), seconds)
            for (generation, out, _), (logits, taps) in zip(planned, results):
                try:
                    out.put(generation.commit(logits, taps if generation.want_taps else None,
                                              seconds))
                except BaseException as error:  # noqa: BLE001
                    generation.finish("error")
                    out.put(error)
