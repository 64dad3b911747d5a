"""Interleaved timing: every candidate runs once per round, so a noisy neighbour slows all of
them alike and the ratios measured in one run stay fair."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved_samples(candidates: dict[str, Callable[[], object]], *, rounds: int = 15,
                        budget_s: float = 3.0, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per call of each candidate, one sample per round, over up to ``rounds`` rounds
    (fewer if the rounds would exceed ``budget_s``; at least 5)."""
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    start = time.perf_counter()
    for i in range(rounds):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
        if i >= 4 and time.perf_counter() - start > budget_s:
            break
    return samples


def interleaved_medians(candidates: dict[str, Callable[[], object]], *, rounds: int = 15,
                        budget_s: float = 3.0, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each candidate (see ``interleaved_samples``)."""
    samples = interleaved_samples(candidates, rounds=rounds, budget_s=budget_s, warmup=warmup)
    return {name: statistics.median(ts) for name, ts in samples.items()}


def quartile_band(samples: list[float]) -> float:
    """Half the interquartile range relative to the median: the noise band of a timing."""
    if len(samples) < 4:
        return 0.0
    q1, median, q3 = statistics.quantiles(samples, n=4)
    return (q3 - q1) / 2 / median if median else 0.0
