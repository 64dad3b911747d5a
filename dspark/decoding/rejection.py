"""Verification of a draft tree against the target's logits: greedy acceptance and lossless
speculative sampling (the rejection sampler), independent of how the tree was proposed."""
from __future__ import annotations

import numpy as np

from dspark.decoding.constraint import Constraint, apply_mask
from dspark.decoding.sampling import SamplingParams, distribution, sample
from dspark.decoding.tree import DraftTree


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)): where to resample after rejecting a draft drawn from q."""
    r = np.maximum(p - q, 0.0)
    total = r.sum()
    return r / total if total > 0 else p


def accept_among(p: np.ndarray, q: np.ndarray | None, candidates: list[int],
                 rng: np.random.Generator) -> tuple[int, int | None]:
    """Lossless choice among draft ``candidates`` drawn i.i.d. from ``q`` (None: each candidate
    is a deterministic proposal, q one-hot on it, as for prompt lookup). Returns (index of the
    accepted candidate or -1, the token sampled from the residual when all were rejected).

    Each candidate is accepted with min(1, p/q); on rejection p becomes norm(max(0, p - q)), so
    the emitted token is distributed exactly as p (the rule of speculative sampling, applied
    recursively over the candidates of a tree node).
    """
    for i, tok in enumerate(candidates):
        if q is None:
            if rng.random() < p[tok]:
                return i, None
            p = p.copy()
            p[tok] = 0.0
            total = p.sum()
            p = p / total if total > 0 else p
            continue
        if q[tok] > 0 and rng.random() * q[tok] < p[tok]:
            return i, None
        p = residual(p, q)
    return -1, sample(p, rng)


def verify(logits: np.ndarray, tree: DraftTree, sampling: SamplingParams,
           rng: np.random.Generator, constraint: Constraint | None = None) -> tuple[list[int], list[int]]:
    """Walk the tree from the root (row 0 of ``logits``, node n in row n + 1): keep the longest
    accepted path and append the target's own token after it. Returns (new tokens, path).

    With a ``constraint`` each row on the walk is masked by the grammar's state after the path
    to it (the constraint consumes each token as it is accepted), so a draft token the grammar
    forbids is rejected and the added token is drawn from the masked distribution."""
    node, path, out = -1, [], []
    while True:
        row = logits[node + 1]
        if constraint is not None:
            row = apply_mask(row, constraint.mask(len(row)))
        if sampling.greedy:
            tok = int(np.argmax(row))
            match = [c for c in tree.children(node) if tree.tokens[c] == tok]
            if not match:
                out.append(tok)
                break
            node = match[0]
        else:
            draws = tree.candidates.get(node, [])
            chosen, resampled = accept_among(distribution(row, sampling), tree.q.get(node),
                                             [tree.tokens[c] for c in draws], rng)
            if chosen < 0:
                out.append(resampled)
                break
            node = draws[chosen]
        path.append(node)
        out.append(tree.tokens[node])
        if constraint is not None:
            constraint.consume(out[-1])
    if constraint is not None:
        constraint.consume(out[-1])
    return out, path
