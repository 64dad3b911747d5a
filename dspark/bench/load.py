"""The load generator behind `bench model` and `bench system`: closed loop at a concurrency or
open loop at a request rate, a warm-up, then measurement windows until the last few agree.

Like perf_analyzer, a point is measured in consecutive windows (``window_s``); once the last
``stable_windows`` windows' throughput and mean latency are each within ``stability`` of their
mean, the point is stable and its figures are computed over those windows' requests (a window
holds the requests that *completed* in it). A point that does not settle within ``max_windows``
is reported with ``stable: false``. The spread of each metric over those windows is its noise
band, which `bench compare` uses.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from dspark.bench.client import Record, Transport
from dspark.bench.results import relative_band
from dspark.errors import ConfigError

MODES = ("concurrency", "rate")
BAND_METRICS = ("qps", "mean_ms", "p50_ms", "p90_ms", "p95_ms", "p99_ms", "ttft_p50_ms", "ttft_p99_ms",
                "itl_p50_ms", "itl_p99_ms")


@dataclass(frozen=True)
class Target:
    """A model and the prepared requests sent to it (round-robin), with its share of the traffic.
    ``label`` names a traffic class when one model gets several (e.g. a router's tiers, each with
    its own request parameters); results are per label."""

    model: str
    payloads: Sequence[Any]
    weight: float = 1.0
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or self.model


@dataclass(frozen=True)
class LoadSettings:
    warmup_s: float = 2.0
    window_s: float = 2.0
    stable_windows: int = 3
    stability: float = 0.10
    max_windows: int = 10
    arrivals: str = "constant"   # rate mode: "constant" or "poisson"
    max_inflight: int = 1024     # rate mode: arrivals beyond this many outstanding are not sent
    drain_s: float = 30.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.stable_windows < 1 or self.max_windows < self.stable_windows:
            raise ConfigError("max-windows", f"must be >= stable windows ({self.stable_windows})")
        if self.arrivals not in ("constant", "poisson"):
            raise ConfigError("arrivals", f"{self.arrivals!r}: expected constant or poisson")


@dataclass
class Point:
    """One measured level: the requests of the measured windows and each window's summary."""

    mode: str
    level: float
    records: list[Record]
    windows: list[dict]
    stable: bool
    duration_s: float
    started: float         # perf_counter at the start of the first measured window
    bounds: tuple[float, float] = (0.0, 0.0)  # perf_counter span of the measured windows
    all_records: list[Record] = field(default_factory=list)
    edges: list[float] = field(default_factory=list)  # window boundaries (perf_counter)

    def windows_of(self, target: str) -> list[dict]:
        """Each window's summary of one target's requests (in a mix)."""
        return [summarize([r for r in self.all_records if r.target == target and lo <= r.done < hi], hi - lo)
                for lo, hi in zip(self.edges, self.edges[1:])]


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(records: Sequence[Record], duration_s: float) -> dict:
    """Throughput, latency percentiles (ms), error rate and kinds; TTFT/ITL when streamed."""
    ok = [r for r in records if r.error is None]
    latencies = [1e3 * r.latency for r in ok]
    kinds = Counter(r.error for r in records if r.error is not None)
    examples: dict[str, str] = {}
    for r in records:
        if r.error is not None and r.error not in examples:
            examples[r.error] = r.detail or ""
    out = {
        "requests": len(records), "ok": len(ok), "qps": len(ok) / duration_s if duration_s > 0 else 0.0,
        "error_rate": (len(records) - len(ok)) / len(records) if records else 0.0, "errors": dict(kinds),
        "error_examples": examples,
        "mean_ms": statistics.fmean(latencies) if latencies else float("nan"),
        "p50_ms": _pct(latencies, 50), "p90_ms": _pct(latencies, 90), "p95_ms": _pct(latencies, 95),
        "p99_ms": _pct(latencies, 99), "max_ms": max(latencies) if latencies else float("nan"),
        "send_lag_p99_ms": _pct([1e3 * (r.sent - r.scheduled) for r in records], 99),
    }
    ttft = [1e3 * (r.first - r.sent) for r in ok if r.first is not None]
    if ttft:
        gaps = [1e3 * g for r in ok for g in r.gaps]
        out.update({"ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
                    "itl_p50_ms": _pct(gaps, 50), "itl_p99_ms": _pct(gaps, 99),
                    "responses_per_s": (len(ttft) + len(gaps)) / duration_s if duration_s > 0 else 0.0})
    return out


