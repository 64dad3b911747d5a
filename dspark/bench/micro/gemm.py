"""The GemmEx shim (libhcblas.so) against OpenBLAS's sgemm called directly, fp32 vs bf16 vs int8
on every kernel path this CPU runs. Every candidate once per round in a shuffled order (round 0
warms up and measures the error against float64)."""
from __future__ import annotations

import ctypes
import os
import statistics
import time
from typing import Callable

import numpy as np

from dspark.bench.machine import this_machine
from dspark.bench.micro import log_nothing, register
from dspark.bench.results import BenchResult, Metric
from dspark.bench.table import Column
from dspark.bench.timing import quartile_band


@register("gemm", "GemmEx shim: OpenBLAS sgemm direct vs shim fp32 / bf16 / int8 per kernel path")
def run_gemm(size: int = 1024, rounds: int = 11, threads: int = 1,
             log: Callable[[str], None] = log_nothing) -> BenchResult:
    from dspark.runtimes.accel import gemm as shim

    shim.library()
    blas = ctypes.CDLL("libscipy_openblas.so")  # the very OpenBLAS libhcblas.so loaded
    blas.scipy_openblas_set_num_threads(threads)
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((size, size)).astype(np.float32) for _ in range(2))
    exact = a.astype(np.float64) @ b.astype(np.float64)
    ab, bb = a.astype(shim.BFLOAT16), b.astype(shim.BFLOAT16)
    ai, bi = (rng.integers(-128, 128, (size, size)).astype(np.int8) for _ in range(2))
    exact_int = ai.astype(np.int64) @ bi.astype(np.int64)
    gemm = shim.Gemm("hcblas", "cpu")
    out = np.empty((size, size), np.float32)
    out_int = np.empty((size, size), np.int32)
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    sgemm = blas.scipy_cblas_sgemm
    sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                           ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]

    def direct_blas():  # column-major C^T = B^T A^T, exactly the call the shim's fp32 path makes
        sgemm(102, 111, 111, size, size, size, one, b.ctypes.data, size, a.ctypes.data, size, zero,
              out.ctypes.data, size)
        return out

    paths = shim.kernel_report().supported
    candidates = {"openblas sgemm (direct)": (None, direct_blas),
                  "shim fp32": (None, lambda: gemm.matmul(a, b, out=out))}
    for path in paths:
        candidates[f"shim bf16 [{path}]"] = (path, lambda: gemm.matmul(ab, bb, out_dtype=np.float32))
        candidates[f"shim int8 [{path}]"] = (path, lambda: gemm.matmul(ai, bi, out=out_int))
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    errors: dict[str, float] = {}
    previous = os.environ.get(shim.SIMD_ENV)
    try:
        order = list(candidates)
        for round_index in range(rounds + 1):
            if round_index:  # a new order each round: no candidate always follows the same one
                rng.shuffle(order)
            for name in order:
                path, run = candidates[name]
                if path:
                    os.environ[shim.SIMD_ENV] = path
                start = time.perf_counter()
                result = run()
                elapsed = time.perf_counter() - start
                if round_index == 0:
                    reference = exact_int if "int8" in name else exact
                    errors[name] = float(np.abs(result - reference).max() / np.abs(reference).max())
                else:
                    samples[name].append(elapsed)
            log(f"  round {round_index}/{rounds}")
    finally:
        if previous is None:
            os.environ.pop(shim.SIMD_ENV, None)
        else:
            os.environ[shim.SIMD_ENV] = previous
    ms = {name: statistics.median(times) * 1e3 for name, times in samples.items()}
    flops = 2.0 * size ** 3
    peak = this_machine().fp32_peak_gflops(threads)
    rows = [{"candidate": name, "ms": ms[name], "gflops": flops / (ms[name] * 1e6),
             "x_shim_fp32": ms["shim fp32"] / ms[name], "share_of_fp32_fma_peak": flops / (ms[name] * 1e6) / peak,
             "max_rel_err": errors[name], "band": {"ms": quartile_band(samples[name])}}
            for name in samples]
    return BenchResult(
        benchmark="micro/gemm", settings={"size": size, "rounds": rounds, "blas_threads": threads},
        rows=rows,
        columns=[Column("candidate"), Column("ms", "ms", ".2f"), Column("gflops", "GFLOP/s", ".1f"),
                 Column("x_shim_fp32", "x shim fp32", ".2f"),
                 Column("share_of_fp32_fma_peak", "% fp32 FMA peak", ".0%"),
                 Column("max_rel_err", "max rel err vs fp64", ".1e")],
        key_fields=["candidate"], metrics=[Metric("ms", "lower")],
        notes=[f"{size}x{size}x{size}, OpenBLAS {threads} thread(s), medians of {rounds} rounds (shuffled order)",
               f"% fp32 FMA peak: of {peak:.1f} GFLOP/s ({threads} core(s) x {this_machine().peak_basis}); "
               "bf16/int8 paths have higher peaks of their own (AMX, VNNI), so they can exceed 100%"])
