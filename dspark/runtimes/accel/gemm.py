"""Python binding of the GemmEx shim (libhcblas.so, cython_ext/gemm_shim/hcblas.h) and its CUDA back end.

`Gemm(vendor, device)` calls one vendor name's entry point (`hcblasGemmEx`, `cublasGemmEx`, ...)
of the same C library the C ABI exports, so Python and C code run the same checks and kernels.
On `device="cuda"` the product runs in cuBLAS's own GemmEx through CuPy (hipBLAS on a ROCm build
of CuPy), after the library's checks, with the same arguments and enum values. ``gemm_ex`` is the
raw cuBLAS contract (column-major, leading dimensions); ``matmul`` is the row-major convenience
the engines use. bf16 arrays are ml_dtypes.bfloat16 (numpy has no bf16).
"""
from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, Optional

import ml_dtypes
import numpy as np

from dspark.errors import INTERNAL, INVALID_ARG, ConfigError, DsparkError
from dspark.runtimes.accel.vendors import DEVICES, VENDORS

SIMD_ENV = "DSPARK_GEMM_SIMD"
PATHS = ("convert", "avx512bf16", "amx")


class Status(IntEnum):
    SUCCESS = 0
    NOT_INITIALIZED = 1
    ALLOC_FAILED = 3
    INVALID_VALUE = 7
    ARCH_MISMATCH = 8
    MAPPING_ERROR = 11
    EXECUTION_FAILED = 13
    INTERNAL_ERROR = 14
    NOT_SUPPORTED = 15


class Operation(IntEnum):
    N = 0
    T = 1
    C = 2


class DataType(IntEnum):
    R_32F = 0
    R_64F = 1
    R_16F = 2
    R_8I = 3
    R_32I = 10
    R_16BF = 14


class ComputeType(IntEnum):
    COMPUTE_16F = 64
    COMPUTE_16F_PEDANTIC = 65
    COMPUTE_32F = 68
    COMPUTE_32F_PEDANTIC = 69
    COMPUTE_64F = 70
    COMPUTE_64F_PEDANTIC = 71
    COMPUTE_32I = 72
    COMPUTE_32I_PEDANTIC = 73
    COMPUTE_32F_FAST_16F = 74
    COMPUTE_32F_FAST_16BF = 75
    COMPUTE_32F_FAST_TF32 = 77


GEMM_DEFAULT = -1
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {
    DataType.R_32F: np.dtype(np.float32),
    DataType.R_64F: np.dtype(np.float64),
    DataType.R_16F: np.dtype(np.float16),
    DataType.R_16BF: BFLOAT16,
    DataType.R_8I: np.dtype(np.int8),
    DataType.R_32I: np.dtype(np.int32),
}
DATA_TYPE_OF = {dtype: data_type for data_type, dtype in DTYPES.items()}
# The scale type of alpha and beta for each compute type (cuBLAS's rule).
SCALE_DTYPE = {ComputeType.COMPUTE_16F: np.float16, ComputeType.COMPUTE_16F_PEDANTIC: np.float16,
               ComputeType.COMPUTE_64F: np.float64, ComputeType.COMPUTE_64F_PEDANTIC: np.float64,
               ComputeType.COMPUTE_32I: np.int32, ComputeType.COMPUTE_32I_PEDANTIC: np.int32}


class GemmStatusError(DsparkError):
    """A GemmEx call returned a status other than SUCCESS; ``status`` is cuBLAS's code and the
    message the library's own sentence (which argument, what it must be)."""

    def __init__(self, status: Status, message: str):
        super().__init__(f"GemmEx returned {status.name}: {message}")
        self.status = status
        self.code = INVALID_ARG if status in (Status.INVALID_VALUE, Status.NOT_SUPPORTED) else INTERNAL


