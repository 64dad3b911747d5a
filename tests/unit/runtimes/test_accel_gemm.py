"""The GemmEx shim: property tests against a float64 reference over shapes, transposes, leading
dimensions, dtypes, every vendor alias and every kernel path this CPU runs; cuBLAS status codes;
CANN's row-major adapter; a C program written for cuBLAS compiled against the library."""
from __future__ import annotations

import shutil
import subprocess
import sysconfig

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark.runtimes.accel import gemm
from dspark.runtimes.accel.gemm import (BFLOAT16, DTYPES, VENDORS, ComputeType, DataType, Gemm, GemmStatusError, Operation,
                               Status, acl_gemm_ex, kernel_report)
from dspark.paths import project_root

R = DataType
COMPUTE = ComputeType
# (A/B type, C type, compute type, tolerance relative to |alpha| |op(A)| |op(B)| + |beta C|)
COMBINATIONS = [
    (R.R_32F, R.R_32F, COMPUTE.COMPUTE_32F, 1e-5),
    (R.R_32F, R.R_32F, COMPUTE.COMPUTE_32F_FAST_16BF, 1.6e-2),  # inputs rounded to bf16
    (R.R_32F, R.R_32F, COMPUTE.COMPUTE_32F_FAST_TF32, 1e-5),
    (R.R_64F, R.R_64F, COMPUTE.COMPUTE_64F, 1e-12),
    (R.R_16BF, R.R_32F, COMPUTE.COMPUTE_32F, 1e-5),
    (R.R_16BF, R.R_16BF, COMPUTE.COMPUTE_32F, 8e-3),  # one bf16 rounding of the result
    (R.R_16F, R.R_32F, COMPUTE.COMPUTE_32F, 1e-5),
    (R.R_16F, R.R_16F, COMPUTE.COMPUTE_32F, 1e-3),
    (R.R_16F, R.R_16F, COMPUTE.COMPUTE_16F, 1e-3),
    (R.R_8I, R.R_32I, COMPUTE.COMPUTE_32I, 0.0),  # exact
    (R.R_8I, R.R_32F, COMPUTE.COMPUTE_32F, 1e-6),
]
PATHS = [path for path in kernel_report().supported]


@pytest.fixture(params=PATHS)
def kernel_path(request, monkeypatch):
    """Every CPU kernel path this machine runs, forced through DSPARK_GEMM_SIMD."""
    monkeypatch.setenv(gemm.SIMD_ENV, request.param)
    return request.param


def random_values(rng: np.random.Generator, data_type: DataType, size: int) -> np.ndarray:
    if data_type in (R.R_8I, R.R_32I):
        return rng.integers(-128 if data_type == R.R_8I else -1000, 128 if data_type == R.R_8I else 1000,
                            size).astype(DTYPES[data_type])
    return rng.uniform(-2, 2, size).astype(DTYPES[data_type])


def column_major(flat: np.ndarray, rows: int, cols: int, ld: int) -> np.ndarray:
    """The rows x cols float64 matrix a column-major buffer with leading dimension ld holds."""
    if rows == 0 or cols == 0:
        return np.zeros((rows, cols))
    padded = np.zeros(ld * cols, np.float64)
    padded[:flat.size] = flat.astype(np.float64)
    return padded.reshape(cols, ld).T[:rows]


