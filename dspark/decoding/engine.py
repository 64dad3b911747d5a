"""The speculative decoding round loop: a proposer guesses a tree of tokens below the last
committed one, the target scores the whole tree in one pass (a tree attention mask), the
rejection sampler keeps the longest accepted path and adds the target's own next token.

What is guessed comes from a ``Proposer`` (``dspark.decoding.proposers``), selected per request
by ``speculative.method``; how guesses are accepted from ``dspark.decoding.rejection``. Greedy
acceptance follows the target's argmax, so the output equals plain decoding token for token: the
target's rows are bit-identical however they are batched (see ``onnx_lm``, and contract C1 for
the real-LLM runtimes). Sampled acceptance is lossless speculative sampling.

A ``Generation`` is one request's loop, split into ``plan`` (propose; the rows to verify) and
``commit`` (accept, update the caches and the drafter) so that ``dspark.decoding.batching`` can
verify several requests' rows in one target call.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Optional

import numpy as np

from dspark.decoding.proposers.base import DraftRequest, Drafter, PlainDecoding, Proposer
from dspark.decoding.rejection import verify
from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.decoding.stats import DecodeStats
from dspark.decoding.tree import DraftTree
from dspark.errors import RequestError

PREFILL_CHUNK = 64
COST_ROWS = (1, 2, 4, 8, 16)  # row counts whose pass cost is measured (interpolated between)


class PromptTooLong(RequestError):
    """The prompt is empty or does not fit the context."""

    def __init__(self, reason: str):
        super().__init__("text_input", reason)


def forward(lm, cache, tokens, positions, tree_mask: Optional[np.ndarray] = None,
            want_taps: bool = False) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Logits of the new rows and, when asked, their tapped hidden states."""
    if want_taps:
        return lm.forward(cache, tokens, positions, tree_mask=tree_mask, want_taps=True)
    return lm.forward(cache, tokens, positions, tree_mask=tree_mask), None


class VerifyCost:
    """The target's cost of a pass over n rows relative to one row, measured once (median of a
    few passes at a short context) on first use, linear between the measured row counts."""

    def __init__(self, lm, context: int = 128, repeats: int = 3):
        self.lm, self.context, self.repeats = lm, context, repeats
        self._table: Optional[np.ndarray] = None
        self._lock = threading.Lock()

    def _measure(self) -> np.ndarray:
        cache = self.lm.new_cache(self.context + max(COST_ROWS))
        self.lm.forward(cache, np.zeros(self.context, np.int64), np.arange(self.context))
        seconds = []
        for rows in COST_ROWS:
            runs = []
            for _ in range(self.repeats):
                start = time.perf_counter()
                self.lm.forward(cache, np.zeros(rows, np.int64),
                                np.arange(self.context, self.context + rows))
                runs.append(time.perf_counter() - start)
                cache.truncate(self.context)
            seconds.append(float(np.median(runs)))
        # a pass never gets cheaper with more rows; noise must not say otherwise
        return np.maximum.accumulate(np.array(seconds) / seconds[0])

    def __call__(self, rows: int) -> float:
        if self._table is None:
            with self._lock:
                if self._table is None:
                    self._table = self._measure()
        return float(np.interp(rows, COST_ROWS, self._table, right=None)) if rows <= COST_ROWS[-1] \
            else float(self._table[-1] * rows / COST_ROWS[-1])


@dataclass
class VerifyItem:
    """One request's rows of a verify pass (the runtime's ``forward_batch`` item)."""
    cache: object
    tokens: list[int]
    positions: list[int]
    tree_mask: Optional[np.ndarray]


class SpeculativeEngine:
    """Token-level decoding with the proposers it was given; ``dspark.decoding.text`` adds the
    tokenizer, chat template, stop strings and streams."""

    def __init__(self, target, proposers: Iterable[Proposer] = (), context: Optional[int] = None,
                 eos_ids: Iterable[int] = (), batch_verification: bool = False):
        self.target = target
        self.proposers: dict[str, Proposer] = {p.name: p for p in (PlainDecoding(), *proposers)}
        self.context = min(context or target.config.ctx, target.config.ctx)
        self.eos_ids = frozenset(eos_ids)
        self.verify_cost = VerifyCost(target)
        self.batcher = None
        if batch_verification:
            from dspark.decoding.batching import RoundBatcher

            self.batcher = RoundBatcher(target)

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(self.proposers)

    def check(self, prompt: list[int], spec: SpeculativeParams) -> None:
        """Refuse what cannot be served, before any model work."""
        if spec.method not in self.proposers:
            raise RequestError("speculative.method",
                               f"{spec.method!r} is not one of this model's methods {self.methods}")
        if not prompt:
            raise PromptTooLong("the prompt is empty; give at least one token")
        if len(prompt) >= self.context:
            raise PromptTooLong(f"prompt is {len(prompt)} tokens but the context is "
                                f"{self.context}; shorten it to at most {self.context - 1}")

    def start(self, prompt: list[int], sampling: SamplingParams, spec: SpeculativeParams,
              stats: Optional[DecodeStats] = None,
              cancelled: Optional[Callable[[], bool]] = None) -> "Generation":
        self.check(prompt, spec)
        return Generation(self, list(prompt), sampling, spec,
                          stats if stats is not None else DecodeStats(), cancelled)

    def generate(self, prompt: list[int], sampling: SamplingParams, spec: SpeculativeParams,
                 stats: Optional[DecodeStats] = None,
                 cancelled: Optional[Callable[[], bool]] = None) -> Iterator[list[int]]:
        """Yield the newly committed tokens after each target pass (batched with other
        requests' passes when the engine batches verification)."""
        generation = self.start(prompt, sampling, spec, stats, cancelled)
        if self.batcher is not None and not generation.want_taps:
            return self.batcher.run(generation)
        return generation.run()

    def close(self) -> None:
        """Stop batching; requests still decoding end as cancelled."""
        if self.batcher is not None:
            self.batcher.close()