def library_path() -> Path:
    from dspark import _ext

    return Path(_ext.__file__).parent / "libhcblas.so"


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """libhcblas.so, loaded once with its symbols kept local (a real libcublas in the same
    process, CuPy's, keeps its own names)."""
    path = library_path()
    if not path.is_file():
        raise ConfigError("libhcblas.so", f"{path} is missing: build it with `make setup` (pip install -e .)")
    lib = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL)
    handle_p = ctypes.POINTER(ctypes.c_void_p)
    gemm_args = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                 ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                 ctypes.c_int]
    for vendor in VENDORS:
        getattr(lib, f"{vendor}Create").argtypes = [handle_p]
        getattr(lib, f"{vendor}Destroy").argtypes = [ctypes.c_void_p]
        getattr(lib, f"{vendor}GemmEx").argtypes = gemm_args
        for name in ("Create", "Destroy", "GemmEx"):
            getattr(lib, f"{vendor}{name}").restype = ctypes.c_int
    lib.hcblasGemmExCheck.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_int]
    lib.hcblasGemmExCheck.restype = ctypes.c_int
    lib.aclblasGemmEx.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                  ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.aclblasGemmEx.restype = ctypes.c_int
    lib.hcblasKernelPath.argtypes = [ctypes.c_char_p, ctypes.c_int]
    for name in ("hcblasKernelPath", "hcblasCompiledPaths", "hcblasSupportedPaths", "hcblasLastError"):
        getattr(lib, name).restype = ctypes.c_char_p
    return lib


@dataclass(frozen=True)
class KernelReport:
    compiled: list[str]
    supported: list[str]
    chosen: str  # the CPU path the next call takes, or "error: ..." for a bad DSPARK_GEMM_SIMD
    override: Optional[str]


def kernel_report() -> KernelReport:
    lib = library()
    err = ctypes.create_string_buffer(200)
    chosen = lib.hcblasKernelPath(err, len(err))
    return KernelReport(compiled=lib.hcblasCompiledPaths().decode().split(","),
                        supported=lib.hcblasSupportedPaths().decode().split(","),
                        chosen=chosen.decode() if chosen else f"error: {err.value.decode()}",
                        override=os.environ.get(SIMD_ENV) or None)


def cuda_available() -> tuple[bool, str]:
    """(usable, why): CuPy importable and a GPU it can use."""
    try:
        import cupy
    except ImportError:
        return False, "CuPy is not installed (pip install cupy-cuda12x or cupy-cuda13x)"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # CuPy raises its own CUDARuntimeError when there is no driver
        return False, f"CuPy finds no GPU ({error})"
    return (count > 0, f"{count} GPU(s) through CuPy {cupy.__version__}" if count else "CuPy sees 0 GPUs")


def _scalar(value: Any, compute: ComputeType) -> np.ndarray:
    return np.array([value], dtype=SCALE_DTYPE.get(compute, np.float32))


def _extent(rows: int, cols: int, ld: int) -> int:
    """Elements a column-major rows x cols operand with leading dimension ld spans."""
    return 0 if rows == 0 or cols == 0 else ld * (cols - 1) + rows


