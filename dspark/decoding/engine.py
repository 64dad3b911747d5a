"""The speculative decoding round loop: a proposer guesses a tree of tokens below the last
committed one, the target scores the whole tree in one pass (a tree attention mask), the
rejection sampler keeps the longest accepted path and adds the target's own next token.

What is guessed comes from a ``Proposer`` (``dspark.decoding.proposers``), selected per request
by ``speculative.method``; how guesses are accepted from ``dspark.decoding.rejection``. Greedy
acceptance follows the target's argmax, so the output equals plain decoding token for token: the
target's rows are bit-identical however they are batched (see ``onnx_lm`` and
``dspark.llm.kernel_runtime``). Sampled acceptance is lossless speculative sampling.

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

from dspark.decoding.prompt import PREFILL_CHUNK, read_prompt
from dspark.decoding.proposers.base import DraftRequest, Drafter, PlainDecoding, Proposer
from dspark.decoding.rejection import verify
from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.decoding.stats import DecodeStats
from dspark.decoding.tree import DraftTree
from dspark.errors import RequestError

# A verified row's cost relative to a pass, until measured: about 0.03 (fp32 graphs) to 0.15
# (4-bit weights, where a pass is cheap) on the CPUs seen (docs/speculative.md).
PRIOR_ROW_COST = 0.05
# The most a row may cost as learnt. A pass over n rows never costs more than n passes of one,
# and a bound below 1 keeps sure guesses verified, so the cost of wider passes keeps being
# measured: one slow wide pass (a noisy machine) cannot switch speculation off for good.
MAX_ROW_COST = 0.5


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
    """The target's cost of a pass over n rows relative to one row, learnt from the passes the
    engine runs: seconds per row count, exponentially smoothed, fitted with a line a + b (n - 1)
    (decode on a CPU reads every weight once per pass, so a pass costs a fixed part plus a
    little per row). Before passes of two row counts are seen, b / a is ``prior_row_cost``; it
    stays within [0, ``MAX_ROW_COST``]."""

    def __init__(self, prior_row_cost: float = PRIOR_ROW_COST, max_rows: int = 64,
                 smoothing: float = 0.1):
        self.smoothing = smoothing
        self._seconds = np.zeros(max_rows + 1)
        self._seen = np.zeros(max_rows + 1)
        self._row_cost = prior_row_cost
        self._observed = 0
        self._lock = threading.Lock()

    def observe(self, rows: int, seconds: float) -> None:
        rows = min(rows, len(self._seconds) - 1)
        with self._lock:
            if self._seen[rows]:
                self._seconds[rows] += self.smoothing * (seconds - self._seconds[rows])
            else:
                self._seconds[rows] = seconds
            new_count = not self._seen[rows]
            self._seen[rows] = min(self._seen[rows] + 1, 10)
            self._observed += 1
            known = np.flatnonzero(self._seen)
            if len(known) >= 2 and (new_count or self._observed % 16 == 0):  # a fit is ~50 us
                b, a = np.polyfit(known - 1.0, self._seconds[known], 1, w=self._seen[known])
                if a > 0:
                    self._row_cost = min(max(b, 0.0) / a, MAX_ROW_COST)

    def __call__(self, rows: int) -> float:
        return 1.0 + self._row_cost * (max(rows, 1) - 1)


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
        # a runtime that computes a tree's rows bit for bit as the chains through it says so;
        # on others greedy requests verify chains only (identity with plain decoding)
        self.exact_trees = bool(getattr(target, "exact_trees", False))
        self.verify_cost = VerifyCost()
        self._calls = 0  # target calls of the round loops (a batched call verifies several)
        self._calls_lock = threading.Lock()
        self.batcher = None
        if batch_verification:
            from dspark.decoding.batching import RoundBatcher

            self.batcher = RoundBatcher(self)

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
        if self.batcher is not None:
            return self.batcher.run(generation)
        return generation.run()

    def verified_call(self, rows: int, seconds: Optional[float]) -> None:
        """A round loop's target call over ``rows`` rows took ``seconds`` (None: it also read a
        prompt's rows, so it says nothing about a round's cost)."""
        if seconds is not None:
            self.verify_cost.observe(rows, seconds)
        with self._calls_lock:
            self._calls += 1

    @property
    def target_calls(self) -> int:
        return self._calls

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
        self.chains_only = sampling.greedy and not engine.exact_trees
        self.drafter: Drafter = self.proposer.start(DraftRequest(
            prompt, sampling, spec, self.rng, stats, engine.context, engine.verify_cost,
            self.chains_only))
        self.tree = DraftTree()
        self.done = False
        self._stopped = False
        self.prefilled = False
        self._prompt_rows = 0  # rows of the prompt in the cache
        self._prompt_taps: list[np.ndarray] = []
        self._prefill_start: Optional[float] = None

    @property
    def generated(self) -> int:
        return len(self.history) - self.prompt_length

    def prefill(self) -> None:
        """The target reads everything but the prompt's last token, which each round feeds as
        the root."""
        self._prefill_start = time.perf_counter()
        taps = read_prompt(self.engine.target, self.cache, self.history, self.want_taps)
        self.prompt_read(self.prompt_length - 1, taps)

    def plan_prompt(self) -> Optional[VerifyItem]:
        """The next chunk of the prompt for a batched call (``prompt_read`` takes its
        result), or None when the request is done or the prompt is read (then ``plan``)."""
        if self._stopped or (self.cancelled is not None and self.cancelled()):
            return self.finish("cancelled")
        if self._prefill_start is None:
            self._prefill_start = time.perf_counter()
        start = self._prompt_rows
        end = min(start + PREFILL_CHUNK, self.prompt_length - 1)
        if start == end:
            self.prompt_read(0, None)
            return None
        return VerifyItem(self.cache, self.history[start:end], list(range(start, end)), None)

    def prompt_read(self, rows: int, taps: Optional[np.ndarray]) -> None:
        """``rows`` more of the prompt are in the cache (their taps when the drafter wants them)."""
        self._prompt_rows += rows
        if taps is not None and self.want_taps:
            self._prompt_taps.append(taps)
        if self._prompt_rows == self.prompt_length - 1:
            self.prefilled = True
            self.stats.prefill_s = time.perf_counter() - self._prefill_start
            self.drafter.prefilled(np.concatenate(self._prompt_taps) if self._prompt_taps else None)
            self._prompt_taps = []

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
        if self.chains_only:
            self.tree = self.tree.first_path()
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
            self.cache = None  # the runtime's cache slot goes back to its pool now
        return None

    def step(self) -> Optional[list[int]]:
        """One round with its own target call on this thread: the new tokens, or None when
        the request is done."""
        item = self.plan()
        if item is None:
            return None
        start = time.perf_counter()
        logits, taps = forward(self.engine.target, item.cache, item.tokens, item.positions,
                               item.tree_mask, self.want_taps)
        seconds = time.perf_counter() - start
        self.engine.verified_call(len(item.tokens), seconds)
        return self.commit(logits, taps, seconds)

    def run(self) -> Iterator[list[int]]:
        """The round loop on this thread: one target call per round."""
        try:
            self.prefill()
            while (new := self.step()) is not None:
                yield new
        finally:
            self.finish("stopped")
