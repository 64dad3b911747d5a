"""The BFC memory pool against first-fit and np.empty: a serving-shaped allocation trace, a
memory-bound request loop, and the fused transformer's load time with and without the pool."""
from __future__ import annotations

import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np

from dspark.bench.micro import log_nothing, register
from dspark.bench.results import BenchResult, Metric
from dspark.bench.table import Column
from dspark.bench.timing import interleaved_samples, quartile_band
from dspark.paths import project_root

LOOP_REQUESTS = 50  # per timed round of the request loop


def _request_loop(allocate, requests: int, sizes: list[int]) -> None:
    """Each request takes three activation buffers, writes and reads them once, gives them back."""
    for i in range(requests):
        bufs = [allocate(sizes[(i + j) % len(sizes)]) for j in range(3)]
        for buf in bufs:
            buf.fill(1.0)
        float(bufs[0][:: 1024].sum())
        del bufs


@register("pool", "BFC pool vs first-fit vs np.empty: serving trace, request loop, model load")
def run_pool(steps: int = 3000, seeds: int = 3, headroom: float = 1.25, rounds: int = 31,
             weights: Path | None = None, log: Callable[[str], None] = log_nothing) -> BenchResult:
    from dspark.bench.micro.pool_trace import replay, serving_trace
    from dspark.runtimes.fused_transformer import FusedTransformer, TransformerConfig, make_weights, save_weights
    from dspark.kernels.pool import MemoryPool

    weights = weights or project_root() / "model_repository/fused_transformer/1/weights.npz"
    by_name: dict[str, list] = {}
    for seed in range(seeds):
        ops = serving_trace(steps=steps, seed=seed)
        probe = MemoryPool(arena_bytes=4 << 30)
        peak = replay("probe", ops, lambda n: probe.empty(n, np.uint8), lambda: vars(probe.stats()),
                      sample_every=len(ops)).peak_bytes_in_use
        cap = int(peak * headroom) // (2 << 20) * (2 << 20)
        for policy in ("best_fit", "first_fit"):
            pool = MemoryPool(policy=policy, arena_bytes=cap, initial_bytes=cap, max_bytes=cap)
            by_name.setdefault(policy, []).append(replay(
                policy, ops, lambda n: pool.empty(n, np.uint8), lambda: vars(pool.stats()), sample_every=50))
        by_name.setdefault("np.empty", []).append(replay("np.empty", ops, lambda n: np.empty(n, np.uint8)))
        log(f"  trace seed {seed}: {len(ops)} operations")

    def med(name: str, field: str):
        values = [getattr(r, field) for r in by_name[name]]
        return None if values[0] is None else statistics.median(values)

    rows = [{"part": "trace", "allocator": name, **{f: med(name, f) for f in (
        "p50_us", "p99_us", "total_s", "failed", "fragmentation_end", "fragmentation_mean")}} for name in by_name]
    best, first = med("best_fit", "fragmentation_mean"), med("first_fit", "fragmentation_mean")
    reduction = 1 - best / first if first else 0.0

    sizes = [int(s) for s in (np.random.default_rng(0).integers(1, 8, 64) * (512 << 10))]
    loop_pools = {"pool": MemoryPool(initial_bytes=256 << 20),
                  "pool+hugepages": MemoryPool(initial_bytes=256 << 20, huge_pages=True, prefault=True)}
    loops = {name: (lambda p: lambda: _request_loop(lambda n: p.empty(n // 4, np.float32), LOOP_REQUESTS, sizes))(p)
             for name, p in loop_pools.items()}
    loops["np.empty"] = lambda: _request_loop(lambda n: np.empty(n // 4, np.float32), LOOP_REQUESTS, sizes)
    loop_samples = interleaved_samples(loops, rounds=rounds, budget_s=30)
    rates = {name: LOOP_REQUESTS / statistics.median(s) for name, s in loop_samples.items()}
    for name, rate in rates.items():
        rows.append({"part": "request loop", "allocator": name, "req_per_s": rate,
                     "x_np_empty": rate / rates["np.empty"], "band": {"req_per_s": quartile_band(loop_samples[name])}})
    log("  request loop: " + ", ".join(f"{k} {v:.0f} req/s" for k, v in rates.items()))

    with tempfile.TemporaryDirectory() as tmp:
        if not Path(weights).is_file():
            weights = Path(tmp) / "weights.npz"
            config = TransformerConfig()
            save_weights(weights, config, make_weights(config))
        load = interleaved_samples({
            "with pool": lambda: FusedTransformer.load(weights, use_pool=True),
            "without pool": lambda: FusedTransformer.load(weights, use_pool=False),
        }, rounds=rounds, budget_s=20)
    for name, s in load.items():
        rows.append({"part": "model load", "allocator": name, "load_ms": 1e3 * statistics.median(s),
                     "band": {"load_ms": quartile_band(s)}})
    return BenchResult(
        benchmark="micro/pool",
        settings={"steps": steps, "seeds": seeds, "headroom": headroom, "rounds": rounds, "weights": str(weights)},
        rows=rows,
        columns=[Column("part"), Column("allocator"), Column("p50_us", "alloc p50 us", ".2f"),
                 Column("p99_us", "alloc p99 us", ".2f"), Column("total_s", "trace s", ".3f"),
                 Column("failed", "did not fit", ".0f"), Column("fragmentation_end", "frag end", ".3f"),
                 Column("fragmentation_mean", "frag mean", ".3f"), Column("req_per_s", "req/s", ".0f"),
                 Column("x_np_empty", "x np.empty", ".2f"), Column("load_ms", "load ms", ".1f")],
        key_fields=["part", "allocator"], group_by="part",
        metrics=[Metric("p99_us", "lower"), Metric("fragmentation_mean", "lower"), Metric("req_per_s", "higher"),
                 Metric("load_ms", "lower")],
        notes=[f"best-fit mean fragmentation vs first-fit: {100 * reduction:.0f}% lower (target: 76% lower)",
               "request loop: 3 buffers of 0.5-3.5 MiB per request, written and read; trace: medians over "
               f"{seeds} seeds, bounded pools hold {headroom}x the trace's peak bytes in use"],
        series={"fragmentation_reduction_vs_first_fit": reduction,
                "per_seed": {k: [asdict(r) for r in v] for k, v in by_name.items()}})
