"""The fused LayerNorm+GELU+MatMul against unfused numpy/scipy and ONNX Runtime, and a sweep of
its block sizes. "% peak" is against the theoretical FMA peak of the cores the benchmark uses
(dspark.bench.machine), not a measured sgemm; OpenBLAS's 1024^3 sgemm is timed in the same rounds
as a second reference."""
from __future__ import annotations

import statistics
from typing import Callable, Sequence

import numpy as np

from dspark.bench.machine import this_machine
from dspark.bench.micro import log_nothing, register
from dspark.bench.results import BenchResult, Metric
from dspark.bench.table import Column
from dspark.bench.timing import interleaved_samples, quartile_band
from dspark.errors import ConfigError

SGEMM_N = 1024
DEFAULT_SHAPES = ("1x768x3072", "16x768x3072", "128x768x3072", "512x768x3072",
                  "1x1024x4096", "16x1024x4096", "128x1024x4096", "512x1024x4096")
SWEEP_SHAPES = ("512x768x3072", "128x768x3072", "512x1024x4096")
SWEEP_BLOCKS = ("384/144/128/1024", "384/96/64/1024", "256/144/128/1024")
BLOCK_KEYS = ("kc", "mc", "nc", "mb")


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        rows, d, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ConfigError("shape", f"{text!r}: expected ROWSxDxN, e.g. 16x768x3072") from None
    return rows, d, n


def parse_blocks(text: str | None) -> dict[str, int]:
    if not text:
        return {}
    try:
        values = [int(v) for v in text.split("/")]
    except ValueError:
        values = []
    if len(values) != len(BLOCK_KEYS):
        raise ConfigError("blocks", f"{text!r}: expected KC/MC/NC/MB, e.g. 384/144/128/1024")
    return dict(zip(BLOCK_KEYS, values))


def _layer_data(rows: int, d: int, n: int):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, d), dtype=np.float32)
    gamma = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    beta = (0.1 * rng.standard_normal(d)).astype(np.float32)
    w = (rng.standard_normal((d, n)) / np.sqrt(d)).astype(np.float32)
    b = (0.1 * rng.standard_normal(n)).astype(np.float32)
    return x, gamma, beta, w, b


KERNEL_COLUMNS = [
    Column("rows", "rows"), Column("shape", "d->n"), Column("fused_ms", "fused ms", ".3f"),
    Column("numpy_ms", "numpy ms", ".3f"), Column("ort_ms", "ORT ms", ".3f"),
    Column("speedup_vs_numpy", "x numpy", ".2f"), Column("speedup_vs_ort", "x ORT", ".2f"),
    Column("fused_gflops", "GFLOP/s", ".1f"), Column("share_of_fma_peak", "% FMA peak", ".0%"),
    Column("fused_max_rel_err", "rel err", ".1e"), Column("openblas_ms", "openblas ms", ".3f"),
    Column("openblas_speedup_vs_ort", "openblas x ORT", ".2f"),
]