class Gemm:
    """GemmEx under one vendor's name, on the CPU (libhcblas) or a GPU (cuBLAS through CuPy)."""

    def __init__(self, vendor: str = "hcblas", device: str = "auto") -> None:
        if vendor not in VENDORS:
            raise ConfigError("gemm_vendor", f"unknown vendor {vendor!r}; one of {', '.join(VENDORS)}")
        if device not in DEVICES:
            raise ConfigError("gemm_device", f"unknown device {device!r}; one of {', '.join(DEVICES)}")
        if device != "cpu":
            usable, why = cuda_available()
            if device == "cuda" and not usable:
                raise ConfigError("gemm_device", f"cuda is not usable here: {why}")
            device = "cuda" if usable else "cpu"
        self.vendor, self.device = vendor, device
        self._lib = library()
        self._gemm = getattr(self._lib, f"{vendor}GemmEx")
        self._handle = ctypes.c_void_p()
        self._check_status(getattr(self._lib, f"{vendor}Create")(ctypes.byref(self._handle)))
        self._destroy = getattr(self._lib, f"{vendor}Destroy")
        if device == "cuda":
            import cupy

            self.xp = cupy
        else:
            self.xp = np

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is not None and handle.value:
            self._destroy(handle)
            self._handle = None

    def describe(self) -> str:
        if self.device == "cuda":
            import cupy

            library_name = "hipBLAS" if cupy.cuda.runtime.is_hip else "cuBLAS"
            return f"{self.vendor}GemmEx on {library_name} through CuPy {cupy.__version__}"
        return f"{self.vendor}GemmEx on the CPU (libhcblas, kernel path {kernel_report().chosen})"

    def _check_status(self, status: int) -> None:
        if status != Status.SUCCESS:
            raise GemmStatusError(Status(status), self._lib.hcblasLastError().decode())

    # --- the raw contract ----------------------------------------------------------------------
    def gemm_ex(self, transa: int, transb: int, m: int, n: int, k: int, alpha: Any, A, Atype: int, lda: int,
                B, Btype: int, ldb: int, beta: Any, C, Ctype: int, ldc: int,
                compute: int = ComputeType.COMPUTE_32F, algo: int = GEMM_DEFAULT) -> None:
        """cuBLAS's GemmEx on arrays (numpy on the CPU, CuPy on the GPU) holding column-major data;
        the arrays must span what the leading dimensions address (checked, unlike C callers)."""
        alpha_v, beta_v = _scalar(alpha, compute), _scalar(beta, compute)
        self._check_status(self._lib.hcblasGemmExCheck(  # the library's own checks come first
            self._handle, transa, transb, m, n, k, alpha_v.ctypes.data, Atype, lda, Btype, ldb,
            beta_v.ctypes.data, Ctype, ldc, compute, algo))
        for name, array, data_type, rows, cols, ld in (
                ("A", A, Atype, m if transa == 0 else k, k if transa == 0 else m, lda),
                ("B", B, Btype, k if transb == 0 else n, n if transb == 0 else k, ldb),
                ("C", C, Ctype, m, n, ldc)):
            if not (array.flags.c_contiguous or array.flags.f_contiguous):
                raise GemmStatusError(Status.INVALID_VALUE, f"{name} must be one contiguous buffer")
            if array.dtype.itemsize != DTYPES[DataType(data_type)].itemsize:
                raise GemmStatusError(Status.INVALID_VALUE, f"{name} holds {array.dtype} elements, not "
                                                            f"{DataType(data_type).name}")
            if array.size < _extent(rows, cols, ld):
                raise GemmStatusError(Status.INVALID_VALUE, f"{name} holds {array.size} elements; a {rows} x {cols} "
                                                            f"operand with leading dimension {ld} needs "
                                                            f"{_extent(rows, cols, ld)}")
        if self.device == "cuda":
            self._cuda_gemm_ex(transa, transb, m, n, k, alpha_v, A, Atype, lda, B, Btype, ldb, beta_v, C, Ctype,
                               ldc, compute, algo)
            return
        self._check_status(self._gemm(self._handle, transa, transb, m, n, k, alpha_v.ctypes.data, A.ctypes.data,
                                      Atype, lda, B.ctypes.data, Btype, ldb, beta_v.ctypes.data, C.ctypes.data,
                                      Ctype, ldc, compute, algo))

    @staticmethod
    def _cuda_gemm_ex(transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, compute,
                      algo) -> None:
        import cupy
        from cupy_backends.cuda.libs import cublas

        handle = cupy.cuda.device.get_cublas_handle()
        cublas.gemmEx(handle, transa, transb, m, n, k, alpha.ctypes.data, A.data.ptr, Atype, lda, B.data.ptr, Btype,
                      ldb, beta.ctypes.data, C.data.ptr, Ctype, ldc, compute, algo)

    # --- row-major convenience -------------------------------------------------------------------
    def matmul(self, a, b, *, out_dtype=None, compute: Optional[int] = None, alpha: Any = 1, beta: Any = 0,
               out=None, in_type: Optional[DataType] = None):
        """out = alpha * (a @ b) + beta * out for row-major 2-D arrays of one input dtype (float32,
        float64, float16, bfloat16, int8). int8 gives int32 (COMPUTE_32I) unless out_dtype says
        float32; ``compute`` overrides the compute type (e.g. COMPUTE_32F_FAST_16BF for float32
        inputs through the bf16 kernels). ``in_type`` names the inputs' type where the array
        module has no dtype for it (bf16 as uint16 storage in CuPy). Row-major C = A B is
        column-major C^T = B^T A^T: the operands swap, no copies."""
        xp = self.xp
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise GemmStatusError(Status.INVALID_VALUE, f"shapes {a.shape} @ {b.shape} do not multiply")
        if a.dtype != b.dtype or (in_type is None and a.dtype not in DATA_TYPE_OF):
            raise GemmStatusError(Status.NOT_SUPPORTED, f"inputs {a.dtype} and {b.dtype}: expected one of "
                                                        f"{', '.join(str(d) for d in DATA_TYPE_OF)}, both the same")
        if in_type is not None and DTYPES[DataType(in_type)].itemsize != a.dtype.itemsize:
            raise GemmStatusError(Status.INVALID_VALUE, f"in_type {DataType(in_type).name} needs "
                                                        f"{DTYPES[DataType(in_type)].itemsize}-byte elements, "
                                                        f"got {a.dtype}")
        in_type = DataType(in_type) if in_type is not None else DATA_TYPE_OF[a.dtype]
        if out_dtype is None:
            out_dtype = np.int32 if in_type == DataType.R_8I else DTYPES[in_type]
        out_type = DATA_TYPE_OF[np.dtype(out_dtype)]
        if compute is None:
            compute = {DataType.R_64F: ComputeType.COMPUTE_64F}.get(in_type, ComputeType.COMPUTE_32F)
            if out_type == DataType.R_32I:
                compute = ComputeType.COMPUTE_32I
        a, b = xp.ascontiguousarray(a), xp.ascontiguousarray(b)
        rows, inner, cols = a.shape[0], a.shape[1], b.shape[1]
        if out is None:
            out = xp.zeros((rows, cols), dtype=out_dtype)
            beta = 0
        elif out.shape != (rows, cols) or out.dtype != np.dtype(out_dtype) or not out.flags.c_contiguous:
            raise GemmStatusError(Status.INVALID_VALUE, f"out must be a C-contiguous {rows} x {cols} {out_dtype} array")
        self.gemm_ex(Operation.N, Operation.N, cols, rows, inner, alpha, b, in_type, max(1, cols), a, in_type,
                     max(1, inner), beta, out, out_type, max(1, cols), compute)
        return out


