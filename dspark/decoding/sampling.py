"""Sampling parameters, the logits -> distribution transform and lossless acceptance rules."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dspark.errors import RequestError

METHODS = ("none", "draft", "ngram", "hybrid", "tree")


@dataclass
class SpeculativeParams:
    method: str = "tree"
    num_speculative_tokens: int = 4  # draft/ngram/hybrid: k (the start and upper bound when adaptive); tree: depth
    tree_width: int = 4
    adaptive: bool = True

    def validate(self) -> "SpeculativeParams":
        if self.method not in METHODS:
            raise RequestError("speculative.method", f"{self.method!r} is not one of {METHODS}")
        if not 1 <= int(self.num_speculative_tokens) <= 16:
            raise RequestError("speculative.num_speculative_tokens", "must be in 1..16")
        if not 1 <= int(self.tree_width) <= 8:
            raise RequestError("speculative.tree_width", "must be in 1..8")
        return self


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

    def validate(self) -> "SamplingParams":
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError("max_tokens", "must be an integer >= 1")
        if not 0.0 <= float(self.temperature) <= 10.0:
            raise RequestError("temperature", "must be in [0, 10]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError("top_k", "must be an integer >= 0")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise RequestError("top_p", "must be in (0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise RequestError("seed", "must be a non-negative integer")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError("stop", "must be a list of non-empty strings")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The sampling distribution (float64) after temperature, top-k and top-p."""
    z = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < len(z):
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = np.cumsum(p[order]) - p[order] < params.top_p  # smallest set reaching top_p
        mask = np.zeros_like(p, bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    return int(min(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right"), len(p) - 1))


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)): where to resample after rejecting a draft drawn from q."""
    r = np.maximum(p - q, 0.0)
    total = r.sum()
    return r / total if total > 0 else p


def accept_among(p: np.ndarray, q: np.ndarray | None, candidates: list[int],
                 rng: np.random.Generator) -> tuple[int, int | None]:
    """Lossless choice among draft ``candidates`` drawn i.i.d. from ``q`` (None: q is one-hot on
    each candidate, as for prompt lookup). Returns (index of the accepted candidate or -1,
    the token sampled from the residual when all were rejected).

    Each candidate is accepted with min(1, p/q); on rejection p becomes norm(max(0, p - q)), so
    the emitted token is distributed exactly as p (the rule of speculative sampling, applied
    recursively over the candidates of a tree node).
    """
    for i, tok in enumerate(candidates):
        qi = q if q is not None else np.eye(1, len(p), tok)[0]
        if qi[tok] > 0 and rng.random() * qi[tok] < p[tok]:
            return i, None
        p = residual(p, qi)
    return -1, sample(p, rng)
