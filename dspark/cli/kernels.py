"""Kernel parts of the CLI: `dspark bench kernels` and `dspark bench pool` (the fused layer
against unfused numpy/scipy and ONNX Runtime; the BFC pool against np.empty and first-fit),
and the SIMD dispatch / BLAS / NUMA lines of `dspark info`."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import numpy as np

from dspark.cli.bench import bench

PEAK_N = 1024  # square sgemm whose GFLOP/s stands for the machine's peak
DEFAULT_SHAPES = ("1x768x3072", "16x768x3072", "128x768x3072", "512x768x3072",
                  "1x1024x4096", "16x1024x4096", "128x1024x4096", "512x1024x4096")


@dataclass
class KernelRow:
    rows: int
    d: int
    n: int
    fused_ms: float          # gemm="packed" (the default)
    openblas_ms: float       # gemm="openblas": the same fusion over OpenBLAS's sgemm
    numpy_ms: float
    ort_ms: float
    speedup_vs_numpy: float
    speedup_vs_ort: float
    openblas_speedup_vs_ort: float
    fused_gflops: float
    share_of_sgemm_peak: float
    fused_max_rel_err: float
    ort_max_rel_err: float
    simd_path: str
    sgemm_peak_gflops: float


def echo_kernel_info() -> None:
    """Lines for `dspark info`: the fused kernel's dispatch, its BLAS, the NUMA topology."""
    from dspark.kernels.dispatch import SIMD_ENV, dispatch_report
    from dspark.kernels.numa import read_topology

    report = dispatch_report()
    click.echo(f"fused kernel  built for {', '.join(report.compiled)}; this CPU+OS runs "
               f"{', '.join(report.supported)}; chosen: {report.chosen}"
               + (f" ({SIMD_ENV}={report.override})" if report.override else " (auto; override with "
                  f"{SIMD_ENV}=scalar|avx2|avx512)"))
    click.echo(f"GEMM          {report.blas}, {report.blas_threads} threads")
    topology = read_topology()
    lines = topology.describe().splitlines()
    click.echo(f"NUMA          {len(topology.nodes)} node(s) from {topology.source}")
    for line in lines:
        click.echo(f"              {line}")


def _parse_shape(text: str) -> tuple[int, int, int]:
    try:
        rows, d, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected ROWSxDxN, e.g. 16x768x3072") from None
    return rows, d, n


def _write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    click.echo(f"wrote {path}")


def _print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    click.echo(" | ".join(h.rjust(w) for h, w in zip(headers, widths)))
    click.echo("-|-".join("-" * w for w in widths))
    for r in rows:
        click.echo(" | ".join(c.rjust(w) for c, w in zip(r, widths)))


@click.command("kernels")
@click.option("--shape", "shapes", multiple=True, help="ROWSxDxN (repeatable); default: decode and prefill shapes")
@click.option("--threads", default=1, show_default=True, help="threads for every candidate")
@click.option("--rounds", default=21, show_default=True, help="interleaved repeats per shape (median)")
@click.option("--budget", default=10.0, show_default=True,
              help="seconds per shape; fewer rounds (at least 5) when they would take longer")
@click.option("--block-rows", type=int, default=None,
              help="openblas path: rows per LayerNorm+GELU block (default: 2 MiB of rows)")
@click.option("--blocks", default=None, metavar="KC/MC/NC/MB",
              help="packed path: K, row, column and outer-row block sizes (default: the library's)")
@click.option("--json", "json_path", type=click.Path(path_type=Path),
              default=Path("bench-results/kernels.json"), show_default=True)
