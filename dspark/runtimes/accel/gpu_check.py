"""Check the whole GPU path of the accelerator layer in one run of a few minutes.

    python tools/gpu_check.py --strict [--repository model_repository] [--size 4096] [--json-out FILE]
    python3 -m dspark.runtimes.accel.gpu_check --strict ...   # the same from a checkout's root, not installed

1. the machine: GPU, CuPy, ONNX Runtime and its providers, TensorRT;
2. ONNX Runtime's CUDA and TensorRT execution providers through the provider registry, on the
   demo classifier, against the CPU provider (or the fallback the policy applies, and why);
3. the GemmEx shim's CUDA back end (cuBLAS through CuPy) under every vendor alias and dtype, the
   same column-major calls on the GPU and in the CPU library, against a float64 reference;
4. GemmEx throughput on the GPU at --size^3 (fp32, TF32, bf16, int8) next to CuPy's own matmul;
5. the demo transformer with every product through the shim on the GPU, against ONNX Runtime
   running its ONNX twin on the CPU;
6. a TensorRT engine built from that ONNX file, cached (a second open is a cache hit), run.

Each check prints one line (ok / skip / FAIL and what it measured), then one line counts them;
the exit status is 1 if any check failed, or with --strict (the way to run it on a GPU machine)
if any was skipped: a skipped check has not shown that its path works. Without an NVIDIA GPU the
script prints one line and exits 0 (1 with --strict).
"""
from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from dspark.runtimes.accel import devices
from dspark.paths import project_root

RESULTS: list[dict] = []


class Skip(Exception):
    """A check that cannot run here, with the reason."""


def check(name: str):
    def run(function):
        start = time.perf_counter()
        try:
            detail = function()
            status = "ok"
        except Skip as reason:
            status, detail = "skip", str(reason)
        except Exception as error:  # a failed check is reported, the others still run
            status, detail = "FAIL", f"{type(error).__name__}: {error}"
            traceback.print_exc(limit=3)
        seconds = time.perf_counter() - start
        RESULTS.append({"check": name, "status": status, "detail": detail, "seconds": round(seconds, 2)})
        print(f"[{status:>4}] {name} ({seconds:.1f} s): {detail}", flush=True)
        return function
    return run


def relative_error(result, reference) -> float:
    result, reference = np.asarray(result, np.float64), np.asarray(reference, np.float64)
    return float(np.abs(result - reference).max() / max(np.abs(reference).max(), 1e-30))


