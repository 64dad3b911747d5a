"""Adaptive draft length: how many tokens a proposer should guess next round."""
from __future__ import annotations

import numpy as np


def best_k(rate: float, cost_ratio: float, k_max: int) -> int:
    """k maximising expected tokens per unit time: (1 - a^(k+1)) / (1 - a) / (1 + k c), for a
    per-token acceptance rate a and a cost c per guessed token relative to a target pass."""
    rate = min(max(rate, 0.01), 0.99)
    ks = np.arange(1, k_max + 1)
    gain = (1 - rate ** (ks + 1)) / (1 - rate) / (1 + ks * cost_ratio)
    return int(ks[np.argmax(gain)])


class AdaptiveDraftLength:
    """Running acceptance rate per guessed token and cost per guessed token (relative to a target
    pass), both exponentially smoothed; ``k`` is ``best_k`` of them. With ``adaptive`` off, k
    stays at ``k_max``."""

    def __init__(self, k_max: int, cost_ratio: float, adaptive: bool = True,
                 start_rate: float = 0.7, smoothing: float = 0.2):
        self.k_max = k_max
        self.k = k_max
        self.rate = start_rate  # optimistic: start by guessing far
        self.cost_ratio = cost_ratio
        self.adaptive = adaptive
        self.smoothing = smoothing

    def update(self, proposed: int, accepted: int, cost_ratio: float | None = None) -> int:
        """After a pass that checked ``proposed`` guesses of this proposer and kept ``accepted``;
        ``cost_ratio``: the cost of one guess relative to that pass, when measured."""
        if proposed and self.adaptive:
            a = self.smoothing
            self.rate = (1 - a) * self.rate + a * accepted / proposed
            if cost_ratio is not None:
                self.cost_ratio = (1 - a) * self.cost_ratio + a * cost_ratio
            self.k = best_k(self.rate, self.cost_ratio, self.k_max)
        return self.k


def best_prefix(scores: list[float], verify_cost) -> int:
    """How many guesses to verify, given each guess's chance of being accepted (``scores``, in
    the order they would be added, each at most its predecessor's on its path) and the target's
    cost of a pass over n rows (``verify_cost(n)``, 1 row = 1.0): the n maximising expected
    tokens per pass, (1 + sum of the first n scores), per unit of pass cost."""
    best_n, best_rate, expected = 0, 1.0 / verify_cost(1), 1.0
    for n, score in enumerate(scores, start=1):
        expected += score
        rate = expected / verify_cost(n + 1)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n