@st.composite
def gemm_calls(draw):
    m, n, k = (draw(st.integers(0, 40)) for _ in range(3))
    transa, transb = (draw(st.sampled_from(list(Operation))) for _ in range(2))
    pads = [draw(st.integers(0, 3)) for _ in range(3)]
    combination = draw(st.sampled_from(COMBINATIONS))
    scalars = st.sampled_from([0, 1, -1, 2]) if combination[0] == R.R_8I else st.sampled_from([0.0, 1.0, -0.5, 1.25])
    return dict(m=m, n=n, k=k, transa=transa, transb=transb, pads=pads, combination=combination,
                alpha=draw(scalars), beta=draw(scalars), vendor=draw(st.sampled_from(VENDORS)),
                seed=draw(st.integers(0, 2**32 - 1)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(call=gemm_calls())
def test_gemm_ex_matches_a_float64_reference(kernel_path, call):
    m, n, k, transa, transb = call["m"], call["n"], call["k"], call["transa"], call["transb"]
    in_type, out_type, compute, tolerance = call["combination"]
    rng = np.random.default_rng(call["seed"])
    a_rows, a_cols = (m, k) if transa == Operation.N else (k, m)
    b_rows, b_cols = (k, n) if transb == Operation.N else (n, k)
    lda, ldb, ldc = (max(1, rows) + pad for rows, pad in zip((a_rows, b_rows, m), call["pads"]))
    A = random_values(rng, in_type, max(1, lda * a_cols))
    B = random_values(rng, in_type, max(1, ldb * b_cols))
    C = random_values(rng, out_type, max(1, ldc * n))
    if call["beta"] == 0 and out_type not in (R.R_32I,):
        C[:] = np.nan  # beta == 0: C must not be read
    before = C.copy()
    Gemm(call["vendor"], "cpu").gemm_ex(transa, transb, m, n, k, call["alpha"], A, in_type, lda, B, in_type, ldb,
                                        call["beta"], C, out_type, ldc, compute)

    op_a = column_major(A, a_rows, a_cols, lda)
    op_b = column_major(B, b_rows, b_cols, ldb)
    op_a, op_b = (op_a if transa == Operation.N else op_a.T), (op_b if transb == Operation.N else op_b.T)
    old = column_major(before, m, n, ldc) if call["beta"] != 0 else np.zeros((m, n))
    reference = call["alpha"] * (op_a @ op_b) + call["beta"] * old
    scale = abs(call["alpha"]) * (np.abs(op_a) @ np.abs(op_b)) + abs(call["beta"]) * np.abs(old)
    result = column_major(C, m, n, ldc)
    assert np.all(np.abs(result - reference) <= tolerance * scale + 1e-30), (call, np.abs(result - reference).max())
    untouched = np.ones(max(1, ldc * n), bool)
    untouched[[j * ldc + i for j in range(n) for i in range(m)]] = False
    assert C[untouched].tobytes() == before[untouched].tobytes()  # padding rows of C stay as they were


@pytest.fixture(params=[1, 3])
def threads(request):
    """The kernels take OpenBLAS's thread count: run with one thread and with three."""
    import ctypes

    gemm.library()
    blas = ctypes.CDLL("libscipy_openblas.so")
    before = blas.scipy_openblas_get_num_threads()
    blas.scipy_openblas_set_num_threads(request.param)
    yield request.param
    blas.scipy_openblas_set_num_threads(before)


@pytest.mark.parametrize("vendor", VENDORS)
def test_matmul_for_each_dtype_through_each_vendor_name(kernel_path, vendor, threads):
    rng = np.random.default_rng(1)
    shim = Gemm(vendor, "cpu")
    a32, b32 = rng.standard_normal((100, 50)).astype(np.float32), rng.standard_normal((50, 33)).astype(np.float32)
    exact = a32.astype(np.float64) @ b32
    np.testing.assert_allclose(shim.matmul(a32, b32), exact, rtol=1e-4, atol=1e-4)
    ab, bb = a32.astype(BFLOAT16), b32.astype(BFLOAT16)
    np.testing.assert_allclose(shim.matmul(ab, bb, out_dtype=np.float32),
                               ab.astype(np.float64) @ bb.astype(np.float64), rtol=1e-5, atol=1e-4)
    fast = shim.matmul(a32, b32, compute=ComputeType.COMPUTE_32F_FAST_16BF)
    assert np.abs(fast - exact).max() / np.abs(exact).max() < 1e-2
    ai, bi = (rng.integers(-128, 128, shape).astype(np.int8) for shape in ((100, 130), (130, 9)))
    np.testing.assert_array_equal(shim.matmul(ai, bi), ai.astype(np.int64) @ bi)


@pytest.mark.parametrize("field, kwargs, status", [
    ("lda", dict(lda=15), Status.INVALID_VALUE),  # op(A) = A: lda >= m = 16
    ("ldb", dict(ldb=7), Status.INVALID_VALUE),
    ("ldc", dict(ldc=0), Status.INVALID_VALUE),
    ("m", dict(m=-1), Status.INVALID_VALUE),
    ("transa", dict(transa=3), Status.INVALID_VALUE),
    ("algo", dict(algo=42), Status.INVALID_VALUE),
    ("computeType", dict(compute=5), Status.INVALID_VALUE),
    ("(Atype, Btype, Ctype)=(R_32F, R_32F, R_32I)", dict(c_type=R.R_32I), Status.NOT_SUPPORTED),
    ("(Atype, Btype, Ctype)=(R_8I, R_8I, R_32I) with computeType=68",
     dict(a_type=R.R_8I, c_type=R.R_32I), Status.NOT_SUPPORTED),
])
def test_invalid_arguments_get_cublas_status_codes(field, kwargs, status):
    args = dict(transa=0, transb=0, m=16, n=8, k=8, lda=16, ldb=8, ldc=16, a_type=R.R_32F, c_type=R.R_32F,
                compute=ComputeType.COMPUTE_32F, algo=-1)
    args.update(kwargs)
    a = np.zeros(16 * 8, DTYPES[args["a_type"]])
    c = np.full(16 * 8, 7, DTYPES[args["c_type"]])
    with pytest.raises(GemmStatusError) as caught:
        Gemm("cublas", "cpu").gemm_ex(args["transa"], args["transb"], args["m"], args["n"], args["k"], 1, a,
                                      args["a_type"], args["lda"], a, args["a_type"], args["ldb"], 0, c,
                                      args["c_type"], args["ldc"], args["compute"], args["algo"])
    assert caught.value.status == status and field in str(caught.value)
    assert np.all(c == 7)


def test_buffers_that_do_not_hold_what_the_call_describes_are_refused():
    full = np.zeros(64, np.float32)
    for a, message in ((np.zeros(10, np.float32), "A holds 10 elements.*needs 64"),
                       (np.zeros(64, np.float64), "A holds float64 elements, not R_32F"),
                       (np.zeros((8, 16), np.float32)[:, ::2], "A must be one contiguous buffer")):
        with pytest.raises(GemmStatusError, match=message):
            Gemm().gemm_ex(0, 0, 8, 8, 8, 1.0, a, R.R_32F, 8, full, R.R_32F, 8, 0.0, full.copy(), R.R_32F, 8)


def test_a_bad_kernel_override_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(gemm.SIMD_ENV, "avx9000")
    assert kernel_report().chosen.startswith("error: DSPARK_GEMM_SIMD=avx9000")
    with pytest.raises(GemmStatusError, match="NOT_SUPPORTED: DSPARK_GEMM_SIMD=avx9000: expected one of"):
        Gemm().matmul(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))
    for path in set(kernel_report().compiled) - set(PATHS):  # paths this CPU cannot run are refused
        monkeypatch.setenv(gemm.SIMD_ENV, path)
        assert "cannot run" in kernel_report().chosen


def test_unknown_vendor_and_unusable_device_are_config_errors():
    from dspark.errors import ConfigError

    with pytest.raises(ConfigError, match="gemm_vendor.*one of hcblas, cublas"):
        Gemm("rocblas")
    if not gemm.cuda_available()[0]:
        with pytest.raises(ConfigError, match="gemm_device: cuda is not usable here"):
            Gemm("cublas", "cuda")
        assert Gemm("cublas", "auto").device == "cpu"


@pytest.mark.parametrize("trans_a, trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("a_type, c_type", [(1, 1), (1, 0), (2, 0), (2, 3), (0, 0)])
def test_cann_adapter_is_row_major_with_the_stream_last(kernel_path, trans_a, trans_b, a_type, c_type):
    acl_dtype = {0: np.float32, 1: np.float16, 2: np.int8, 3: np.int32}
    rng = np.random.default_rng(2)
    m, n, k = 9, 13, 21
    a = (rng.integers(-9, 10, (k, m) if trans_a else (m, k))).astype(acl_dtype[a_type])
    b = (rng.integers(-9, 10, (n, k) if trans_b else (k, n))).astype(acl_dtype[a_type])
    c = np.ones((m, n), acl_dtype[c_type])
    acl_gemm_ex(trans_a, trans_b, m, n, k, 2, a, -1, a_type, b, -1, a_type, 1, c, -1, c_type)
    op_a, op_b = (a.T if trans_a else a).astype(np.float64), (b.T if trans_b else b).astype(np.float64)
    np.testing.assert_allclose(c.astype(np.float64), 2 * op_a @ op_b + 1, rtol=1e-3)


def test_cann_alpha_and_beta_have_cs_type_for_bf16():
    """Two bytes each, as CANN's header says: what follows them in memory is not read."""
    import ctypes

    rng = np.random.default_rng(3)
    a = rng.integers(-4, 5, (3, 5)).astype(BFLOAT16)
    b = rng.integers(-4, 5, (5, 4)).astype(BFLOAT16)
    c = np.ones((3, 4), BFLOAT16)
    alpha = np.array([np.array(2, BFLOAT16).view(np.uint16), 0xFFFF], np.uint16)  # 2.0, then NaN bits
    beta = np.array([np.array(1, BFLOAT16).view(np.uint16), 0xFFFF], np.uint16)  # 1.0, then NaN bits
    lib = gemm.library()
    assert lib.aclblasGemmEx(0, 0, 0, 3, 4, 5, alpha.ctypes.data, a.ctypes.data, -1, 27, b.ctypes.data, -1, 27,
                             beta.ctypes.data, c.ctypes.data, -1, 27, 0, None) == 0, lib.hcblasLastError()
    expected = 2 * a.astype(np.float64) @ b.astype(np.float64) + 1
    np.testing.assert_allclose(c.astype(np.float64), expected, rtol=8e-3)
    ctypes.memset(c.ctypes.data, 0, c.nbytes)
    acl_gemm_ex(0, 0, 3, 4, 5, 2, a, -1, 27, b, -1, 27, 0, c, -1, 27)  # the binding passes C's type too
    np.testing.assert_allclose(c.astype(np.float64), expected - 1, rtol=8e-3)


@pytest.mark.parametrize("in_type, out_type, compute", [c[:3] for c in COMBINATIONS if c[0] != R.R_8I])
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_alpha_zero_leaves_beta_c_whatever_a_and_b_hold(kernel_path, in_type, out_type, compute, beta):
    """BLAS's rule, for every type: alpha == 0 reads neither A nor B (NaN there stays out of C)."""
    m, n, k = 5, 6, 7
    A = np.full(m * k, np.nan, DTYPES[in_type])
    B = np.full(k * n, np.inf, DTYPES[in_type])
    C = np.arange(m * n).astype(DTYPES[out_type])
    expected = beta * C.astype(np.float64)
    Gemm("hcblas", "cpu").gemm_ex(Operation.N, Operation.N, m, n, k, 0.0, A, in_type, m, B, in_type, k, beta, C,
                                  out_type, m, compute)
    np.testing.assert_array_equal(C.astype(np.float64), expected)


@pytest.mark.parametrize("a_type, c_type", [(1, 1), (1, 0), (27, 27), (0, 0)])
def test_cann_alpha_zero_leaves_beta_c(kernel_path, a_type, c_type):
    dtype = {0: np.float32, 1: np.float16, 27: BFLOAT16}
    a, b = np.full((3, 5), np.nan, dtype[a_type]), np.full((5, 4), np.nan, dtype[a_type])
    c = np.full((3, 4), 4, dtype[c_type])
    acl_gemm_ex(0, 0, 3, 4, 5, 0, a, -1, a_type, b, -1, a_type, 0.5, c, -1, c_type)
    np.testing.assert_array_equal(c.astype(np.float64), np.full((3, 4), 2.0))


def test_cann_adapter_refuses_what_cann_refuses():
    lib = gemm.library()
    assert lib.aclblasGemmEx(0, 0, 1, 2, 2, 2, None, None, -1, 0, None, -1, 0, None, None, -1, 0, 0, None) == 100000
    assert "transC" in lib.hcblasLastError().decode()
    with pytest.raises(GemmStatusError, match="aclblasGemmEx returned 100000: ldb=1: must be -1 or >= 3"):
        acl_gemm_ex(0, 0, 2, 3, 4, 1.0, np.ones(8, np.float32), 4, 0, np.ones(12, np.float32), 1, 0, 0.0,
                    np.zeros(6, np.float32), 3, 0)


def c_compiler() -> str:
    return sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc"


VENDOR_PREFIXES = {"cublas": ("cublas", "CUBLAS", "CUDA"), "hcblas": ("hcblas", "HCBLAS", "HCBLAS"),
                   "hipblas": ("hipblas", "HIPBLAS", "HIP"), "mcblas": ("mcblas", "MCBLAS", "MACA"),
                   "mublas": ("mublas", "MUBLAS", "MUSA")}


@pytest.mark.parametrize("vendor", VENDORS)
def test_a_c_program_written_for_cublas_compiles_links_and_computes(tmp_path, vendor):
    compiler = shutil.which(c_compiler()) or shutil.which("cc")
    assert compiler, "a C compiler is needed to build the shim in the first place"
    source = (project_root() / "tests/data/cublas_gemmex_program.c").read_text()
    source = source.replace("#include <cublas_v2.h>", '#include "hcblas.h"')
    lower, upper, data = VENDOR_PREFIXES[vendor]
    source = source.replace("cublas", lower).replace("CUBLAS_", f"{upper}_").replace("CUDA_R_", f"{data}_R_")
    (tmp_path / "program.c").write_text(source)
    library = gemm.library_path()
    build = subprocess.run([compiler, "-O1", "-Wall", "-Werror", str(tmp_path / "program.c"), "-o",
                            str(tmp_path / "program"), f"-I{project_root() / 'cython_ext/gemm_shim'}", f"-L{library.parent}",
                            "-lhcblas", f"-Wl,-rpath,{library.parent}", "-lm"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(tmp_path / "program")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "int8 mismatches 0" in run.stdout
