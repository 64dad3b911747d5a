"""``dspark``: DSpark's block drafter (dspark.drafters.dspark.model) with confidence-scheduled
verification (dspark.drafters.dspark.schedule).

Each round the drafter reads the target's tapped hidden states of the rows committed since the
last round (the engine hands them over: ``wants_taps``), drafts a block of k tokens in one pass
after the last committed token, and the schedule keeps the first n of them: the n with the most
expected tokens per second given the block's confidences, the target's measured cost of a pass
over n + 1 rows (``DraftRequest.verify_cost``) and the drafter's own measured cost. Greedy
requests get the drafter's argmax chain; sampled ones a chain drawn from the drafter's
distributions, recorded in the tree for the rejection sampler (lossless). When drafted rounds
stop paying for themselves (fewer tokens per unit of cost than plain decoding, smoothed), the
request decodes plainly for a while, for longer each time, and then tries again. The
rows committed by each round are read into the drafter's context only when it drafts again (one
call over every row since the last draft, counted in the draft's cost), so a round that does not
draft costs what plain decoding does.
"""
from __future__ import annotations

import time
from typing import ClassVar, Optional

import numpy as np

from dspark.drafters.dspark.model import DSparkDrafter
from dspark.drafters.dspark.schedule import CostCurve, DraftGate, choose_verify_length
from dspark.decoding.proposers.base import BaseDrafter, DraftRequest
from dspark.decoding.tree import DraftTree

DRAFT_START_COST = 0.3  # a draft pass relative to a one-row target pass, until measured
STOP_BELOW = 0.05  # stop drafting a block where the drafts so far all hold with less than this
SMOOTHING = 0.2


class DSparkProposer:
    name: ClassVar[str] = "dspark"
    wants_taps: ClassVar[bool] = True

    def __init__(self, drafter: DSparkDrafter):
        self.drafter = drafter

    def start(self, request: DraftRequest) -> "DSparkRequestDrafter":
        return DSparkRequestDrafter(self.drafter, request)


class DSparkRequestDrafter(BaseDrafter):
    """One request: the drafter's context (keys/values of every committed row, the latest
    ones as taps still to be read) and the running costs that the schedule weighs."""

    def __init__(self, drafter: DSparkDrafter, request: DraftRequest):
        self.drafter = drafter
        self.request = request
        self.ctx = drafter.new_context(request.context)
        self.k_max = min(request.spec.num_speculative_tokens, drafter.cfg.block)
        self.draft_cost = DRAFT_START_COST  # draft pass / one-row target pass, smoothed
        self.draft_s = 0.0
        self.lost = False  # a round's taps went missing: no more drafting for this request
        self.gate = DraftGate(SMOOTHING)
        self.pending: list[np.ndarray] = []  # taps of committed rows not in ctx yet

    def prefilled(self, taps: Optional[np.ndarray]) -> None:
        if taps is not None:  # None: a one-token prompt, no rows before the root
            self.drafter.extend(self.ctx, taps)  # the prompt's rows, in one call

    def propose(self, history: list[int], max_depth: int, max_nodes: int) -> DraftTree:
        k = min(self.k_max, max_depth, max_nodes)
        if self.ctx.length + sum(map(len, self.pending)) != len(history) - 1:
            self.lost = True  # never draft from a context that misses committed rows
        if k <= 0 or self.lost:
            return DraftTree()
        if not self.gate.should_draft():
            return DraftTree()
        sampling = self.request.sampling
        start = time.perf_counter()  # reading the pending rows is part of the draft's cost
        if self.pending:
            self.drafter.extend(self.ctx, np.concatenate(self.pending))
            self.pending = []
        proposal = self.drafter.propose(self.ctx, history[-1], k, sampling.temperature,
                                        self.request.rng, want_probs=not sampling.greedy,
                                        stop_below=STOP_BELOW)
        cost = self.request.verify_cost
        curve = CostCurve(tuple(cost(rows) for rows in range(1, k + 2)), self.draft_cost)
        n = choose_verify_length(proposal.confidence, curve)
        tree = DraftTree()
        node = -1
        for j in range(n):
            if proposal.probs is not None:
                tree.q[node] = proposal.probs[j]
            node = tree.add(int(proposal.tokens[j]), node)
        stats = self.request.stats
        stats.draft_calls += 1
        self.draft_s = time.perf_counter() - start
        return tree

    def verified(self, tree: DraftTree, path: list[int], new: list[int],
                 taps: Optional[np.ndarray], target_s: float) -> None:
        if taps is None:
            self.lost = True
            return
        self.pending.append(taps)
        if self.draft_s > 0 and target_s > 0:
            rows_cost = self.request.verify_cost(len(tree) + 1)
            self.draft_cost += SMOOTHING * (self.draft_s / (target_s / rows_cost) - self.draft_cost)
            self.gate.update(len(new), rows_cost, self.draft_cost)
        self.draft_s = 0.0
