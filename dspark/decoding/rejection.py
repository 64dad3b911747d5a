"""Verification of a draft tree against the target's logits: greedy acceptance and lossless
speculative sampling (the rejection sampler), independent of how the tree was proposed."""
from __future__ import annotations

from typing import Optional

import numpy as np

from dspark.decoding.constraint import Constraint
from dspark.decoding.sampling import SamplingParams, distribution, sample, sample_at, seeded_uniform
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


def _greedy_token(row: np.ndarray, constraint: Optional[Constraint]) -> int:
    """The row's best token the grammar allows. When the row's best is allowed it is the masked
    row's best too, and checking one token costs less than the mask."""
    tok = int(np.argmax(row))
    if constraint is not None and not constraint.allows(tok):
        tok = int(np.argmax(constraint.mask(row)))
    return tok


def _drawn_token(row: np.ndarray, sampling: SamplingParams, constraint: Optional[Constraint],
                 rng: np.random.Generator, position: int) -> int:
    """A token drawn from the row's sampling distribution under the grammar: by inverse CDF at
    ``seeded_uniform(seed, position)`` for a seeded request, else from ``rng``.

    Without top-k and top-p, the masked distribution is the row's distribution restricted to
    the allowed tokens, so a draw from the whole row that the grammar allows is a draw from it
    (rejection sampling): only when the draw is forbidden is the mask computed and a second,
    independent draw made under it. Top-k and top-p pick their tokens among the allowed ones,
    so they always mask first."""
    def draw(p: np.ndarray, stream: int) -> int:
        if sampling.seed is None:
            return sample(p, rng)
        return sample_at(p, seeded_uniform(sampling.seed, position, stream))

    mask_first = constraint is not None and (sampling.top_k or sampling.top_p < 1.0)
    tok = draw(distribution(constraint.mask(row) if mask_first else row, sampling), 0)
    if constraint is None or mask_first or constraint.allows(tok):
        return tok
    return draw(distribution(constraint.mask(row), sampling), 1)


def verify(logits: np.ndarray, tree: DraftTree, sampling: SamplingParams,
           rng: np.random.Generator, constraint: Optional[Constraint] = None,
           eos_ids: frozenset[int] = frozenset(), position: int = 0) -> tuple[list[int], list[int]]:
    """Walk the tree from the root (row 0 of ``logits``, node n in row n + 1): keep the longest
    accepted path and append the target's own token after it; an end of sequence (``eos_ids``)
    ends the walk. Returns (new tokens, path).

    With a ``constraint``, each row walked is masked by the grammar's state after the tokens
    chosen before it, and the grammar advances by each token chosen: a draft token the grammar
    forbids has probability 0 and is rejected, and the bonus token is drawn under the mask.

    A seeded sampled request (``sampling.seed``) draws the token at each sequence position
    (``position``: the root's token's) from ``seeded_uniform(seed, position)`` by inverse CDF,
    as plain sampling does, and accepts a guess only if it is that token: the text is plain
    sampling's for that seed whatever was proposed, and exactly distributed as the target's
    sampling distribution (the draw is uniform). An unseeded request draws from ``rng`` and takes
    the guess that is its token, or, where the draft model drew the guesses (``tree.q``), uses
    the rejection sampler, which accepts more of them."""
    node, path, out = -1, [], []
    while True:
        row = logits[node + 1]
        q = tree.q.get(node)
        if sampling.greedy or sampling.seed is not None or q is None:
            tok = _greedy_token(row, constraint) if sampling.greedy else \
                _drawn_token(row, sampling, constraint, rng, position + len(out))
            match = [c for c in tree.children(node) if tree.tokens[c] == tok]
            child = match[0] if match else None
        else:
            if constraint is not None:
                row = constraint.mask(row)
            draws = tree.candidates.get(node, [])
            chosen, tok = accept_among(distribution(row, sampling), q, [tree.tokens[c] for c in draws], rng)
            child = draws[chosen] if chosen >= 0 else None
            tok = tree.tokens[child] if child is not None else tok
        out.append(tok)
        if tok in eos_ids:  # the end: an accepted end-of-sequence counts as the last token
            return out, path
        if constraint is not None:
            constraint.advance(tok)
        if child is None:
            return out, path
        node = child
        path.append(node)
