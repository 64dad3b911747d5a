"""``draft``: a small draft LM (same tokenizer as the target) proposes a chain of k tokens, one
draft step per token, k (0: plain decoding for a while) chosen from the measured acceptance, the
draft's cost and the target's cost of a pass by rows (``adaptive.AdaptiveDraftLength``)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import ClassVar, Optional

import numpy as np

from dspark.decoding.adaptive import AdaptiveDraftLength
from dspark.decoding.prompt import read_prompt
from dspark.decoding.proposers.base import BaseDrafter, DraftRequest, agreed
from dspark.decoding.sampling import distribution, sample, sample_at, seeded_uniform
from dspark.decoding.tree import DraftTree

# A chain stops after a token the draft itself gives less than this probability: the next guess
# would likely be rejected. It depends on the draft alone, so it changes no output.
DRAFT_MIN_CONFIDENCE = 0.15
DRAFT_START_COST = 0.25  # a draft step per one-row target pass, before it is measured


class Background:
    """``fn(*args)`` on a thread; ``wait`` joins it and re-raises its error."""

    def __init__(self, fn: Callable[..., None], *args) -> None:
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., None], *args) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # handed to the waiting thread
            self._error = exc

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


class DraftModelProposer:
    name: ClassVar[str] = "draft"
    wants_taps: ClassVar[bool] = False

    def __init__(self, lm, min_confidence: float = DRAFT_MIN_CONFIDENCE):
        self.lm = lm
        self.min_confidence = min_confidence

    def start(self, request: DraftRequest) -> "DraftModelDrafter":
        return DraftModelDrafter(self.lm, request, self.min_confidence)


class DraftModelDrafter(BaseDrafter):
    """The draft's own KV cache for one request. It reads the prompt on a thread while the target
    does (ORT and the C kernel release the GIL), so the draft prefill hides behind the target's."""

    def __init__(self, lm, request: DraftRequest, min_confidence: float):
        self.lm = lm
        self.request = request
        self.min_confidence = min_confidence
        self.cache = lm.new_cache(request.context)
        self._prefill: Optional[Background] = Background(read_prompt, lm, self.cache, request.prompt)
        self.length = AdaptiveDraftLength(request.spec.num_speculative_tokens, DRAFT_START_COST,
                                          request.spec.adaptive, verify_cost=request.verify_cost)
        self.rows: dict[int, int] = {}  # node -> row of the draft cache, this round
        self.chain: list[int] = []  # the draft's own first-choice chain, this round
        self.committed = 0
        self.seconds = 0.0

    def _catch_up(self, history: list[int]) -> np.ndarray:
        """Feed the draft what was committed since it last drafted; the logits after the root."""
        if self._prefill is not None:
            self._prefill.wait()
            self._prefill = None
        cache = self.cache
        logits = self.lm.forward(cache, history[cache.length:], np.arange(cache.length, len(history)))
        self.request.stats.draft_calls += 1
        self.committed = cache.length
        self.rows = {}
        return logits[-1:]

    def propose(self, history: list[int], max_depth: int, max_nodes: int) -> DraftTree:
        start = time.perf_counter()
        # a pause of the schedule (drafting did not pay): plain decoding, the draft catches up later
        depth = min(self.length.k, max_depth, max_nodes) if self.length.should_draft() else 0
        tree = DraftTree()
        if depth > 0:
            self._draft_chain(tree, history, depth)
        self.chain = tree.tokens[:]
        self.seconds = time.perf_counter() - start
        return tree

    def _draft_chain(self, tree: DraftTree, history: list[int], depth: int) -> None:
        sampling, cache = self.request.sampling, self.cache
        logits = self._catch_up(history)[0]
        root_pos = len(history) - 1
        node = -1
        for level in range(1, depth + 1):
            if level > 1:
                logits = self.lm.forward(cache, [tree.tokens[node]], [root_pos + level - 1])[0]
                self.request.stats.draft_calls += 1
                self.rows[node] = cache.length - 1
            if sampling.greedy:
                token = int(np.argmax(logits))
                confidence = 1.0 / float(np.exp(logits - logits[token]).sum())
            else:
                q = distribution(logits, sampling)
                # seeded: the draw the target's token at this position comes from, so the two
                # agree wherever their distributions are alike
                token = sample(q, self.request.rng) if sampling.seed is None else \
                    sample_at(q, seeded_uniform(sampling.seed, root_pos + level))
                tree.q[node] = q
                confidence = float(q.max())
            node = tree.add(token, node)
            if confidence < self.min_confidence:
                break  # go no deeper than a token the draft itself doubts

    def verified(self, tree: DraftTree, path: list[int], new: list[int],
                 taps: Optional[np.ndarray], target_s: float) -> None:
        """Keep the draft rows of the accepted path; rows never fed are caught up next round."""
        if not self.chain:  # nothing drafted this round: the cache is as it was
            return
        rows = []
        for node in path:
            if node not in self.rows:
                break
            rows.append(self.rows[node] - self.committed)
        self.cache.keep_rows(self.committed, np.array(rows, dtype=np.int64))
        self.rows = {}
        # a draft step relative to a one-row target pass (the pass verified len(tree) + 1 rows)
        cost = (self.seconds / len(self.chain) / target_s * self.request.verify_cost(len(tree) + 1)
                if target_s > 0 else None)
        self.length.update(len(self.chain), agreed(self.chain, new), cost)
        self.chain = []

    def finish(self, output: list[int]) -> None:
        if self._prefill is not None:
            self._prefill.wait()
            self._prefill = None
