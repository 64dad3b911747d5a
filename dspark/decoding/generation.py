"""One request's speculative decoding loop (``Generation``), split into ``plan`` (propose; the
rows to verify) and ``commit`` (accept, update the caches and the drafter), so that
``dspark.decoding.batching`` can verify several requests' rows in one target call. Its
``engine`` is the ``dspark.decoding.engine.SpeculativeEngine`` that started it."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional

import numpy as np
from numpy.random import default_rng

from dspark._ext import probes
from dspark.decoding.prompt import PREFILL_CHUNK, read_prompt
from dspark.decoding.proposers.base import DraftRequest, Drafter
from dspark.decoding.rejection import verify
from dspark.decoding.sampling import SamplingParams, SpeculativeParams, TokenLogprob, token_logprob
from dspark.decoding.stats import DecodeStats
from dspark.decoding.tree import DraftTree


def forward(lm, cache, tokens, positions, tree_mask: Optional[np.ndarray] = None,
            want_taps: bool = False) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Logits of the new rows and, when asked, their tapped hidden states."""
    if want_taps:
        return lm.forward(cache, tokens, positions, tree_mask=tree_mask, want_taps=True)
    return lm.forward(cache, tokens, positions, tree_mask=tree_mask), None


@dataclass
class VerifyItem:
    """One request's rows of a verify pass (the runtime's ``forward_batch`` item)."""
    cache: object
    tokens: list[int]
    positions: list[int]
    tree_mask: Optional[np.ndarray]


class NewTokens(list):
    """A round's new tokens; ``logprobs``, when the request asked for them, has one
    ``TokenLogprob`` per token; ``last``: the request ended with them."""
    logprobs: Optional[list[TokenLogprob]] = None
    last: bool = False


class Generation:
    """One request's decoding: its target cache, its drafter, its history."""

    def __init__(self, engine, prompt: list[int], sampling: SamplingParams,
                 spec: SpeculativeParams, stats: DecodeStats,
                 cancelled: Optional[Callable[[], bool]]):
        self.engine = engine
        self.sampling, self.stats = sampling, stats
        self.cancelled = cancelled
        self.history = prompt
        self.prompt_length = len(prompt)
        self.proposer = engine.proposers[spec.method]
        self.want_taps = self.proposer.wants_taps
        self.rng = default_rng(sampling.seed)  # the proposers' draws, and unseeded sampling's
        self.constraint = engine.constraint(sampling)  # before any work: a bad grammar is refused
        # a speculating request's guesses are fitted to its grammar (method none stays one token a pass)
        self.steered = self.constraint is not None and spec.method != "none"
        self.cache = engine.target.new_cache(engine.context)
        # greedy and seeded requests pick each token from the target's row: only a runtime whose
        # tree rows equal the chains' (bit for bit) can verify trees for them
        self.chains_only = (sampling.greedy or sampling.seed is not None) and not engine.exact_trees
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
        # a proposer that wants the prompt's taps reads the whole prompt (the cache keeps rows only)
        self.prefix_cache = None if self.want_taps else engine.prefix_cache
        if self.prefix_cache is not None:
            self._reuse_prefix()

    def _reuse_prefix(self) -> None:
        """Copy the cached rows of the longest known prefix of the prompt's rows (all but its
        last token, which each round feeds as the root) into this request's cache."""
        for rows in self.prefix_cache.lookup(self.history[:self.prompt_length - 1]):
            self.cache.write_rows(self.cache.length, rows)
        self._prompt_rows = self.cache.length
        self.stats.cached_prompt_tokens = self.cache.length

    def _keep_prefix(self, rows: int) -> None:
        """Offer the first ``rows`` committed rows of this request to the prefix cache."""
        if self.prefix_cache is not None and self.cache is not None:
            rows = min(rows, self.cache.length, len(self.history))  # never a row past history
            self.prefix_cache.insert(self.history[:rows], self.cache.read_rows)

    @property
    def generated(self) -> int:
        return len(self.history) - self.prompt_length

    def prefill(self) -> None:
        """The target reads everything but the prompt's last token, which each round feeds as
        the root."""
        self._prefill_start = time.perf_counter()
        taps = read_prompt(self.engine.target, self.cache, self.history, self.want_taps,
                           self._prompt_rows)
        self.prompt_read(self.prompt_length - 1 - self._prompt_rows, taps)

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
            self._keep_prefix(self._prompt_rows)

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
        if self.steered and budget > 1 and self.tree.is_chain and not self.tree.q:
            # deterministic guesses only: dropping a drawn one would change what is sampled
            self.tree = DraftTree.chain(self.constraint.steer(self.tree.tokens, min(budget - 1, room)))
        self.stats.draft_s += time.perf_counter() - start
        root = len(history) - 1
        return VerifyItem(self.cache, [history[-1]] + self.tree.tokens,
                          [root] + [root + d for d in self.tree.depths],
                          self.tree.mask() if self.tree.tokens else None)

    def commit(self, logits: np.ndarray, taps: Optional[np.ndarray], target_s: float) -> NewTokens:
        """Accept from this round's pass; return the new tokens."""
        probes.accept_begin(len(self.tree.tokens) + 1)
        base = self.cache.length - len(self.tree.tokens) - 1
        new, path = verify(logits, self.tree, self.sampling, self.rng, self.constraint,
                           self.engine.eos_ids, len(self.history))
        eos = next((i for i, token in enumerate(new) if token in self.engine.eos_ids), None)
        rows = np.array([0] + [n + 1 for n in path])
        self.cache.keep_rows(base, rows)
        self.stats.target_s += target_s
        self.stats.record_pass(self.tree.depth, len(path))
        probes.spec_round(self.tree.depth, len(path), len(self.tree.tokens) + 1)
        self.drafter.verified(self.tree, path, new, taps[rows] if taps is not None else None,
                              target_s)
        if eos is not None:
            new = new[:eos]  # the end-of-sequence token ends the text and is not part of it
        new = NewTokens(new)
        if self.sampling.logprobs is not None:  # new token i came from row rows[i]
            new.logprobs = [token_logprob(logits[row], token, self.sampling.logprobs)
                            for row, token in zip(rows, new)]
        self.history.extend(new)  # the tree's depth kept it within max_tokens
        self.stats.generated_tokens = self.generated
        if eos is not None:
            self.finish("eos")
        elif self.generated >= self.sampling.max_tokens:
            self.finish("length")
        new.last = self.done
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
            if self.prefilled and reason != "error":  # the reply too: a chat's next turn starts so
                # rows below len(history) are committed; past it a round's guesses may lie
                self._keep_prefix(len(self.history))
            self.cache = None  # the runtime's cache slot goes back to its pool now
        return None

    def step(self) -> Optional[NewTokens]:
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
        probes.verify_batch(1, len(item.tokens), seconds)
        return self.commit(logits, taps, seconds)

    def run(self) -> Iterator[NewTokens]:
        """The round loop on this thread: one target call per round."""
        try:
            self.prefill()
            while (new := self.step()) is not None:
                yield new
        finally:
            self.finish("stopped")
