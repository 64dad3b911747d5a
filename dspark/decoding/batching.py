"""Verification passes of concurrent requests in one target call.

Decode on a CPU is bound by memory bandwidth: a pass reads every weight once however many rows
it has, so the rows of several requests' rounds verified together cost little more than one
request's. ``RoundBatcher`` runs the rounds of all active generations in lockstep on one
thread: each plans (proposes), the target's ``forward_batch`` scores all their rows, each
commits. Greedy output stays identical to plain decoding as long as the runtime's batched rows
equal its single rows bit for bit.

Prompts: where the runtime can leave a call's prompt rows without logits (``skips_logits``),
a new request's prompt is read in the same calls, one chunk of at most ``PREFILL_CHUNK`` rows a
call, and the decoding requests' rounds ride along: a chunk is compute-bound, so their few rows
cost little there, where a separate pass would cost a whole read of the weights while the
prompt waited. Otherwise the prompt is read on the request's own thread before it joins.

A request that arrives while no other is decoding runs its rounds on its own thread, as an
unbatched engine would, and joins the batched loop after the round in which another request
arrives. A lone request gains nothing from the loop's thread, and each hand-off to it is a
thread wake-up, which on 2 cores preempts a decoding thread.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Optional

from dspark._ext import probes
from dspark.decoding.generation import Generation, VerifyItem
from dspark.errors import UnavailableError

_DONE = object()


class RoundBatcher:
    def __init__(self, engine, max_batch: int = 8):
        self.engine = engine
        self.target = engine.target
        self.max_batch = max_batch
        self.reads_prompts = self.target.skips_logits
        self._arrivals: "queue.Queue[tuple[Generation, queue.Queue]]" = queue.Queue()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._solo = False  # a request runs its rounds on its own thread
        self._batched = 0  # requests handed to the loop whose consumers have not finished

    def _claim_solo(self) -> bool:
        with self._lock:
            if self._solo or self._batched or self._closed:
                return False
            self._solo = True
            return True

    def run(self, generation: Generation) -> Iterator[list[int]]:
        """The generation's new tokens per round, its rounds batched with the others'."""
        out: queue.Queue = queue.Queue()
        solo = self._claim_solo()
        handed = False  # to the loop, which then ends the generation
        try:
            if solo:
                handed = yield from self._solo_rounds(generation, out)
                if not handed:
                    return
            else:
                if not self.reads_prompts:
                    generation.prefill()
                self._submit(generation, out)
                handed = True
            while True:
                item = out.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            generation.stop()  # the consumer left early: the loop drops it at its next round
            with self._lock:
                if handed:
                    self._batched -= 1
                elif solo:
                    self._solo = False
                loop_ended = self._thread is None or not self._thread.is_alive()
            if not handed or loop_ended:
                generation.finish("stopped")

    def _solo_rounds(self, generation: Generation, out: queue.Queue) -> Iterator[list[int]]:
        """Rounds on this thread until the generation ends (False) or another request has
        come (True: the generation is handed to the loop)."""
        generation.prefill()
        while not self._batched:
            if self._closed:
                generation.finish("cancelled")
                return False
            new = generation.step()
            if new is None:
                return False
            yield new
        with self._lock:
            self._solo = False
            self._submit_locked(generation, out)
        return True

    def _submit(self, generation: Generation, out: queue.Queue) -> None:
        with self._lock:
            self._submit_locked(generation, out)

    def _submit_locked(self, generation: Generation, out: queue.Queue) -> None:
        if self._closed:
            raise UnavailableError("the model is shutting down", "shutdown")
        self._batched += 1
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
            planned, prompt = [], None  # prompt: the index in planned of this call's prompt chunk
            for generation, out in active:
                try:
                    item, is_prompt = (None, False) if len(planned) >= self.max_batch else \
                        self._plan(generation, prompt is None)
                    if is_prompt:
                        prompt = len(planned)
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
            results, seconds = self._forward(planned, prompt)
            if results is None:
                active = [(g, o) for g, o in active if not g.done]
                continue
            for index, ((generation, out, item), (logits, taps)) in enumerate(zip(planned, results)):
                try:
                    if index == prompt:
                        generation.prompt_read(len(item.tokens), taps)
                    else:
                        # beside a prompt chunk the round's own cost is unknown: 0 tells the
                        # drafters not to calibrate on it
                        out.put(generation.commit(logits, taps if generation.want_taps else None,
                                                  seconds if prompt is None else 0.0))
                except BaseException as error:  # noqa: BLE001
                    generation.finish("error")
                    out.put(error)

    @staticmethod
    def _plan(generation: Generation, prompt_free: bool) -> tuple[Optional[VerifyItem], bool]:
        """The generation's item of this call: a chunk of its prompt (at most one a call:
        ``prompt_free``) and True, else its round."""
        if not generation.prefilled:
            item = generation.plan_prompt() if prompt_free else None
            if item is not None or not generation.prefilled:  # a chunk, done, or waiting its turn
                return item, item is not None
        return generation.plan(), False

    def _forward(self, planned: list, prompt: Optional[int]) -> tuple[Optional[list], float]:
        """One target call over every planned item: [(logits, taps)] in order and its seconds;
        None when it failed (every request of the call got the error)."""
        want_taps = any(generation.want_taps for generation, _, _ in planned)
        items = [(i.cache, i.tokens, i.positions, i.tree_mask) for _, _, i in planned]
        skip = {} if prompt is None else {"skip_logits": (prompt,)}
        start = time.perf_counter()
        try:
            if want_taps:
                results = self.target.forward_batch(items, want_taps=True, **skip)
            else:
                results = [(logits, None) for logits in self.target.forward_batch(items, **skip)]
        except BaseException as error:  # noqa: BLE001 - every request of the call fails
            for generation, out, _ in planned:
                generation.finish("error")
                out.put(error)
            return None, 0.0
        seconds = time.perf_counter() - start
        probes.verify_batch(len(items), sum(len(i[1]) for i in items), seconds)
        rounds = [item for n, (_, _, item) in enumerate(planned) if n != prompt]
        if rounds:  # beside a prompt's rows a call says nothing about a round's cost
            self.engine.verified_call(sum(len(i.tokens) for i in rounds), seconds if prompt is None else None)
        return results, seconds