class Generation:
    """One request's decoding: its target cache, its drafter, its history."""

    def __init__(self, engine: SpeculativeEngine, prompt: list[int], sampling: SamplingParams,
                 spec: SpeculativeParams, stats: DecodeStats,
                 cancelled: Optional[Callable[[], bool]]):
        self.engine = engine
        self.sampling, self.stats = sampling, stats
        self.cancelled = cancelled
        self.history = prompt
        self.prompt_length = len(prompt)
        self.proposer = engine.proposers[spec.method]
        self.want_taps = self.proposer.wants_taps
        self.rng = np.random.default_rng(sampling.seed)
        self.cache = engine.target.new_cache(engine.context)
        self.drafter: Drafter = self.proposer.start(DraftRequest(
            prompt, sampling, spec, self.rng, stats, engine.context, engine.verify_cost))
        self.tree = DraftTree()
        self.done = False
        self._stopped = False

    @property
    def generated(self) -> int:
        return len(self.history) - self.prompt_length

    def prefill(self) -> None:
        """The target reads everything but the prompt's last token, which each round feeds as
        the root."""
        start = time.perf_counter()
        taps = []
        prompt = self.history
        for s in range(0, len(prompt) - 1, PREFILL_CHUNK):
            chunk = prompt[s:min(s + PREFILL_CHUNK, len(prompt) - 1)]
            _, chunk_taps = forward(self.engine.target, self.cache, chunk,
                                    np.arange(s, s + len(chunk)), want_taps=self.want_taps)
            taps.append(chunk_taps)
        self.stats.prefill_s = time.perf_counter() - start
        self.drafter.prefilled(np.concatenate(taps) if self.want_taps and taps else None)

    def plan(self) -> Optional[VerifyItem]:
        """This round's rows (root + guesses), or None when the request is done."""
        if self.done:
            return None
        if self._stopped or (self.cancelled is not None and self.cancelled()):
            return self.finish("cancelled")
        history, context = self.history, self.engine.context
        room = context - len(history)  # cache rows left after the root's
        budget = min(self.sampling.max_tokens - self.generated, room + 1)
        if budget <= 0:
            return self.finish("length")
        start = time.perf_counter()
        self.tree = self.drafter.propose(history, min(budget - 1, room), room) \
            if budget > 1 else DraftTree()
        self.stats.draft_s += time.perf_counter() - start
        root = len(history) - 1
        return VerifyItem(self.cache, [history[-1]] + self.tree.tokens,
                          [root] + [root + d for d in self.tree.depths],
                          self.tree.mask() if self.tree.tokens else None)

    def commit(self, logits: np.ndarray, taps: Optional[np.ndarray], target_s: float) -> list[int]:
        """Accept from this round's pass; return the new tokens."""
        base = self.cache.length - len(self.tree.tokens) - 1
        new, path = verify(logits, self.tree, self.sampling, self.rng)
        eos = next((i for i, token in enumerate(new) if token in self.engine.eos_ids), None)
        rows = np.array([0] + [n + 1 for n in path])
        self.cache.keep_rows(base, rows)
        self.stats.target_s += target_s
        self.stats.record_pass(self.tree.depth, len(path))
        self.drafter.verified(self.tree, path, new, taps[rows] if taps is not None else None,
                              target_s)
        if eos is not None:
            new = new[:eos]  # the end-of-sequence token ends the text and is not part of it
        self.history.extend(new)  # the tree's depth kept it within max_tokens
        self.stats.generated_tokens = self.generated
        if eos is not None:
            self.finish("eos")
        elif self.generated >= self.sampling.max_tokens:
            self.finish("length")
        return new

    def stop(self) -> None:
        """Ask the loop to end at its next round (thread-safe)."""
        self._stopped = True

    def finish(self, reason: str) -> None:
        """End the request (idempotent); the drafter releases its state."""
        if not self.done:
            self.done = True
            self.stats.finish_reason = self.stats.finish_reason or reason
            self.drafter.finish(self.history[self.prompt_length:])
        return None

    def run(self) -> Iterator[list[int]]:
        """The round loop on this thread: one target call per round."""
        try:
            self.prefill()
            while (item := self.plan()) is not None:
                start = time.perf_counter()
                logits, taps = forward(self.engine.target, item.cache, item.tokens, item.positions,
                                       item.tree_mask, self.want_taps)
                yield self.commit(logits, taps, time.perf_counter() - start)
        finally:
            self.finish("stopped")