def acl_gemm_ex(trans_a: int, trans_b: int, m: int, n: int, k: int, alpha: Any, A: np.ndarray, lda: int,
                a_type: int, B: np.ndarray, ldb: int, b_type: int, beta: Any, C: np.ndarray, ldc: int,
                c_type: int, compute: int = 0) -> None:
    """CANN's aclblasGemmEx (row-major, no handle, stream last) on host arrays; acl data types
    (ACL_FLOAT 0, ACL_FLOAT16 1, ACL_INT8 2, ACL_INT32 3, ACL_BF16 27); alpha/beta have C's type."""
    scale = {0: np.float32, 1: np.float16, 3: np.int32, 27: BFLOAT16}.get(c_type, np.float32)
    alpha_v, beta_v = np.array([alpha], scale), np.array([beta], scale)
    lib = library()
    status = lib.aclblasGemmEx(trans_a, trans_b, 0, m, n, k, alpha_v.ctypes.data, A.ctypes.data, lda, a_type,
                               B.ctypes.data, ldb, b_type, beta_v.ctypes.data, C.ctypes.data, ldc, c_type, compute,
                               None)
    if status != 0:
        raise GemmStatusError(Status.INVALID_VALUE, f"aclblasGemmEx returned {status}: "
                                                    f"{lib.hcblasLastError().decode()}")
