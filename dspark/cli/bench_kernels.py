"""`dspark bench kernels` and `dspark bench pool`: the fused layer against unfused
numpy/scipy and ONNX Runtime, and the BFC pool against np.empty and first-fit."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import numpy as np

DEFAULT_SHAPES = ("1x768x3072", "16x768x3072", "128x768x3072", "512x768x3072",
                  "1x1024x4096", "16x1024x4096", "128x1024x4096", "512x1024x4096")


@dataclass
class KernelRow:
    rows: int
    d: int
    n: int
    fused_ms: float
    numpy_ms: float
    ort_ms: float
    speedup_vs_numpy: float
    speedup_vs_ort: float
    fused_gflops: float
    share_of_sgemm_peak: float
    fused_max_rel_err: float
    ort_max_rel_err: float
    simd_path: str


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
@click.option("--rounds", default=15, show_default=True, help="interleaved repeats per shape (median)")
@click.option("--json", "json_path", type=click.Path(path_type=Path),
              default=Path("bench-results/kernels.json"), show_default=True)
def bench_kernels(shapes: tuple[str, ...], threads: int, rounds: int, json_path: Path) -> None:
    """Fused LayerNorm+GELU+MatMul vs unfused numpy/scipy vs ONNX Runtime (ORT_ENABLE_ALL)."""
    from threadpoolctl import threadpool_limits

    from dspark.kernels.dispatch import dispatch_report
    from dspark.kernels.fused import FusedLNGeluMatMul, reference_fused, sgemm
    from dspark.kernels.ort_layer import OrtFusedLayer, unfused_numpy
    from dspark.kernels.timing import interleaved_medians

    report = dispatch_report()
    results: list[KernelRow] = []
    with threadpool_limits(threads):
        big = np.random.default_rng(1).standard_normal((2048, 2048), dtype=np.float32)
        peak_s = interleaved_medians({"sgemm": lambda: sgemm(big, big)}, rounds=5, budget_s=5)["sgemm"]
        peak = 2 * 2048 ** 3 / peak_s / 1e9
        click.echo(f"SIMD path {report.chosen} (compiled {report.compiled}, CPU {report.supported}); "
                   f"BLAS {report.blas}; threads {threads}; sgemm peak 2048^3: {peak:.1f} GFLOP/s")
        ort_fusions: list[str] = []
        for text in shapes or DEFAULT_SHAPES:
            rows, d, n = _parse_shape(text)
            rng = np.random.default_rng(0)
            x = rng.standard_normal((rows, d), dtype=np.float32)
            gamma = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
            beta = (0.1 * rng.standard_normal(d)).astype(np.float32)
            w = (rng.standard_normal((d, n)) / np.sqrt(d)).astype(np.float32)
            b = (0.1 * rng.standard_normal(n)).astype(np.float32)
            layer = FusedLNGeluMatMul(gamma, beta, w, b, threads=threads)
            ort = OrtFusedLayer(gamma, beta, w, b, threads=threads)
            ort_fusions = ort.optimized_op_types
            out = np.empty((rows, n), np.float32)
            times = interleaved_medians({
                "fused": lambda: layer(x, out=out),
                "numpy": lambda: unfused_numpy(x, gamma, beta, w, b),
                "ort": lambda: ort(x),
            }, rounds=rounds)
            ref = reference_fused(x, gamma, beta, w, b)
            scale = np.abs(ref).max()
            flops = 2.0 * rows * d * n
            results.append(KernelRow(
                rows, d, n, times["fused"] * 1e3, times["numpy"] * 1e3, times["ort"] * 1e3,
                times["numpy"] / times["fused"], times["ort"] / times["fused"],
                flops / times["fused"] / 1e9, flops / times["fused"] / 1e9 / peak,
                float(np.abs(layer(x) - ref).max() / scale), float(np.abs(ort(x) - ref).max() / scale),
                layer.simd_path))
            r = results[-1]
            click.echo(f"  {rows}x{d}x{n}: fused {r.fused_ms:.3f} ms, numpy {r.numpy_ms:.3f} ms, "
                       f"ORT {r.ort_ms:.3f} ms", err=True)
    click.echo(f"ORT optimized graph: {' + '.join(ort_fusions)}")
    _print_table(
        ["rows", "d->n", "fused ms", "numpy ms", "ORT ms", "x numpy", "x ORT", "GFLOP/s", "% peak", "rel err"],
        [[str(r.rows), f"{r.d}->{r.n}", f"{r.fused_ms:.3f}", f"{r.numpy_ms:.3f}", f"{r.ort_ms:.3f}",
          f"{r.speedup_vs_numpy:.2f}", f"{r.speedup_vs_ort:.2f}", f"{r.fused_gflops:.1f}",
          f"{100 * r.share_of_sgemm_peak:.0f}", f"{r.fused_max_rel_err:.1e}"] for r in results])
    _write_json(json_path, {"threads": threads, "sgemm_peak_gflops": peak, "dispatch": asdict(report),
                            "ort_optimized_ops": ort_fusions, "rows": [asdict(r) for r in results]})
