"""Accelerator parts of the CLI: the `dspark info` lines (execution providers, each model's choice,
the GemmEx shim's kernel path) and `dspark bench gemm`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import click
import numpy as np

from dspark.cli.bench import bench


def model_provider_choices(repositories: Sequence[Path]) -> list[tuple[str, str]]:
    """(model, its provider choice and why) for every `onnx`-backend model in the repositories."""
    from dspark.accel import tensorrt_engine
    from dspark.accel.providers import ProviderRequest, choose
    from dspark.errors import ConfigError
    from dspark.repository.repo import load_entries

    entries, _ = load_entries(repositories)
    rows = []
    for entry in entries:
        if entry.config is None or entry.config.backend != "onnx":
            continue
        params = {key: value.string_value for key, value in entry.config.parameters.items()}
        try:
            choice = choose(ProviderRequest.from_parameters(params)).describe()
        except ConfigError as error:
            rows.append((entry.name, f"fails to load: {error}"))
            continue
        if params.get("engine") == "tensorrt":
            engine = tensorrt_engine.probe()
            choice = (f"{tensorrt_engine.ENGINE} ({engine.reason})" if engine.usable else
                      f"{choice}, {tensorrt_engine.ENGINE} not usable: {engine.reason}")
        rows.append((entry.name, choice))
    return rows


def echo_accelerator_info(repositories: Sequence[Path]) -> None:
    from dspark.accel import gemm
    from dspark.accel.providers import probe_all

    report = gemm.kernel_report()
    click.echo(f"GemmEx shim   {gemm.library_path().name}: paths built {', '.join(report.compiled)}; this CPU+OS runs "
               f"{', '.join(report.supported)}; chosen: {report.chosen}"
               + (f" ({gemm.SIMD_ENV}={report.override})" if report.override else
                  f" (auto; override with {gemm.SIMD_ENV}={'|'.join(gemm.PATHS)})"))
    cuda, why = gemm.cuda_available()
    click.echo(f"              CUDA back end: {'yes' if cuda else 'no'}, {why}")

    click.echo("providers     (usable = in this onnxruntime build + a device + its libraries)")
    for info, result in probe_all():
        mark = "usable" if result.usable else "no    "
        click.echo(f"  {info.short:<9} {mark} {info.vendor}: {result.reason}")
    for model, choice in model_provider_choices(repositories):
        click.echo(f"  model {model}: {choice}")


# --- `dspark bench gemm` ------------------------------------------------------------------------
def cpu_description() -> str:
    """The CPU's model name and the instruction sets the GEMM kernels care about (/proc/cpuinfo)."""
    name, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown CPU":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    keys = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    return f"{name} ({', '.join(k for k in keys if k in flags) or 'no AVX2'})"


def _median_ms(samples: list[float]) -> float:
    return float(np.median(samples)) * 1e3


@bench.command("gemm")
@click.option("--size", default=1024, show_default=True, help="M = N = K of the product.")
@click.option("--rounds", default=11, show_default=True,
              help="Interleaved rounds (every candidate once per round, in a shuffled order).")
@click.option("--threads", default=1, show_default=True, help="OpenBLAS threads, which the shim's kernels use too.")
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
def bench_gemm(size: int, rounds: int, threads: int, json_out: Path | None) -> None:
    """The GemmEx shim against OpenBLAS's sgemm called directly, fp32 vs bf16 vs int8 per kernel path."""
    import ctypes
    import os
    import time

    from dspark.accel import gemm as shim

    shim.library()
    blas = ctypes.CDLL("libscipy_openblas.so")  # the very OpenBLAS libhcblas.so loaded
    blas.scipy_openblas_set_num_threads(threads)
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((size, size)).astype(np.float32) for _ in range(2))
    exact = a.astype(np.float64) @ b.astype(np.float64)  # row-major a @ b: column-major b^T a^T below
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
        for round_index in range(rounds + 1):  # round 0 warms up
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
    finally:
        if previous is None:
            os.environ.pop(shim.SIMD_ENV, None)
        else:
            os.environ[shim.SIMD_ENV] = previous
    fp32_ms = _median_ms(samples["shim fp32"])
    flops = 2.0 * size ** 3
    rows = [{"candidate": name, "ms": _median_ms(times), "gflops": flops / (_median_ms(times) * 1e6),
             "x_shim_fp32": fp32_ms / _median_ms(times), "max_rel_err": errors[name]}
            for name, times in samples.items()]
    cpu = cpu_description()
    click.echo(f"{size}x{size}x{size}, {cpu}, OpenBLAS {threads} thread(s), medians of {rounds} rounds "
               "(shuffled order)")
    click.echo("candidate                  |       ms | GFLOP/s | x shim fp32 | max rel err vs fp64")
    click.echo("---------------------------|----------|---------|-------------|--------------------")
    for row in rows:
        click.echo(f"{row['candidate']:<26} | {row['ms']:8.2f} | {row['gflops']:7.1f} | {row['x_shim_fp32']:11.2f} | "
                   f"{row['max_rel_err']:.1e}")
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({"size": size, "rounds": rounds, "blas_threads": threads, "cpu": cpu,
                                        "rows": rows}, indent=2))
        click.echo(f"wrote {json_out}")