def bench_kernels(shapes: tuple[str, ...], threads: int, rounds: int, budget: float, block_rows: int | None,
                  blocks: str | None, json_path: Path) -> None:
    """Fused LayerNorm+GELU+MatMul vs unfused numpy/scipy vs ONNX Runtime (ORT_ENABLE_ALL)."""
    from threadpoolctl import threadpool_limits

    from dspark.kernels.dispatch import dispatch_report
    from dspark.kernels.fused import FusedLNGeluMatMul, reference_fused, sgemm
    from dspark.engines.ort_layer import OrtFusedLayer, unfused_numpy
    from dspark.kernels.timing import interleaved_medians

    report = dispatch_report()
    packed_blocks = {}
    if blocks:
        try:
            packed_blocks = dict(zip(("kc", "mc", "nc", "mb"), (int(v) for v in blocks.split("/"))))
        except ValueError:
            raise click.BadParameter(f"{blocks!r}: expected KC/MC/NC/MB, e.g. 384/144/128/1024") from None
    results: list[KernelRow] = []
    with threadpool_limits(threads):
        big = np.random.default_rng(1).standard_normal((PEAK_N, PEAK_N), dtype=np.float32)
        click.echo(f"SIMD path {report.chosen} (compiled {report.compiled}, CPU {report.supported}); "
                   f"BLAS {report.blas}; threads {threads}; sgemm peak: {PEAK_N}^3 through the same "
                   "BLAS, timed in the same rounds as each shape; the best median counts")
        ort_fusions: list[str] = []
        for text in shapes or DEFAULT_SHAPES:
            rows, d, n = _parse_shape(text)
            rng = np.random.default_rng(0)
            x = rng.standard_normal((rows, d), dtype=np.float32)
            gamma = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
            beta = (0.1 * rng.standard_normal(d)).astype(np.float32)
            w = (rng.standard_normal((d, n)) / np.sqrt(d)).astype(np.float32)
            b = (0.1 * rng.standard_normal(n)).astype(np.float32)
            layer = FusedLNGeluMatMul(gamma, beta, w, b, threads=threads, **packed_blocks)
            over_openblas = FusedLNGeluMatMul(gamma, beta, w, b, threads=threads, gemm="openblas",
                                              block_rows=block_rows)
            ort = OrtFusedLayer(gamma, beta, w, b, threads=threads)
            ort_fusions = ort.optimized_op_types
            out = np.empty((rows, n), np.float32)
            times = interleaved_medians({
                "fused": lambda: layer(x, out=out),
                "openblas": lambda: over_openblas(x, out=out),
                "numpy": lambda: unfused_numpy(x, gamma, beta, w, b),
                "ort": lambda: ort(x),
                "peak": lambda: sgemm(big, big),
            }, rounds=rounds, budget_s=budget)
            peak = 2 * PEAK_N ** 3 / times["peak"] / 1e9
            ref = reference_fused(x, gamma, beta, w, b)
            scale = np.abs(ref).max()
            flops = 2.0 * rows * d * n
            results.append(KernelRow(
                rows, d, n, times["fused"] * 1e3, times["openblas"] * 1e3, times["numpy"] * 1e3,
                times["ort"] * 1e3, times["numpy"] / times["fused"], times["ort"] / times["fused"],
                times["ort"] / times["openblas"],
                flops / times["fused"] / 1e9, 0.0,
                float(np.abs(layer(x) - ref).max() / scale), float(np.abs(ort(x) - ref).max() / scale),
                layer.simd_path, peak))
            r = results[-1]
            click.echo(f"  {rows}x{d}x{n}: fused {r.fused_ms:.3f} ms, over OpenBLAS {r.openblas_ms:.3f} ms, "
                       f"numpy {r.numpy_ms:.3f} ms, "
                       f"ORT {r.ort_ms:.3f} ms", err=True)
    # The machine's peak: the best median of the square sgemm over the run (neighbours' load
    # only ever lowers it).
    run_peak = max(r.sgemm_peak_gflops for r in results)
    for r in results:
        r.share_of_sgemm_peak = r.fused_gflops / run_peak
    click.echo(f"ORT optimized graph: {' + '.join(ort_fusions)}; sgemm peak {run_peak:.1f} GFLOP/s")
    _print_table(
        ["rows", "d->n", "fused ms", "numpy ms", "ORT ms", "x numpy", "x ORT", "GFLOP/s", "% peak",
         "rel err", "openblas ms", "openblas x ORT"],
        [[str(r.rows), f"{r.d}->{r.n}", f"{r.fused_ms:.3f}", f"{r.numpy_ms:.3f}", f"{r.ort_ms:.3f}",
          f"{r.speedup_vs_numpy:.2f}", f"{r.speedup_vs_ort:.2f}", f"{r.fused_gflops:.1f}",
          f"{100 * r.share_of_sgemm_peak:.0f}", f"{r.fused_max_rel_err:.1e}", f"{r.openblas_ms:.3f}",
          f"{r.openblas_speedup_vs_ort:.2f}"] for r in results])
    _write_json(json_path, {"threads": threads, "packed_blocks": packed_blocks or "default", "sgemm_peak_n": PEAK_N, "sgemm_peak_gflops": run_peak, "dispatch": asdict(report),
                            "ort_optimized_ops": ort_fusions, "rows": [asdict(r) for r in results]})


LOOP_REQUESTS = 50  # per timed round of the request loop


def _request_loop(allocate, requests: int, sizes: list[int]) -> None:
    """A memory-bound request loop: each request takes three activation buffers, writes and
    reads them once, and gives them back."""
    for i in range(requests):
        bufs = [allocate(sizes[(i + j) % len(sizes)]) for j in range(3)]
        for buf in bufs:
            buf.fill(1.0)
        float(bufs[0][:: 1024].sum())
        del bufs


