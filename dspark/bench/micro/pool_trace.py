"""An allocation trace shaped like serving, and replaying it against allocators.

Sequences arrive, each with a KV cache that grows by doubling (allocate the larger
block, then free the old one, as a growing cache does) until the sequence ends at a
random length and frees it; every decode step also allocates and frees a few
activation buffers of batch-dependent size that live until the next step's exist. The trace stops mid-flight, with live
caches, so the end state shows the fragmentation a long-running server carries.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Op:
    kind: str   # "alloc" or "free"
    key: int
    nbytes: int = 0


def serving_trace(steps: int = 3000, seed: int = 0, max_live: int = 24,
                  kv_bytes_per_token: int = 8 << 10, max_tokens: int = 2048) -> list[Op]:
    rng = np.random.default_rng(seed)
    ops: list[Op] = []
    next_key = 0
    live: dict[int, tuple[int, int, int, int]] = {}  # seq -> (kv key, capacity, tokens, target)
    previous_acts: list[int] = []

    def alloc(nbytes: int) -> int:
        nonlocal next_key
        next_key += 1
        ops.append(Op("alloc", next_key, int(nbytes)))
        return next_key

    for _ in range(steps):
        if len(live) < max_live and rng.random() < 0.3:
            prompt = int(rng.integers(16, 512))
            target = int(min(max_tokens, prompt + rng.integers(8, 1024)))
            cap = 1 << (prompt - 1).bit_length()
            live[alloc(1)] = (alloc(cap * kv_bytes_per_token), cap, prompt, target)
        for seq, (kv, cap, tokens, target) in list(live.items()):
            tokens += 1
            if tokens >= target:
                ops.append(Op("free", kv))
                ops.append(Op("free", seq))
                del live[seq]
                continue
            if tokens > cap:
                cap *= 2
                new_kv = alloc(cap * kv_bytes_per_token)
                ops.append(Op("free", kv))
                kv = new_kv
            live[seq] = (kv, cap, tokens, target)
        batch = max(1, len(live))
        # This step's activations live until the next step's are allocated (double buffering).
        acts = [alloc(batch * int(rng.integers(1, 8)) * (16 << 10)) for _ in range(3)]
        ops.extend(Op("free", key) for key in previous_acts)
        previous_acts = acts
    return ops


@dataclass
class ReplayResult:
    name: str
    allocs: int
    failed: int  # allocations that did not fit (bounded pools only)
    p50_us: float
    p99_us: float
    total_s: float
    fragmentation_end: float | None
    fragmentation_mean: float | None
    bytes_reserved: int | None
    peak_bytes_in_use: int | None


def replay(name: str, ops: list[Op], allocate: Callable[[int], object],
           stats: Callable[[], dict] | None = None, sample_every: int = 200) -> ReplayResult:
    """Run the trace: allocate(nbytes) returns an object that frees its block when dropped."""
    held: dict[int, object] = {}
    failed = 0
    latencies: list[float] = []
    frag: list[float] = []
    clock = time.perf_counter_ns
    start = clock()
    for i, op in enumerate(ops):
        if op.kind == "alloc":
            t0 = clock()
            try:
                held[op.key] = allocate(op.nbytes)
            except MemoryError:
                failed += 1
                continue
            latencies.append(clock() - t0)
        else:
            held.pop(op.key, None)
        if stats is not None and i % sample_every == 0:
            frag.append(stats()["fragmentation"])
    total = (clock() - start) / 1e9
    end = stats() if stats is not None else None
    latencies.sort()
    result = ReplayResult(
        name, len(latencies), failed, latencies[len(latencies) // 2] / 1e3,
        latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] / 1e3, total,
        end["fragmentation"] if end else None, statistics.fmean(frag) if frag else None,
        end["bytes_reserved"] if end else None, end["peak_bytes_in_use"] if end else None)
    held.clear()
    return result
