"""Verification of a draft tree against the target's logits, independent of how the tree was
proposed: greedy and seeded requests accept a draft token iff it is the token plain decoding
emits there (``target_token``); unseeded sampled ones use lossless speculative sampling (the
rejection sampler)."""
from __future__ import annotations

import numpy as np

from dspark.decoding.sampling import SamplingParams, distribution, sample, seeded_token
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


def target_token(row: np.ndarray, sampling: SamplingParams, position: int) -> int | None:
    """The token plain decoding emits at absolute ``position`` from this row of the target's
    logits when that is a function of the row alone: its argmax (greedy), or the Gumbel-max
    sample of a seeded request (noise keyed by seed and position). Verifying a draft against it
    is then exact and the output is independent of the draft. None: an unseeded sampled
    request, whose drafts the rejection sampler accepts (more of a stochastic draft's tokens
    than matching one draw would)."""
    if sampling.greedy:
        return int(np.argmax(row))
    if sampling.seed is not None:
        return seeded_token(distribution(row, sampling), sampling.seed, position)
    return None


def verify(logits: np.ndarray, tree: DraftTree, sampling: SamplingParams,
           rng: np.random.Generator, start: int = 0) -> tuple[list[int], list[int]]:
    """Walk the tree from the root (row 0 of ``logits``, node n in row n + 1): keep the longest
    accepted path and append the target's own token after it. ``start``: the absolute position
    of the first new token. Returns (new tokens, path); new token i comes from the row of the
    path's node i - 1 (the root's for i = 0)."""
    node, path, out = -1, [], []
    while True:
        row = logits[node + 1]
        tok = target_token(row, sampling, start + len(out))
        if tok is not None:
            match = [c for c in tree.children(node) if tree.tokens[c] == tok]
            if not match:
                out.append(tok)
                return out, path
            node = match[0]
        else:
            draws = tree.candidates.get(node, [])
            chosen, resampled = accept_among(distribution(row, sampling), tree.q.get(node),
                                             [tree.tokens[c] for c in draws], rng)
            if chosen < 0:
                out.append(resampled)
                return out, path
            node = draws[chosen]
        path.append(node)
        out.append(tree.tokens[node])
