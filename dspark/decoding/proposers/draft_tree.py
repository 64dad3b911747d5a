"""``tree``: the draft LM expands up to ``tree_width`` branches per level (one draft call per
level, depth ``num_speculative_tokens``) and the target verifies every node in one pass."""
from __future__ import annotations

import time
from typing import ClassVar

import numpy as np

from dspark.decoding.proposers.base import DraftRequest
from dspark.decoding.proposers.draft_model import (DraftModelDrafter,
                                                   DraftModelProposer)
from dspark.decoding.sampling import distribution, sample
from dspark.decoding.tree import DraftTree

# Greedy trees add a side branch only where the draft gives its path at least this probability:
# every node is a row of the target's pass.
LOG_MIN_PATH_PROB = float(np.log(0.05))


class DraftTreeProposer(DraftModelProposer):
    name: ClassVar[str] = "tree"

    def start(self, request: DraftRequest) -> "DraftTreeDrafter":
        return DraftTreeDrafter(self.lm, request, self.min_confidence)


class DraftTreeDrafter(DraftModelDrafter):
    """Greedy: a beam of the ``width`` best paths by draft log-probability, level by level, that
    always keeps the draft's own argmax chain (so the tree never accepts less than the chain).
    Sampled: ``width`` chains drawn i.i.d. from the draft, merged where they agree, so every
    node's candidates are i.i.d. draws, as lossless tree verification needs. The depth is fixed."""

    def propose(self, history: list[int], max_depth: int, max_nodes: int) -> DraftTree:
        start = time.perf_counter()
        width = self.request.spec.tree_width
        depth = min(self.request.spec.num_speculative_tokens, max_depth, max_nodes // width)
        tree = DraftTree()
        if depth > 0:
            self._draft_tree(tree, history, depth, width)
        self.seconds = time.perf_counter() - start
        return tree

    def _draft_tree(self, tree: DraftTree, history: list[int], depth: int, width: int) -> None:
        sampling, cache, stats = self.request.sampling, self.cache, self.request.stats
        logits = self._catch_up(history)
        root_pos = len(history) - 1
        frontier, chain_node, scores = [-1], -1, {-1: 0.0}
        chains: list[int] = []
        for level in range(1, depth + 1):
            if level > 1:
                past = None  # rows fed so far form one chain: all are ancestors of every node
                if len(self.rows) > level - 2:
                    past = np.zeros((len(frontier), cache.length), bool)
                    past[:, :self.committed] = True
                    for r, node in enumerate(frontier):
                        past[r, [self.rows[a] for a in tree.ancestors(node)[:-1]]] = True
                base = cache.length
                logits = self.lm.forward(cache, [tree.tokens[n] for n in frontier],
                                         [root_pos + tree.depths[n] for n in frontier],
                                         tree_mask=np.eye(len(frontier), dtype=bool),
                                         past_visible=past)
                stats.draft_calls += 1
                for r, node in enumerate(frontier):
                    self.rows[node] = base + r
            if sampling.greedy:
                options = []
                for r, node in enumerate(frontier):
                    row = logits[r]
                    top = np.argpartition(-row, min(width, len(row)) - 1)[:width]
                    lse = row.max() + np.log(np.exp(row - row.max()).sum())
                    options += [(scores[node] + float(row[tok] - lse), node, int(tok)) for tok in top]
                options.sort(key=lambda o: -o[0])
                chain = max((o for o in options if o[1] == chain_node), key=lambda o: o[0])
                options = [chain] + [o for o in options if o is not chain and o[0] >= LOG_MIN_PATH_PROB]
                frontier = []
                for score, node, tok in options[:width]:
                    child = tree.add(tok, node)
                    scores[child] = score
                    frontier.append(child)
                chain_node = frontier[0]
            else:
                dists = {node: distribution(logits[r], sampling) for r, node in enumerate(frontier)}
                tree.q.update(dists)
                if level == 1:
                    chains = [tree.add(sample(dists[-1], self.request.rng), -1) for _ in range(width)]
                else:
                    chains = [tree.add(sample(dists[c], self.request.rng), c) for c in chains]
                frontier = list(dict.fromkeys(chains))
                chain_node = chains[0]
        self.chain = tree.path_tokens(tree.ancestors(chain_node))


