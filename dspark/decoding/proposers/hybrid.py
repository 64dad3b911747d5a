"""``hybrid``: a model-based proposer (the draft LM, or DSpark's block drafter) and a lookup
(prompt lookup or suffix) together. Greedy: both proposals go into one tree, merged where they
agree, and one target pass keeps whichever agrees longer; the lookup is only there when it has a
match it trusts (prompt lookup: at least 2 tokens), so a pass pays for its rows only where the
text repeats. Sampled: the lookup where it has a match, the model otherwise (the rejection rule
needs one proposer per node)."""
from __future__ import annotations

from typing import ClassVar, Optional

import numpy as np

from dspark.decoding.proposers.base import BaseDrafter, DraftRequest, Drafter, Proposer
from dspark.decoding.tree import DraftTree


class HybridProposer:
    name: ClassVar[str] = "hybrid"

    def __init__(self, model: Proposer, lookup: Proposer):
        self.model = model
        self.lookup = lookup

    @property
    def wants_taps(self) -> bool:
        return self.model.wants_taps or self.lookup.wants_taps

    def start(self, request: DraftRequest) -> "HybridDrafter":
        return HybridDrafter(self.model.start(request), self.lookup.start(request),
                             request.sampling.greedy)


class HybridDrafter(BaseDrafter):
    def __init__(self, model: Drafter, lookup: Drafter, greedy: bool):
        self.model, self.lookup, self.greedy = model, lookup, greedy
        self.used: list[Drafter] = []

    def prefilled(self, taps: Optional[np.ndarray]) -> None:
        self.model.prefilled(taps)
        self.lookup.prefilled(taps)

    def propose(self, history: list[int], max_depth: int, max_nodes: int) -> DraftTree:
        looked = self.lookup.propose(history, max_depth, max_nodes // 2)
        if looked.tokens and not self.greedy:
            self.used = [self.lookup]
            return looked
        tree = self.model.propose(history, max_depth, max_nodes - len(looked))
        self.used = [self.model, self.lookup] if looked.tokens else [self.model]
        tree.graft(looked)
        return tree

    def verified(self, tree: DraftTree, path: list[int], new: list[int],
                 taps: Optional[np.ndarray], target_s: float) -> None:
        for drafter in self.used:
            drafter.verified(tree, path, new, taps, target_s)
        if self.model not in self.used and taps is not None:
            # a drafter that reads the target's taps (DSpark) needs every committed row's
            self.model.verified(DraftTree(), [], new, taps, target_s)
        self.used = []

    def finish(self, output: list[int]) -> None:
        self.model.finish(output)
        self.lookup.finish(output)
