"""Confidence-scheduled verification (DSpark): how many draft rows to verify, per round.

The drafter's confidence head gives, for each block position j, the probability c_j that the
target accepts draft j given that drafts 1..j-1 were accepted. Verifying the first n drafts
costs one target pass over n + 1 rows (the anchor plus n drafts) and yields on average

    E(n) = 1 + c_1 + c_1 c_2 + ... + c_1 ... c_n        tokens (the +1: the target's own token).

On a CPU the cost of a pass grows with its rows (ORT int4, SmolLM2: 8 rows ~ 2x one row), so
the policy picks n maximising E(n) / (T(n + 1) + T_draft), with T the measured cost curve: tokens
per second of this round. A flat curve (a GPU) gives "verify everything with c > 0"; a steep
one verifies only the confident prefix.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from dspark.errors import ConfigError


@dataclass(frozen=True)
class CostCurve:
    """``seconds[i]``: one target pass over ``i + 1`` new rows; ``draft_seconds``: one draft
    pass (paid whatever n is chosen)."""
    seconds: tuple[float, ...]
    draft_seconds: float = 0.0

    def __post_init__(self):
        s = np.asarray(self.seconds, dtype=float)
        if s.ndim != 1 or s.size == 0 or not np.all(np.isfinite(s)) or np.any(s <= 0):
            raise ConfigError("cost_curve", f"needs positive seconds per row count, got {self.seconds}")
        if not (np.isfinite(self.draft_seconds) and self.draft_seconds >= 0):
            raise ConfigError("draft_seconds", f"{self.draft_seconds}: expected >= 0")

    @property
    def max_rows(self) -> int:
        return len(self.seconds)

    def relative(self) -> np.ndarray:
        """c(n) = T(n) / T(1) for n = 1..max_rows."""
        s = np.asarray(self.seconds, dtype=float)
        return s / s[0]

    @classmethod
    def from_relative(cls, relative: Sequence[float], one_row_seconds: float = 1.0,
                      draft_relative: float = 0.0) -> "CostCurve":
        """A measured table of c(n) (c(1) = 1) and the draft pass relative to one row."""
        return cls(tuple(float(r) * one_row_seconds for r in relative),
                   float(draft_relative) * one_row_seconds)

    @classmethod
    def measure(cls, run_rows: Callable[[int], None], max_rows: int, repeats: int = 5,
                run_draft: Callable[[], None] | None = None) -> "CostCurve":
        """Time ``run_rows(n)`` (one target pass over n rows) for n = 1..max_rows, medians of
        ``repeats`` interleaved runs after one warm-up, and ``run_draft()`` likewise. Made
        non-decreasing: a pass over more rows is never cheaper (noise aside)."""
        times = [[] for _ in range(max_rows)]
        draft = []
        for n in range(1, max_rows + 1):
            run_rows(n)
        for _ in range(repeats):
            for n in range(1, max_rows + 1):
                t = time.perf_counter()
                run_rows(n)
                times[n - 1].append(time.perf_counter() - t)
            if run_draft is not None:
                t = time.perf_counter()
                run_draft()
                draft.append(time.perf_counter() - t)
        med = np.maximum.accumulate([float(np.median(t)) for t in times])
        return cls(tuple(float(x) for x in med), float(np.median(draft)) if draft else 0.0)


def expected_tokens(confidence: np.ndarray) -> np.ndarray:
    """E(n) for n = 0..k: tokens a round yields on average when it verifies n drafts."""
    c = np.clip(np.asarray(confidence, dtype=float), 0.0, 1.0)
    return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(c))])


def choose_verify_length(confidence: np.ndarray, cost: CostCurve, min_drafts: int = 0) -> int:
    """The n in [min_drafts, k] (k = len(confidence), capped by the curve) with the highest
    expected tokens per second."""
    k = min(len(confidence), cost.max_rows - 1)
    if k <= 0:
        return 0
    e = expected_tokens(confidence[:k])
    t = np.asarray(cost.seconds[: k + 1], dtype=float) + cost.draft_seconds
    rate = e / t
    lo = min(max(min_drafts, 0), k)
    return lo + int(np.argmax(rate[lo:]))


class DraftGate:
    """Whether a request should draft this round. Drafting pays only while drafted rounds
    yield more tokens per unit of cost than plain decoding (1 token per one-row pass): the
    gate smooths ``tokens / (rows_cost + draft_cost)`` over drafted rounds and, when it falls
    below 1, pauses drafting for ``backoff`` rounds, doubling the pause each time (up to
    ``max_pause``) until a drafted round pays again."""

    def __init__(self, smoothing: float = 0.2, margin: float = 0.1, max_pause: int = 32):
        self.smoothing, self.margin, self.max_pause = smoothing, margin, max_pause
        self.gain = 1.0 + margin
        self.pause = 0
        self.backoff = 1

    def should_draft(self) -> bool:
        if self.pause > 0:
            self.pause -= 1
            return False
        return True

    def hold_off(self) -> None:
        """Decode plainly for the next ``backoff`` rounds, and twice as long the next time."""
        self.pause, self.backoff = self.backoff, min(2 * self.backoff, self.max_pause)

    def update(self, tokens: int, rows_cost: float, draft_cost: float) -> None:
        """After a drafted round that emitted ``tokens`` for a pass of ``rows_cost`` (relative
        to one row) and a draft of ``draft_cost`` (likewise)."""
        self.gain += self.smoothing * (tokens / (rows_cost + draft_cost) - self.gain)
        if self.gain < 1.0:
            self.hold_off()
            self.gain = 1.0 + self.margin
        elif self.gain > 1.0 + self.margin:
            self.backoff = 1
