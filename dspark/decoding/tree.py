"""A tree of draft tokens below the last committed token; a chain is a tree of width 1."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class DraftTree:
    """Draft tokens below the root (the last committed token, row 0 of the verify pass).

    ``candidates[node]`` lists node's children in the order they were drawn, a child once per
    draw (sampled trees draw i.i.d., so a token can be drawn twice); ``q[node]`` is the proposal
    distribution its children were drawn from (absent: a deterministic proposal, e.g. a lookup).
    """
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1 = root
    depths: list[int] = field(default_factory=list)  # 1 = child of root
    candidates: dict[int, list[int]] = field(default_factory=dict)  # node (-1 = root) -> draws
    q: dict[int, np.ndarray] = field(default_factory=dict)

    @classmethod
    def chain(cls, tokens) -> "DraftTree":
        tree = cls()
        tree.add_path(tokens)
        return tree

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    def add(self, token: int, parent: int) -> int:
        """A child ``token`` of ``parent`` (a repeated draw of an existing child counts again)."""
        for child in self.candidates.get(parent, []):
            if self.tokens[child] == token:
                self.candidates[parent].append(child)
                return child
        node = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.candidates.setdefault(parent, []).append(node)
        return node

    def add_path(self, tokens, parent: int = -1) -> list[int]:
        """Nodes of ``tokens`` as a path below ``parent``, sharing the nodes that exist."""
        nodes = []
        for token in tokens:
            existing = [c for c in self.children(parent) if self.tokens[c] == token]
            parent = existing[0] if existing else self.add(token, parent)
            nodes.append(parent)
        return nodes

    def graft(self, other: "DraftTree") -> None:
        """Add ``other``'s nodes below this root, merged where the tokens agree (greedy
        verification only: the merged node's proposal distribution is not kept)."""
        mapping = {-1: -1}
        for node, (token, parent) in enumerate(zip(other.tokens, other.parents)):
            mapping[node] = self.add_path([token], mapping[parent])[0]

    def children(self, node: int) -> list[int]:
        return list(dict.fromkeys(self.candidates.get(node, [])))

    def ancestors(self, node: int) -> list[int]:
        """Path from the root's child to ``node`` (inclusive)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def path_tokens(self, path: list[int]) -> list[int]:
        return [self.tokens[n] for n in path]

    def mask(self) -> np.ndarray:
        """(1 + n) x (1 + n) visibility of the verify pass: row 0 is the root."""
        m = np.eye(len(self.tokens) + 1, dtype=bool)
        for i, parent in enumerate(self.parents):  # a parent's row is always filled first
            m[i + 1] |= m[parent + 1]
        return m