def run_gpu_check(args) -> int:
    """The command's work; ``args`` holds its options as attributes (dspark/cli builds it)."""

    gpu = devices.nvidia_gpus()
    if not gpu.present:
        print(f"gpu_check: {'FAIL (--strict)' if args.strict else 'skipped'}, no NVIDIA GPU here ({gpu.detail})")
        return 1 if args.strict else 0

    import onnxruntime as ort

    from dspark.runtimes.accel import gemm, providers
    from dspark.runtimes.accel.gemm import BFLOAT16, ComputeType, DataType, Gemm, Operation

    classifier = args.repository / "mlp_classifier/1/model.onnx"
    twin = args.repository / "fused_transformer_onnx/1/model.onnx"
    weights = args.repository / "fused_transformer/1/weights.npz"
    rng = np.random.default_rng(0)

    @check("machine")
    def machine():
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        try:
            import tensorrt

            trt = f"tensorrt {tensorrt.__version__}"
        except ImportError as error:
            trt = f"tensorrt not importable ({error})"
        eps = sorted({d.ep_name for d in ort.get_ep_devices()}) if hasattr(ort, "get_ep_devices") else []
        return (f"{gpu.detail}, sm{props['major']}{props['minor']}, {props['totalGlobalMem'] / 2**30:.0f} GiB; "
                f"Python {platform.python_version()}, numpy {np.__version__}, CuPy {cupy.__version__} "
                f"(CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}); onnxruntime {ort.__version__} with "
                f"{', '.join(ort.get_available_providers())} (EP devices: {', '.join(eps) or 'none'}); {trt}")

    def ort_provider_check(preference: tuple[str, ...], options: dict) -> str:
        from dspark.runtimes.onnx_session import OnnxRunner

        features = rng.standard_normal((8, 16)).astype(np.float32)
        cpu = OnnxRunner(classifier).run({"features": features})["probabilities"]
        runner = OnnxRunner(classifier, providers=providers.ProviderRequest(providers=preference, options=options))
        out = runner.run({"features": features})["probabilities"]
        error = relative_error(out, cpu)
        if runner.choice.chosen != providers.lookup(preference[0]).name:
            raise Skip(f"runs on {runner.choice.describe()}; output equals the CPU provider's within {error:.1e}")
        if error > 1e-3:
            raise AssertionError(f"{runner.choice.chosen} differs from the CPU provider by {error:.1e}")
        return f"{runner.choice.describe()}, session providers {runner.session.get_providers()}, rel err {error:.1e}"

    @check("ONNX Runtime CUDA execution provider")
    def cuda_provider():
        return ort_provider_check(("CUDA", "CPU"), {"CUDA": {"device_id": 0}})

    @check("ONNX Runtime TensorRT execution provider")
    def tensorrt_provider():
        cache = tempfile.mkdtemp(prefix="trt-ep-cache-")
        return ort_provider_check(("TensorRT", "CUDA", "CPU"), {"TensorRT": {
            "trt_engine_cache_enable": True, "trt_engine_cache_path": cache, "trt_fp16_enable": False}})

    @check("GemmEx on CUDA (cuBLAS through CuPy), every vendor alias and dtype, vs float64 and the CPU library")
    def gemm_correctness():
        import cupy

        m, n, k = 200, 144, 328
        lines = []
        cases = [("fp32", np.float32, None, 1e-5), ("bf16", BFLOAT16, np.float32, 1e-5),
                 ("fp16", np.float16, np.float32, 1e-5), ("fp32 FAST_16BF", np.float32, None, 1e-2),
                 ("fp32 FAST_TF32", np.float32, None, 2e-3)]

        def device_array(host):  # CuPy has no bf16 dtype: bf16 travels as its uint16 bits
            return cupy.asarray(host.view(np.uint16) if host.dtype == BFLOAT16 else host)

        for vendor in gemm.VENDORS:
            shim = Gemm(vendor, "cuda")
            assert shim.device == "cuda", shim.describe()
            worst = 0.0
            for label, dtype, out_dtype, tolerance in cases:
                a = rng.uniform(-1, 1, (m, k)).astype(dtype)
                b = rng.uniform(-1, 1, (k, n)).astype(dtype)
                compute = {"fp32 FAST_16BF": ComputeType.COMPUTE_32F_FAST_16BF,
                           "fp32 FAST_TF32": ComputeType.COMPUTE_32F_FAST_TF32}.get(label)
                out = shim.matmul(device_array(a), device_array(b), out_dtype=out_dtype, compute=compute,
                                  in_type=gemm.DATA_TYPE_OF[np.dtype(dtype)])
                error = relative_error(cupy.asnumpy(out), a.astype(np.float64) @ b.astype(np.float64))
                assert error < tolerance, f"{vendor} {label}: rel err {error:.1e} > {tolerance}"
                worst = max(worst, error) if tolerance < 1e-4 else worst
            lines.append(f"{vendor} ok (fp32/bf16/fp16 worst {worst:.1e})")
        # one raw column-major call, transposed and padded, run by the GPU and by the CPU library
        shim_gpu, shim_cpu = Gemm("hcblas", "cuda"), Gemm("hcblas", "cpu")
        lda, ldb, ldc = k + 3, n + 5, m + 7  # op(A) = A^T: A is k x m; op(B) = B^T: B is n x k
        A = rng.uniform(-1, 1, lda * m).astype(np.float32)
        B = rng.uniform(-1, 1, ldb * k).astype(np.float32)
        C = rng.uniform(-1, 1, ldc * n).astype(np.float32)
        C_gpu = cupy.asarray(C)
        shim_gpu.gemm_ex(Operation.T, Operation.T, m, n, k, 1.5, cupy.asarray(A), DataType.R_32F, lda,
                         cupy.asarray(B), DataType.R_32F, ldb, 0.5, C_gpu, DataType.R_32F, ldc)
        C_cpu = C.copy()
        shim_cpu.gemm_ex(Operation.T, Operation.T, m, n, k, 1.5, A, DataType.R_32F, lda, B, DataType.R_32F, ldb,
                         0.5, C_cpu, DataType.R_32F, ldc)
        agreement = relative_error(cupy.asnumpy(C_gpu), C_cpu)
        assert agreement < 1e-5, f"GPU and CPU library disagree on a transposed, padded call: {agreement:.1e}"
        lines.append(f"transposed+padded raw call GPU vs CPU library {agreement:.1e}")
        int8_a = rng.integers(-128, 128, (m, k)).astype(np.int8)
        int8_b = rng.integers(-128, 128, (k, n)).astype(np.int8)
        try:
            out = shim_gpu.matmul(cupy.asarray(int8_a), cupy.asarray(int8_b))
            exact = bool((cupy.asnumpy(out) == int8_a.astype(np.int64) @ int8_b).all())
            lines.append(f"int8->int32 {'exact' if exact else 'WRONG'}")
            assert exact
        except gemm.GemmStatusError:
            raise
        except Exception as error:  # cuBLAS's own restriction (e.g. int8 layouts), reported as found
            lines.append(f"int8->int32 (N,N) refused by cuBLAS: {error}")
        try:
            shim_gpu.gemm_ex(0, 0, 16, 8, 8, 1.0, cupy.zeros(256, np.float32), DataType.R_32F, 15,
                             cupy.zeros(64, np.float32), DataType.R_32F, 8, 0.0, cupy.zeros(128, np.float32),
                             DataType.R_32F, 16)
            raise AssertionError("lda < m was accepted")
        except gemm.GemmStatusError as error:
            assert error.status == gemm.Status.INVALID_VALUE
            lines.append("lda < m -> INVALID_VALUE before the GPU is called")
        return "; ".join(lines)

    @check(f"GemmEx throughput on the GPU at {args.size}^3 (CUDA events, median of 10)")
    def gemm_throughput():
        import cupy

        size = args.size
        shim = Gemm("cublas", "cuda")

        def timed(run) -> float:
            run()
            cupy.cuda.Device().synchronize()
            times = []
            for _ in range(10):
                start, stop = cupy.cuda.Event(), cupy.cuda.Event()
                start.record()
                run()
                stop.record()
                stop.synchronize()
                times.append(cupy.cuda.get_elapsed_time(start, stop))
            return float(np.median(times))

        flops = 2.0 * size ** 3
        a32 = cupy.random.standard_normal((size, size), dtype=np.float32)
        b32 = cupy.random.standard_normal((size, size), dtype=np.float32)
        a16, b16 = (cupy.asarray(cupy.asnumpy(x).astype(BFLOAT16).view(np.uint16)) for x in (a32, b32))
        ai = cupy.random.randint(-128, 128, (size, size)).astype(np.int8)
        bi = cupy.random.randint(-128, 128, (size, size)).astype(np.int8)
        out32 = cupy.empty((size, size), np.float32)
        out_i = cupy.empty((size, size), np.int32)
        runs = {
            "fp32": lambda: shim.matmul(a32, b32, out=out32),
            "fp32 FAST_TF32": lambda: shim.matmul(a32, b32, out=out32, compute=ComputeType.COMPUTE_32F_FAST_TF32),
            "bf16 in, fp32 out": lambda: shim.matmul(a16, b16, out=out32, out_dtype=np.float32,
                                                     in_type=DataType.R_16BF),
            "CuPy matmul fp32": lambda: cupy.matmul(a32, b32, out=out32),
        }
        # int8: cuBLAS wants op(A) = T for int8 ("TN"); row-major a @ b^T is that layout
        runs["int8 (TN) -> int32"] = lambda: shim.gemm_ex(Operation.T, Operation.N, size, size, size, 1, bi,
                                                          DataType.R_8I, size, ai, DataType.R_8I, size, 0, out_i,
                                                          DataType.R_32I, size, ComputeType.COMPUTE_32I)
        parts = []
        for label, run in runs.items():
            try:
                ms = timed(run)
                unit = "TOP/s" if "int8" in label else "TFLOP/s"
                parts.append(f"{label} {ms:.2f} ms = {flops / ms / 1e9:.0f} {unit}")
            except Exception as error:
                parts.append(f"{label} failed: {type(error).__name__}: {error}")
        return "; ".join(parts)

    @check("transformer with every product through the shim on the GPU vs ONNX Runtime on the CPU")
    def transformer():
        from dspark.runtimes.accel.gemm_transformer import GemmTransformer

        ids = rng.integers(0, 512, (4, 64)).astype(np.int64)
        session = ort.InferenceSession(str(twin), providers=["CPUExecutionProvider"])
        reference = session.run(None, {"INPUT_IDS": ids})[0]
        parts = []
        for compute, tolerance in (("fp32", 1e-3), ("bf16", 0.1)):
            engine = GemmTransformer.load(weights, vendor="cublas", device="cuda", compute=compute)
            engine.forward(ids)
            start = time.perf_counter()
            hidden = engine.forward(ids)
            ms = (time.perf_counter() - start) * 1e3
            error = float(np.abs(hidden - reference).max())
            assert error < tolerance, f"{compute}: max |delta| {error:.2e} vs ONNX Runtime"
            parts.append(f"{compute}: max |delta| {error:.1e}, {ms:.1f} ms per forward ({engine.describe()})")
        return "; ".join(parts)

    @check("TensorRT engine built from the transformer's ONNX file, cached, run")
    def tensorrt_engine():
        from dspark.runtimes.accel import tensorrt_engine as trt_engine

        result = trt_engine.probe()
        if not result.usable:
            raise Skip(f"{result.reason}; the onnx backend falls back to ONNX Runtime as its policy says")
        cache = Path(tempfile.mkdtemp(prefix="trt-engine-cache-"))
        first = trt_engine.TensorRTRunner(twin, "fused_transformer_onnx", "1", cache)
        second = trt_engine.TensorRTRunner(twin, "fused_transformer_onnx", "1", cache)
        assert not first.cache_hit and second.cache_hit, "the second open should load the cached plan"
        ids = rng.integers(0, 512, (2, 32)).astype(np.int64)
        hidden = second.run({"INPUT_IDS": ids})["HIDDEN"]
        reference = ort.InferenceSession(str(twin), providers=["CPUExecutionProvider"]).run(
            None, {"INPUT_IDS": ids})[0]
        error = float(np.abs(hidden - reference).max())
        assert error < 1e-2, f"engine output differs from ONNX Runtime by {error:.2e}"
        return f"{first.describe()}; then {second.describe()}; max |delta| vs ONNX Runtime {error:.1e}"

    line, status = summary(RESULTS, args.strict)
    print(line)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"gpu": gpu.detail, "strict": args.strict, "results": RESULTS}, indent=2))
    return status


def summary(results: list[dict], strict: bool) -> tuple[str, int]:
    """The closing line and the exit status: 1 when a check failed, or (strict) was skipped."""
    counts = {status: sum(r["status"] == status for r in results) for status in ("ok", "skip", "FAIL")}
    skipped = f"{counts['skip']} skipped" + (" (failures with --strict)" if strict and counts["skip"] else "")
    line = f"gpu_check: {counts['ok']} of {len(results)} checks passed, {skipped}, {counts['FAIL']} failed"
    return line, 1 if counts["FAIL"] or (strict and counts["skip"]) else 0


