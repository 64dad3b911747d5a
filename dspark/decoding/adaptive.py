"""Adaptive draft length: how many tokens a proposer should guess next round, and whether
guessing pays at all."""
from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import numpy as np

from dspark.drafters.dspark.schedule import DraftGate

VerifyCost = Callable[[int], float]  # a target pass over n rows relative to one row (1 row = 1.0)


def expected_rates(rate: float, cost_ratio: float, k_max: int,
                   verify_cost: Optional[VerifyCost] = None) -> np.ndarray:
    """Expected tokens per unit of cost for k = 0 (plain decoding) .. k_max guesses:
    (1 + a + ... + a^k) / (T(k + 1) + k c), for a per-token acceptance rate a (each guess
    survives with a^i), a cost c per guessed token and T(n), the target's cost of a pass over n
    rows (``verify_cost``; without it every pass costs one row's)."""
    rate = min(max(rate, 0.01), 0.99)
    ks = np.arange(k_max + 1)
    rows = np.array([verify_cost(k + 1) for k in ks]) if verify_cost is not None else np.ones(len(ks))
    return (1 - rate ** (ks + 1)) / (1 - rate) / (rows + ks * cost_ratio)


def best_k(rate: float, cost_ratio: float, k_max: int, verify_cost: Optional[VerifyCost] = None) -> int:
    """The k >= 1 of the most expected tokens per unit of cost (see ``expected_rates``)."""
    return int(np.argmax(expected_rates(rate, cost_ratio, k_max, verify_cost)[1:])) + 1


class AdaptiveDraftLength:
    """Running acceptance rate per guessed token and cost per guessed token (relative to a target
    pass), both exponentially smoothed; ``k`` is ``best_k`` of them. With ``adaptive`` off, k
    stays at ``k_max``.

    With ``verify_cost`` (the target's measured cost of a pass by rows) the schedule also weighs
    the rows a guess adds to the pass, and where even the best k is expected to make fewer tokens
    per unit of cost than plain decoding, ``should_draft`` says no for a pause of rounds that
    doubles each time (``gate``, as DSpark's) until a drafted round pays again: rows that are
    dear get few guesses or none, cheap ones many."""

    def __init__(self, k_max: int, cost_ratio: float, adaptive: bool = True,
                 start_rate: float = 0.7, smoothing: float = 0.2,
                 verify_cost: Optional[VerifyCost] = None):
        self.k_max = k_max
        self.k = k_max
        self.rate = start_rate  # optimistic: start by guessing far
        self.cost_ratio = cost_ratio
        self.adaptive = adaptive
        self.smoothing = smoothing
        self.verify_cost = verify_cost
        self.gate = DraftGate()

    def should_draft(self) -> bool:
        """Whether to guess this round (False during a pause, counting it down)."""
        return self.gate.should_draft()

    def update(self, proposed: int, accepted: int, cost_ratio: float | None = None) -> int:
        """After a pass that checked ``proposed`` guesses of this proposer and kept ``accepted``;
        ``cost_ratio``: the cost of one guess relative to that pass, when measured."""
        if proposed and self.adaptive:
            a = self.smoothing
            self.rate = (1 - a) * self.rate + a * accepted / proposed
            if cost_ratio is not None:
                self.cost_ratio = (1 - a) * self.cost_ratio + a * cost_ratio
            rates = expected_rates(self.rate, self.cost_ratio, self.k_max, self.verify_cost)
            self.k = int(np.argmax(rates[1:])) + 1
            if self.verify_cost is not None:
                if rates[self.k] < rates[0]:  # plain decoding is expected to do better
                    self.gate.hold_off()
                else:
                    self.gate.backoff = 1
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
