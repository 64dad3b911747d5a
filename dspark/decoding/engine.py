"""The speculative decoding round loop: a proposer guesses a tree of tokens below the last
committed one, the target scores the whole tree in one pass (a tree attention mask), the
rejection sampler keeps the longest accepted path and adds the target's own next token.

What is guessed comes from a ``Proposer`` (``dspark.decoding.proposers``), selected per request
by ``speculative.method``; how guesses are accepted from ``dspark.decoding.rejection``. Greedy
acceptance follows the target's argmax, so the output equals plain decoding token for token: the
target's rows are bit-identical however they are batched (see
``dspark.llm.kernel_runtime``). Sampled acceptance is lossless speculative sampling.

One request's loop is a ``dspark.decoding.generation.Generation``; ``dspark.decoding.batching``
verifies several requests' rows in one target call.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Optional

import numpy as np

from dspark.decoding.constraint import Constraint, Grammars
from dspark.decoding.generation import Generation
from dspark.decoding.prefix_cache import PrefixCache
from dspark.decoding.proposers.base import PlainDecoding, Proposer
from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.decoding.stats import DecodeStats
from dspark.errors import RequestError
from dspark.runtimes.protocol import TargetRuntime

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

    def measure(self, target: TargetRuntime, rows: Sequence[int] = (1, 2, 4, 8), repeats: int = 2,
                past: int = 64, clock: Callable[[], float] = time.perf_counter) -> None:
        """Seed the table from passes timed now (at load): ``repeats`` interleaved passes of each
        row count after ``past`` cached rows, so the first requests' schedules start from this
        model's costs on this machine rather than the prior; their own passes refine it."""
        past = min(past, target.config.ctx - max(rows))
        if past < 1:
            return
        cache = target.new_cache(past + max(rows))
        rng = np.random.default_rng(0)
        target.forward(cache, rng.integers(0, target.config.vocab, past), np.arange(past))
        for _ in range(repeats):
            for n in rows:
                tokens = rng.integers(0, target.config.vocab, n)
                started = clock()
                target.forward(cache, tokens, np.arange(past, past + n))
                self.observe(n, clock() - started)
                cache.truncate(past)


class SpeculativeEngine:
    """Token-level decoding with the proposers it was given; ``dspark.decoding.text`` adds the
    tokenizer, chat template, stop strings and streams."""

    def __init__(self, target: TargetRuntime, proposers: Iterable[Proposer] = (), context: Optional[int] = None,
                 eos_ids: Iterable[int] = (), batch_verification: bool = False,
                 grammars: Optional[Grammars] = None, prefix_cache: Optional[PrefixCache] = None):
        if not isinstance(target, TargetRuntime):
            raise TypeError(f"{type(target).__name__} is not a TargetRuntime (dspark.runtimes.protocol)")
        if prefix_cache is not None and not target.copies_rows:
            raise TypeError(f"{type(target).__name__} cannot copy cache rows: no prefix cache on it")
        self.target = target
        # KV rows of earlier requests' prompts and replies, shared by every request of this engine
        self.prefix_cache = prefix_cache
        self.proposers: dict[str, Proposer] = {p.name: p for p in (PlainDecoding(), *proposers)}
        self.context = min(context or target.config.ctx, target.config.ctx)
        self.eos_ids = frozenset(eos_ids)
        self.grammars = grammars  # compiles requests' ``guided`` constraints; None: refused
        # a runtime that computes a tree's rows bit for bit as the chains through it says so;
        # on others greedy requests verify chains only (identity with plain decoding)
        self.exact_trees = target.exact_trees
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

    def constraint(self, sampling: SamplingParams) -> Optional[Constraint]:
        """The request's grammar state, or None when it has no ``guided``."""
        if sampling.guided is None:
            return None
        if self.grammars is None:
            raise RequestError("guided", "this model cannot constrain its output (no vocabulary given "
                                         "to its engine)")
        return self.grammars.compile(sampling.guided)

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
              cancelled: Optional[Callable[[], bool]] = None) -> Generation:
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
