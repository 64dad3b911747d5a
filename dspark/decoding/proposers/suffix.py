"""``suffix`` (SuffixDecoding, arXiv 2411.04975; vLLM's ``suffix`` method): model-free guesses
from two indexes, one over this request's prompt and output, one over this model's earlier
outputs (a bounded, shared cache). The longest suffix of the text that occurred before selects
the continuations that followed it; counted as a tree, their frequencies score each node (the
share of continuations that pass through it), and the tree keeps the best-scoring nodes while
they pay for their rows in the target's pass. The guess is longer the longer the match
(at most ``max_spec_factor`` x match length), as in the paper.

The paper's suffix trees are replaced by vectorised matching over numpy token arrays: the same
matches and counts, no per-token tree updates in Python."""
from __future__ import annotations

import threading
from collections import deque
from typing import ClassVar, Optional

import numpy as np

from dspark.decoding.adaptive import best_prefix
from dspark.decoding.proposers.base import BaseDrafter, DraftRequest
from dspark.decoding.tree import DraftTree

SEPARATOR = -1  # between documents in a store; never matches a token


class TokenStore:
    """Token sequences in one growing array, searchable for earlier occurrences of a suffix."""

    def __init__(self, capacity: int = 1024):
        self._data = np.full(max(capacity, 16), SEPARATOR, np.int64)
        self.length = 0

    @property
    def tokens(self) -> np.ndarray:
        return self._data[:self.length]

    def extend(self, tokens) -> None:
        tokens = np.asarray(tokens, np.int64)
        need = self.length + len(tokens)
        if need > len(self._data):
            grown = np.full(max(need, 2 * len(self._data)), SEPARATOR, np.int64)
            grown[:self.length] = self._data[:self.length]
            self._data = grown
        self._data[self.length:need] = tokens
        self.length = need

    def continuations(self, pattern: np.ndarray, max_match: int, min_match: int, depth: int,
                      max_hits: int, exclude_end: bool) -> tuple[int, list[np.ndarray]]:
        """(m, continuations): the longest m <= ``max_match`` such that the last m tokens of
        ``pattern`` occur in the store followed by at least one token, and the up to ``depth``
        tokens after its latest ``max_hits`` occurrences. ``exclude_end``: the pattern is the
        store's own end, which does not count as an earlier occurrence."""
        data = self.tokens
        limit = len(data) - 1 if exclude_end else len(data)
        if limit <= 0 or len(pattern) == 0:
            return 0, []
        ends = np.flatnonzero(data[:limit] == pattern[-1])  # positions where a match ends
        ends = ends[ends + 1 < len(data)]
        m = 1
        while len(ends) and m < min(max_match, len(pattern)):
            prev = ends - m
            ok = prev >= 0
            ok[ok] = data[prev[ok]] == pattern[-1 - m]
            if not ok.any():
                break
            ends, m = ends[ok], m + 1
        if not len(ends) or m < min_match:
            return 0, []
        out = []
        for end in ends[-max_hits:]:
            cont = data[end + 1:end + 1 + depth]
            stop = np.flatnonzero(cont == SEPARATOR)
            cont = cont[:stop[0]] if len(stop) else cont
            if len(cont):
                out.append(cont)
        return (m, out) if out else (0, [])


class OutputCache:
    """This model's recent outputs, at most ``max_tokens`` tokens in all (oldest dropped first);
    shared by all requests, so the store is rebuilt on change and searched without a lock."""

    def __init__(self, max_tokens: int = 65536):
        self.max_tokens = max_tokens
        self._outputs: deque[np.ndarray] = deque()
        self._total = 0
        self._lock = threading.Lock()
        self.store = TokenStore()

    def add(self, output: list[int]) -> None:
        if not output or self.max_tokens <= 0:
            return
        with self._lock:
            self._outputs.append(np.asarray(output[-self.max_tokens:], np.int64))
            self._total += len(self._outputs[-1])
            while self._total > self.max_tokens:
                self._total -= len(self._outputs.popleft())
            store = TokenStore(self._total + len(self._outputs))
            for tokens in self._outputs:
                store.extend(tokens)
                store.extend([SEPARATOR])
            self.store = store  # an atomic swap: readers keep the store they took

    def __len__(self) -> int:
        return self._total


def frequency_tree(continuations: list[np.ndarray], max_nodes: int, min_score: float,
                   verify_cost) -> tuple[DraftTree, float]:
    """The continuations counted as a tree; each node scored by the share of continuations
    through it; the best nodes kept (best first, so a kept node's parent is kept) down to
    ``min_score`` and while they pay for their rows. Returns (tree, sum of kept scores)."""
    counts: dict[tuple, int] = {}
    for cont in continuations:
        for d in range(1, len(cont) + 1):
            key = tuple(int(t) for t in cont[:d])
            counts[key] = counts.get(key, 0) + 1
    total = len(continuations)
    ranked = sorted(((c / total, -len(k), k) for k, c in counts.items() if c / total >= min_score),
                    reverse=True)
    chosen = ranked[:max_nodes]
    scores = [s for s, _, _ in chosen]
    keep = best_prefix(scores, verify_cost)
    tree = DraftTree()
    for _, _, key in sorted(chosen[:keep], key=lambda item: len(item[2])):
        tree.add_path(key)
    return tree, sum(scores[:keep])


class SuffixProposer:
    name: ClassVar[str] = "suffix"
    wants_taps: ClassVar[bool] = False

    def __init__(self, cache: Optional[OutputCache] = None, max_match: int = 16, min_match: int = 1,
                 max_spec_factor: float = 1.0, min_score: float = 0.1, max_hits: int = 64):
        self.cache = cache if cache is not None else OutputCache()
        self.max_match, self.min_match = max_match, min_match
        self.max_spec_factor, self.min_score, self.max_hits = max_spec_factor, min_score, max_hits

    def start(self, request: DraftRequest) -> "SuffixDrafter":
        return SuffixDrafter(self, request)


class SuffixDrafter(BaseDrafter):
    def __init__(self, proposer: SuffixProposer, request: DraftRequest):
        self.p = proposer
        self.request = request
        self.own = TokenStore(len(request.prompt) + request.sampling.max_tokens + 1)
        self.own.extend(request.prompt)
        self.prompt_length = len(request.prompt)
        self.score = 0.0  # expected accepted guesses of this round's tree

    def propose(self, history: list[int], max_depth: int, max_nodes: int) -> DraftTree:
        p, spec = self.p, self.request.spec
        if self.own.length < len(history):
            self.own.extend(history[self.own.length:])
        pattern = self.own.tokens[-p.max_match:]
        best = (DraftTree(), 0.0)
        for store, own in ((self.own, True), (p.cache.store, False)):
            m, conts = store.continuations(pattern, p.max_match, p.min_match,
                                           min(spec.num_speculative_tokens, max_depth), p.max_hits,
                                           exclude_end=own)
            if not m:
                continue
            depth = min(spec.num_speculative_tokens, max_depth, max(1, int(p.max_spec_factor * m)))
            conts = [c[:depth] for c in conts]
            found = frequency_tree(conts, min(max_nodes, spec.num_speculative_tokens * spec.tree_width),
                                   p.min_score, self.request.verify_cost)
            if found[1] > best[1]:
                best = found
        tree, self.score = best
        return tree

    def finish(self, output: list[int]) -> None:
        self.p.cache.add(output)