def is_stable(windows: Sequence[dict], count: int, tolerance: float) -> bool:
    """The last ``count`` windows' qps and mean latency each within ``tolerance`` of their mean."""
    if len(windows) < count:
        return False
    last = windows[-count:]
    for key in ("qps", "mean_ms"):
        values = [w[key] for w in last]
        if any(v != v for v in values):
            return False
        mean = statistics.fmean(values)
        if mean <= 0 or any(abs(v - mean) > tolerance * mean for v in values):
            return False
    return True


def bands(windows: Sequence[dict]) -> dict[str, float]:
    return {k: relative_band([w[k] for w in windows]) for k in BAND_METRICS if all(k in w for w in windows)}


def arrival_schedule(duration_s: float, rate_at: Callable[[float], float], weights: Sequence[float],
                     seed: int, process: str = "poisson") -> list[tuple[float, int]]:
    """A seeded open-loop schedule for ``run_fixed`` over ``duration_s``: Poisson arrivals thinned
    to ``rate_at(t)`` (per second; its peak found at 0.1 s steps), or with ``process="constant"``
    arrivals evenly spaced at that rate; each with the index of a target drawn by ``weights``. The
    same seed gives the same arrivals, to replay against A and B."""
    rng = random.Random(seed)
    peak = max(rate_at(t / 10) for t in range(max(1, int(duration_s * 10))))
    if peak <= 0:
        raise ConfigError("rate", f"the arrival rate must be > 0 somewhere in {duration_s:g} s")
    indices = range(len(weights))
    out, t = [], 0.0
    while True:
        if process == "constant":  # the next arrival one interval on; a pause steps 0.1 s ahead
            rate = rate_at(t)
            t, keep = (t + 1.0 / rate, True) if rate > 0 else (t + 0.1, False)
        else:
            t += rng.expovariate(peak)
            keep = rng.random() < rate_at(t) / peak
        if t >= duration_s:
            return out
        if keep:
            out.append((t, rng.choices(indices, weights=weights)[0]))


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while requests are timed, and run once after: its
    full passes over a run's records and tasks stalled the event loop for 100-200 ms (the send
    lateness p99 of 540 requests/s, open loop: 88-116 ms with it, 1.3-1.6 ms without)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
            gc.collect()


