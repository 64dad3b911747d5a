"""The calibration behind the fused layer's GEMM choice: OpenBLAS's sgemm (the library
dspark._ext.fused links) against ONNX Runtime's MatMul (MLAS, W constant so packed once at session
creation), sgemm alone, 1 thread."""
from __future__ import annotations

import statistics
from typing import Callable, Sequence

import numpy as np

from dspark.bench.machine import this_machine
from dspark.bench.micro import log_nothing, register
from dspark.bench.micro.fused import parse_shape
from dspark.bench.results import BenchResult, Metric
from dspark.bench.table import Column
from dspark.bench.timing import interleaved_samples, quartile_band

DEFAULT_SHAPES = ("16x768x3072", "128x768x3072", "512x1024x4096")


def ort_matmul(w: np.ndarray):
    """y = x @ W in ONNX Runtime with W as an initializer (what MLAS packs once)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from dspark.runtimes.onnx_session import make_session_options

    k, n = w.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])], [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), make_session_options(1, 1, graph_optimization_level="all"),
                                   providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {"x": x})[0]


@register("sgemm", "OpenBLAS sgemm vs ONNX Runtime MatMul (MLAS), the fused layer's GEMM calibration")
def run_sgemm(shapes: Sequence[str] = DEFAULT_SHAPES, rounds: int = 21, budget: float = 10.0,
              log: Callable[[str], None] = log_nothing) -> BenchResult:
    from threadpoolctl import threadpool_limits

    from dspark.kernels.fused import sgemm

    peak = this_machine().fp32_peak_gflops(1)
    rows_out = []
    with threadpool_limits(1):
        for text in shapes:
            m, k, n = parse_shape(text)
            rng = np.random.default_rng(0)
            a = rng.standard_normal((m, k), dtype=np.float32)
            w = rng.standard_normal((k, n), dtype=np.float32)
            mlas = ort_matmul(w)
            samples = interleaved_samples({"openblas": lambda: sgemm(a, w), "mlas": lambda: mlas(a)},
                                          rounds=rounds, budget_s=budget)
            t = {name: statistics.median(s) for name, s in samples.items()}
            flop = 2.0 * m * k * n
            rows_out.append({
                "shape": f"{m}×{k}×{n}", "m": m, "k": k, "n": n,
                "openblas_ms": t["openblas"] * 1e3, "mlas_ms": t["mlas"] * 1e3,
                "openblas_share_of_peak": flop / t["openblas"] / 1e9 / peak,
                "mlas_share_of_peak": flop / t["mlas"] / 1e9 / peak,
                "band": {"openblas_ms": quartile_band(samples["openblas"]), "mlas_ms": quartile_band(samples["mlas"])},
            })
            log(f"  {text}: OpenBLAS {t['openblas'] * 1e3:.2f} ms, MLAS {t['mlas'] * 1e3:.2f} ms")
    return BenchResult(
        benchmark="micro/sgemm", settings={"shapes": list(shapes), "rounds": rounds, "budget_s": budget, "threads": 1},
        rows=rows_out,
        columns=[Column("shape", "M×K×N"), Column("openblas_ms", "OpenBLAS ms", ".2f"),
                 Column("mlas_ms", "ONNX Runtime MatMul (MLAS) ms", ".2f"),
                 Column("openblas_share_of_peak", "OpenBLAS % FMA peak", ".0%"),
                 Column("mlas_share_of_peak", "MLAS % FMA peak", ".0%")],
        key_fields=["m", "k", "n"], metrics=[Metric("openblas_ms", "lower"), Metric("mlas_ms", "lower")],
        notes=[f"1 thread, medians of interleaved rounds; % FMA peak of {peak:.1f} GFLOP/s (one core, "
               f"{this_machine().peak_basis})"])