@register("fused", "fused LayerNorm+GELU+MatMul vs unfused numpy/scipy vs ONNX Runtime (ORT_ENABLE_ALL)")
def run_fused(shapes: Sequence[str] = DEFAULT_SHAPES, threads: int = 1, rounds: int = 21, budget: float = 10.0,
              block_rows: int | None = None, blocks: str | None = None,
              log: Callable[[str], None] = log_nothing) -> BenchResult:
    from threadpoolctl import threadpool_limits

    from dspark.bench.micro.ort_layer import OrtFusedLayer, unfused_numpy
    from dspark.kernels.dispatch import dispatch_report
    from dspark.kernels.fused import FusedLNGeluMatMul, reference_fused, sgemm

    parsed = [parse_shape(s) for s in shapes]
    packed_blocks = parse_blocks(blocks)
    report = dispatch_report()
    machine = this_machine()
    peak = machine.fp32_peak_gflops(threads)
    rows_out: list[dict] = []
    sgemm_gflops: list[float] = []
    ort_ops: list[str] = []
    with threadpool_limits(threads):
        big = np.random.default_rng(1).standard_normal((SGEMM_N, SGEMM_N), dtype=np.float32)
        for rows, d, n in parsed:
            x, gamma, beta, w, b = _layer_data(rows, d, n)
            layer = FusedLNGeluMatMul(gamma, beta, w, b, threads=threads, **packed_blocks)
            over_openblas = FusedLNGeluMatMul(gamma, beta, w, b, threads=threads, gemm="openblas",
                                              block_rows=block_rows)
            ort = OrtFusedLayer(gamma, beta, w, b, threads=threads)
            ort_ops = ort.optimized_op_types
            out = np.empty((rows, n), np.float32)
            samples = interleaved_samples({
                "fused": lambda: layer(x, out=out),
                "openblas": lambda: over_openblas(x, out=out),
                "numpy": lambda: unfused_numpy(x, gamma, beta, w, b),
                "ort": lambda: ort(x),
                "sgemm": lambda: sgemm(big, big),
            }, rounds=rounds, budget_s=budget)
            t = {name: statistics.median(s) for name, s in samples.items()}
            band = {name: quartile_band(s) for name, s in samples.items()}
            sgemm_gflops.append(2 * SGEMM_N ** 3 / t["sgemm"] / 1e9)
            ref = reference_fused(x, gamma, beta, w, b)
            scale = float(np.abs(ref).max())
            gflops = 2.0 * rows * d * n / t["fused"] / 1e9
            rows_out.append({
                "rows": rows, "d": d, "n": n, "shape": f"{d}->{n}",
                "fused_ms": t["fused"] * 1e3, "openblas_ms": t["openblas"] * 1e3, "numpy_ms": t["numpy"] * 1e3,
                "ort_ms": t["ort"] * 1e3, "speedup_vs_numpy": t["numpy"] / t["fused"],
                "speedup_vs_ort": t["ort"] / t["fused"], "openblas_speedup_vs_ort": t["ort"] / t["openblas"],
                "fused_gflops": gflops, "share_of_fma_peak": gflops / peak,
                "fused_max_rel_err": float(np.abs(layer(x) - ref).max()) / scale,
                "ort_max_rel_err": float(np.abs(ort(x) - ref).max()) / scale,
                "simd_path": layer.simd_path, "samples": len(samples["fused"]),
                "band": {"fused_ms": band["fused"], "openblas_ms": band["openblas"], "ort_ms": band["ort"],
                         "speedup_vs_ort": float(np.hypot(band["fused"], band["ort"])),
                         "speedup_vs_numpy": float(np.hypot(band["fused"], band["numpy"]))},
            })
            r = rows_out[-1]
            log(f"  {rows}x{d}x{n}: fused {r['fused_ms']:.3f} ms, over OpenBLAS {r['openblas_ms']:.3f} ms, "
                f"numpy {r['numpy_ms']:.3f} ms, ORT {r['ort_ms']:.3f} ms")
    best_sgemm = max(sgemm_gflops)
    notes = [
        f"SIMD path {report.chosen} (compiled {', '.join(report.compiled)}; CPU runs {', '.join(report.supported)}); "
        f"BLAS {report.blas}; {threads} thread(s)",
        f"ORT optimized graph: {' + '.join(ort_ops)}",
        f"% FMA peak: of {peak:.1f} GFLOP/s = {threads} core(s) x {machine.peak_basis}",
        f"OpenBLAS sgemm {SGEMM_N}^3 in the same rounds: best median {best_sgemm:.1f} GFLOP/s = "
        f"{best_sgemm / peak:.0%} of that peak",
    ]
    return BenchResult(
        benchmark="micro/fused",
        settings={"shapes": list(shapes), "threads": threads, "rounds": rounds, "budget_s": budget,
                  "block_rows": block_rows, "packed_blocks": packed_blocks or "default"},
        rows=rows_out, columns=KERNEL_COLUMNS, key_fields=["rows", "d", "n"],
        metrics=[Metric("fused_ms", "lower"), Metric("speedup_vs_ort", "higher"), Metric("speedup_vs_numpy", "higher")],
        notes=notes,
        series={"dispatch": vars(report), "ort_optimized_ops": ort_ops, "fma_peak_gflops": peak,
                "sgemm_gflops_per_shape": sgemm_gflops})


@register("fused-blocks", "the fused layer's block sizes (KC/MC/NC/MB) against its OpenBLAS path and ORT")
def run_block_sweep(shapes: Sequence[str] = SWEEP_SHAPES, blocks: Sequence[str] = SWEEP_BLOCKS, rounds: int = 40,
                    budget: float = 30.0, log: Callable[[str], None] = log_nothing) -> BenchResult:
    """GFLOP/s as best / median of interleaved rounds, per configuration and shape (1 thread)."""
    from threadpoolctl import threadpool_limits

    from dspark.bench.micro.ort_layer import OrtFusedLayer
    from dspark.kernels.fused import FusedLNGeluMatMul

    configs = {f"{text}" + (" (default)" if i == 0 and text == SWEEP_BLOCKS[0] else ""): parse_blocks(text)
               for i, text in enumerate(blocks)}
    table: dict[str, dict] = {name: {"candidate": name} for name in [*configs, "OpenBLAS path", "ORT"]}
    with threadpool_limits(1):
        for text in shapes:
            rows, d, n = parse_shape(text)
            x, gamma, beta, w, b = _layer_data(rows, d, n)
            out = np.empty((rows, n), np.float32)
            candidates = {name: (lambda layer: lambda: layer(x, out=out))(
                FusedLNGeluMatMul(gamma, beta, w, b, **cfg)) for name, cfg in configs.items()}
            openblas = FusedLNGeluMatMul(gamma, beta, w, b, gemm="openblas")
            ort = OrtFusedLayer(gamma, beta, w, b)
            candidates["OpenBLAS path"] = lambda: openblas(x, out=out)
            candidates["ORT"] = lambda: ort(x)
            samples = interleaved_samples(candidates, rounds=rounds, budget_s=budget)
            flop = 2.0 * rows * d * n
            for name, s in samples.items():
                table[name][text] = [flop / min(s) / 1e9, flop / statistics.median(s) / 1e9]
            log(f"  {text}: " + ", ".join(f"{k} {v[text][1]:.0f}" for k, v in table.items()))
    return BenchResult(
        benchmark="micro/fused-blocks",
        settings={"shapes": list(shapes), "blocks": list(blocks), "rounds": rounds, "budget_s": budget, "threads": 1},
        rows=list(table.values()),
        columns=[Column("candidate", "kc/mc/nc/mb")] + [Column(s, s.replace("x", "×", 1).replace("x", "→"), ".0f")
                                                         for s in shapes],
        key_fields=["candidate"],
        notes=["GFLOP/s as best / median of the interleaved rounds (every candidate once per round), 1 thread"])