class LoadGenerator:
    """Drives a transport with a traffic mix; ``run_point`` measures one level."""

    def __init__(self, transport: Transport, targets: Sequence[Target], settings: LoadSettings,
                 on_window: Callable[[str, float, int, dict], None] | None = None,
                 classify: Callable[[str, str], str] | None = None):
        """``classify(kind, message)`` may refine an error's kind from its message (e.g. a router's
        "queue deadline" vs "queue is full", both UNAVAILABLE)."""
        if not targets:
            raise ConfigError("model", "no model to send requests to")
        self.transport, self.targets, self.settings = transport, list(targets), settings
        self.on_window = on_window or (lambda *_: None)
        self.classify = classify
        self.rng = random.Random(settings.seed)
        if len({t.name for t in self.targets}) != len(self.targets):
            raise ConfigError("model", "each model (or label) may appear once in a mix")
        self.cursor = {t.name: 0 for t in self.targets}

    def _pick(self) -> tuple[Target, Any]:
        target = self.targets[0] if len(self.targets) == 1 else \
            self.rng.choices(self.targets, weights=[t.weight for t in self.targets])[0]
        i = self.cursor[target.name]
        self.cursor[target.name] = i + 1
        return target, target.payloads[i % len(target.payloads)]

    async def _send(self, target: Target, payload: Any, scheduled: float) -> Record:
        record = await self.transport.send(target.name, target.model, payload, scheduled)
        if record.error is not None and self.classify is not None:
            record.error = self.classify(record.error, record.detail or "")
        return record

    async def run_fixed(self, concurrency: int = 1, count: int | None = None,
                        schedule: Sequence[tuple[float, int]] | None = None) -> Point:
        with collector_paused():
            return await self._run_fixed(concurrency, count, schedule)

    async def run_point(self, mode: str, level: float, rate_at: Callable[[float], float] | None = None) -> Point:
        with collector_paused():
            return await self._run_point(mode, level, rate_at)

    async def _run_fixed(self, concurrency: int = 1, count: int | None = None,
                         schedule: Sequence[tuple[float, int]] | None = None) -> Point:
        """Exactly these requests, measured as one window (no warm-up, no stability loop):
        ``count`` requests at ``concurrency`` (closed loop, targets drawn as usual; default one per
        payload of the first target), or a ``schedule`` of (seconds from the start, index of the
        target) sent open loop, e.g. a seeded arrival sequence replayed the same way for A and B."""
        records: list[Record] = []
        start = time.perf_counter()
        if schedule is not None:
            tasks = []
            for at, index in schedule:
                delay = start + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                target = self.targets[index]
                i = self.cursor[target.name]
                self.cursor[target.name] = i + 1
                tasks.append(asyncio.ensure_future(self._send(target, target.payloads[i % len(target.payloads)],
                                                              start + at)))
            records = list(await asyncio.gather(*tasks))
            mode, level = "schedule", len(schedule) / max(schedule[-1][0], 1e-9) if schedule else 0.0
        else:
            remaining = [count if count is not None else len(self.targets[0].payloads)]

            async def worker() -> None:
                while remaining[0] > 0:
                    remaining[0] -= 1
                    target, payload = self._pick()
                    records.append(await self._send(target, payload, time.perf_counter()))
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            mode, level = "count", float(concurrency)
        end = max([r.done for r in records], default=time.perf_counter())
        return Point(mode, level, records, [summarize(records, end - start)], True, end - start, start,
                     (start, end), records, [start, end])

    async def _run_point(self, mode: str, level: float, rate_at: Callable[[float], float] | None = None) -> Point:
        """Measure one level. In rate mode ``rate_at(t)`` (t: seconds since the start, <= level)
        shapes the rate over time (Poisson arrivals thinned to it), e.g. bursts."""
        if mode not in MODES:
            raise ConfigError("mode", f"{mode!r}: expected concurrency or rate")
        if level <= 0:
            raise ConfigError(mode, f"{level:g} must be > 0")
        s = self.settings
        records: list[Record] = []
        stop = asyncio.Event()
        inflight: set[asyncio.Task] = set()

        async def one(scheduled: float) -> None:
            records.append(await self._send(*self._pick(), scheduled))

        async def closed_loop() -> None:
            while not stop.is_set():
                await one(time.perf_counter())

        async def open_loop() -> None:
            begin = next_at = time.perf_counter()
            while not stop.is_set():
                poisson = s.arrivals == "poisson" or rate_at is not None
                next_at += self.rng.expovariate(level) if poisson else 1.0 / level
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if stop.is_set():
                    return
                if rate_at is not None and self.rng.random() * level > rate_at(next_at - begin):
                    continue
                if len(inflight) >= s.max_inflight:
                    now = time.perf_counter()
                    records.append(Record(self._pick()[0].name, next_at, now, now, error="client_inflight_cap"))
                    continue
                task = asyncio.ensure_future(one(next_at))
                inflight.add(task)
                task.add_done_callback(inflight.discard)

        drivers = ([asyncio.ensure_future(closed_loop()) for _ in range(int(level))] if mode == "concurrency"
                   else [asyncio.ensure_future(open_loop())])
        try:
            await asyncio.sleep(s.warmup_s)
            started = window_start = time.perf_counter()
            windows: list[dict] = []
            edges = [started]
            stable = False
            while len(windows) < s.max_windows:
                await asyncio.sleep(s.window_s)
                now = time.perf_counter()
                window = summarize([r for r in records if window_start <= r.done < now], now - window_start)
                windows.append(window)
                edges.append(now)
                window_start = now
                self.on_window(mode, level, len(windows), window)
                if is_stable(windows, s.stable_windows, s.stability):
                    stable = True
                    break
        finally:
            stop.set()
            pending = [*drivers, *inflight]
            if pending:
                done, not_done = await asyncio.wait(pending, timeout=s.drain_s)
                for task in not_done:
                    task.cancel()
        lo, hi = edges[-1 - s.stable_windows] if len(windows) >= s.stable_windows else edges[0], edges[-1]
        measured = [r for r in records if lo <= r.done < hi]
        return Point(mode, level, measured, windows, stable, hi - lo, started, (lo, hi), records, edges)
