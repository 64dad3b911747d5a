"""``ngram`` (prompt lookup): the tokens that followed the latest earlier occurrence of the last
n tokens of prompt + output (n from ``max_ngram`` down to ``min_ngram``); no model."""
from __future__ import annotations

from typing import ClassVar, Optional

import numpy as np

from dspark.decoding.adaptive import AdaptiveDraftLength
from dspark.decoding.proposers.base import BaseDrafter, DraftRequest, agreed
from dspark.decoding.tree import DraftTree

# A lookup's own cost per guess, relative to a target pass (a numpy search of the history); the
# row each guess adds to the pass is priced by the target's measured cost (``verify_cost``).
LOOKUP_COST = 0.01


def lookup(history: list[int], depth: int, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """The up to ``depth`` tokens after the latest earlier match of the longest suffix of
    ``history`` (``max_ngram`` tokens down to ``min_ngram``); [] without a match."""
    h = np.asarray(history)
    for n in range(min(max_ngram, len(h) - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(h[:-1], n)
        hits = np.flatnonzero((windows == h[-n:]).all(axis=1))
        if len(hits):
            start = hits[-1] + n
            return [int(t) for t in h[start:start + depth]]
    return []


class PromptLookupProposer:
    name: ClassVar[str] = "ngram"
    wants_taps: ClassVar[bool] = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def start(self, request: DraftRequest) -> "PromptLookupDrafter":
        return PromptLookupDrafter(request, self.max_ngram, self.min_ngram)


class PromptLookupDrafter(BaseDrafter):
    def __init__(self, request: DraftRequest, max_ngram: int, min_ngram: int):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        # the target's measured cost of a pass by rows: where rows are dear and lookups rarely
        # right, guessing pauses (plain decoding) until a guessed round pays again
        self.length = AdaptiveDraftLength(request.spec.num_speculative_tokens, LOOKUP_COST,
                                          request.spec.adaptive, verify_cost=request.verify_cost)
        self.chain: list[int] = []

    def propose(self, history: list[int], max_depth: int, max_nodes: int) -> DraftTree:
        depth = min(self.length.k, max_depth, max_nodes) if self.length.should_draft() else 0
        self.chain = lookup(history, depth, self.max_ngram, self.min_ngram) if depth > 0 else []
        return DraftTree.chain(self.chain)

    def verified(self, tree: DraftTree, path: list[int], new: list[int],
                 taps: Optional[np.ndarray], target_s: float) -> None:
        if self.chain:
            self.length.update(len(self.chain), agreed(self.chain, new))
        self.chain = []