@click.command("pool")
@click.option("--steps", default=3000, show_default=True, help="decode steps in the serving trace")
@click.option("--seeds", default=3, show_default=True, help="traces (different seeds); medians are reported")
@click.option("--headroom", default=1.25, show_default=True,
              help="bounded pools hold this many times the trace's peak bytes in use")
@click.option("--rounds", default=31, show_default=True, help="interleaved rounds of the request loop and model load")
@click.option("--weights", type=click.Path(path_type=Path),
              default=Path("model_repository/fused_transformer/1/weights.npz"), show_default=True)
@click.option("--json", "json_path", type=click.Path(path_type=Path),
              default=Path("bench-results/pool.json"), show_default=True)
def bench_pool(steps: int, seeds: int, headroom: float, rounds: int, weights: Path, json_path: Path) -> None:
    """BFC pool vs first-fit vs np.empty on a serving-shaped trace, a request loop, model load."""
    import statistics
    import tempfile

    from dspark.engines.fused_transformer import FusedTransformer, TransformerConfig, make_weights, save_weights
    from dspark.kernels.pool import MemoryPool
    from dspark.kernels.pool_trace import replay, serving_trace
    from dspark.kernels.timing import interleaved_medians

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

    def med(name: str, field: str):
        values = [getattr(r, field) for r in by_name[name]]
        return None if values[0] is None else statistics.median(values)

    trace_rows = [{"allocator": name, **{f: med(name, f) for f in (
        "p50_us", "p99_us", "total_s", "failed", "fragmentation_end", "fragmentation_mean")}} for name in by_name]
    _print_table(["allocator", "alloc p50 us", "alloc p99 us", "trace s", "did not fit", "frag end", "frag mean"],
                 [[r["allocator"], f"{r['p50_us']:.2f}", f"{r['p99_us']:.2f}", f"{r['total_s']:.3f}",
                   f"{r['failed']:.0f}",
                   "-" if r["fragmentation_end"] is None else f"{r['fragmentation_end']:.3f}",
                   "-" if r["fragmentation_mean"] is None else f"{r['fragmentation_mean']:.3f}"]
                  for r in trace_rows])
    best, first = med("best_fit", "fragmentation_mean"), med("first_fit", "fragmentation_mean")
    reduction = 1 - best / first if first else 0.0
    click.echo(f"best-fit mean fragmentation vs first-fit: {100 * reduction:.0f}% lower (seed's claim: 76%)")

    sizes = [int(s) for s in (np.random.default_rng(0).integers(1, 8, 64) * (512 << 10))]
    loop_pools = {"pool": MemoryPool(initial_bytes=256 << 20),
                  "pool+hugepages": MemoryPool(initial_bytes=256 << 20, huge_pages=True, prefault=True)}
    loops = {name: (lambda p: lambda: _request_loop(lambda n: p.empty(n // 4, np.float32), LOOP_REQUESTS, sizes))(p)
             for name, p in loop_pools.items()}
    loops["np.empty"] = lambda: _request_loop(lambda n: np.empty(n // 4, np.float32), LOOP_REQUESTS, sizes)
    rates = {name: LOOP_REQUESTS / t for name, t in interleaved_medians(loops, rounds=rounds, budget_s=30).items()}
    click.echo("memory-bound request loop (3 buffers of 0.5-3.5 MiB per request, written and read): "
               + ", ".join(f"{name} {rate:.0f} req/s ({rate / rates['np.empty']:.2f}x np.empty)"
                           for name, rate in rates.items()))

    with tempfile.TemporaryDirectory() as tmp:
        if not weights.is_file():
            weights = Path(tmp) / "weights.npz"
            config = TransformerConfig()
            save_weights(weights, config, make_weights(config))
        load = interleaved_medians({
            "with pool": lambda: FusedTransformer.load(weights, use_pool=True),
            "without pool": lambda: FusedTransformer.load(weights, use_pool=False),
        }, rounds=rounds, budget_s=20)
    click.echo(f"fused_transformer load: with pool {1e3 * load['with pool']:.1f} ms, "
               f"without {1e3 * load['without pool']:.1f} ms")
    _write_json(json_path, {
        "trace": {"steps": steps, "seeds": seeds, "headroom": headroom, "rows": trace_rows,
                  "fragmentation_reduction_vs_first_fit": reduction,
                  "per_seed": {k: [asdict(r) for r in v] for k, v in by_name.items()}},
        "request_loop_req_per_s": rates,
        "model_load_ms": {k: 1e3 * v for k, v in load.items()},
    })


bench.add_command(bench_kernels)
bench.add_command(bench_pool)
