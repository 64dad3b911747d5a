# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Fused LayerNorm+GELU+MatMul with run-time SIMD dispatch (wrapped by dspark.kernels.fused)."""
import numpy as np

from libc.stdlib cimport free
from libc.stddef cimport size_t


cdef extern from "stdlib.h" nogil:
    int posix_memalign(void **memptr, size_t alignment, size_t size)


include "isa_dispatch.pxi"


cdef extern from "dspark_simd.h" nogil:
    ctypedef struct dspark_simd_kernels:
        const char *name
        void (*ln_gelu_rows)(const float *x, size_t x_stride, size_t rows, size_t d,
                             const float *gamma, const float *beta, float eps,
                             int gelu_kind, float *out, size_t out_stride) noexcept nogil
    int DSPARK_NR
    const dspark_isa_family dspark_fused_paths
    const dspark_simd_kernels *dspark_isa_kernels(int isa)


cdef extern from "fused_layer.h" nogil:
    void dspark_fused_forward(const dspark_simd_kernels *k, const float *x, size_t rows, size_t d,
                              const float *gamma, const float *beta, float eps, int gelu_kind,
                              const float *w, size_t n, const float *bias, float *y,
                              float *scratch, size_t block_rows)
    size_t dspark_packed_w_floats(size_t d, size_t n)
    void dspark_pack_weights(const float *w, size_t d, size_t n, size_t kc, float *packed)
    int dspark_fused_forward_packed(const dspark_simd_kernels *k, const float *x, size_t rows,
                                    size_t d, const float *gamma, const float *beta, float eps,
                                    int gelu_kind, const float *w_packed, size_t n,
                                    const float *bias_padded, float *y, size_t kc, size_t mc,
                                    size_t nc, size_t mb, int threads)
    void dspark_blas_set_threads(int threads)
    int dspark_blas_get_threads()
    const char *dspark_blas_corename()
    const char *dspark_blas_config()
    void dspark_sgemm(const float *a, const float *b, float *c, size_t m, size_t k, size_t n)


cdef const dspark_simd_kernels *_selected() except NULL:
    cdef char err[256]
    cdef int isa = dspark_path_select(&dspark_fused_paths, err, sizeof(err))
    if isa < 0:
        raise ValueError(err.decode())
    return dspark_isa_kernels(isa)


def simd_info():
    """Build-time (compiled) and run-time (supported) ISAs, the best one and the one in use."""
    return _paths_info(&dspark_fused_paths)


def blas_info():
    """The BLAS behind the GEMM: OpenBLAS core it picked at run time, its config, threads."""
    return {
        "library": "scipy-openblas32",
        "core": dspark_blas_corename().decode(),
        "config": dspark_blas_config().decode().strip(),
        "threads": dspark_blas_get_threads(),
    }


# Every entry point below checks its arguments and raises ValueError naming the one that is wrong:
# the C code trusts its shapes completely. Dimensions go to OpenBLAS as 32-bit ints; block sizes
# are bounded so the C driver's rounding and products cannot wrap.
cdef enum:
    MAX_DIM = 2147483647
    MAX_BLOCK = 1048576


MAX_BLOCK_SIZE = MAX_BLOCK


cdef _check_range(str name, size_t value, size_t lowest, size_t highest):
    if value < lowest or value > highest:
        raise ValueError(f"{name}: must be between {lowest} and {highest}, got {value}")


cdef _check_length(str name, size_t got, size_t want):
    if got != want:
        raise ValueError(f"{name}: expected {want} floats, got {got}")


cdef _check_shape(str name, tuple got, tuple want):
    if got != want:
        raise ValueError(f"{name}: expected shape {want}, got {got}")


cdef _check_gelu_kind(int gelu_kind):
    if gelu_kind not in (0, 1):
        raise ValueError(f"gelu_kind: must be 0 (erf) or 1 (tanh), got {gelu_kind}")


cdef _check_dim(str name, size_t value):
    _check_range(name, value, 1, MAX_DIM)


cdef _check_ln_inputs(const float[:, ::1] x, const float[::1] gamma, const float[::1] beta, int gelu_kind):
    _check_range("x rows", x.shape[0], 0, MAX_DIM)
    _check_dim("x columns (d)", x.shape[1])
    _check_length("gamma", gamma.shape[0], x.shape[1])
    _check_length("beta", beta.shape[0], x.shape[1])
    _check_gelu_kind(gelu_kind)


cdef float *_scratch(size_t n_floats) except NULL:
    cdef void *p = NULL
    if posix_memalign(&p, 64, n_floats * sizeof(float) if n_floats else 64) != 0:
        raise MemoryError(f"could not allocate a {n_floats * 4} byte scratch block")
    return <float *>p


def ln_gelu(const float[:, ::1] x not None, const float[::1] gamma not None,
            const float[::1] beta not None, float[:, ::1] out not None, float eps=1e-5, int gelu_kind=0):
    """out = GELU(LayerNorm(x)) on the selected SIMD path; returns its name."""
    cdef const dspark_simd_kernels *k = _selected()
    _check_ln_inputs(x, gamma, beta, gelu_kind)
    _check_shape("out", (out.shape[0], out.shape[1]), (x.shape[0], x.shape[1]))
    if x.shape[0] == 0:
        return k.name.decode()
    with nogil:
        k.ln_gelu_rows(&x[0, 0], x.shape[1], x.shape[0], x.shape[1], &gamma[0], &beta[0],
                       eps, gelu_kind, &out[0, 0], out.shape[1])
    return k.name.decode()


def fused_forward(const float[:, ::1] x not None, const float[::1] gamma not None,
                  const float[::1] beta not None, const float[:, ::1] w not None,
                  const float[::1] bias, float[:, ::1] out not None,
                  float eps=1e-5, int gelu_kind=0, size_t block_rows=64, int threads=0):
    """out = GELU(LayerNorm(x)) @ w + bias, GIL released; returns the SIMD path's name.

    threads > 0 sets OpenBLAS's thread count."""
    cdef const dspark_simd_kernels *k = _selected()
    cdef size_t rows = x.shape[0], d = x.shape[1], n = w.shape[1]
    cdef size_t br = block_rows if block_rows < rows else rows
    cdef const float *b
    cdef float *scratch
    _check_ln_inputs(x, gamma, beta, gelu_kind)
    _check_shape("w", (w.shape[0], w.shape[1]), (d, n))
    _check_dim("w columns (n)", n)
    if bias is not None:
        _check_length("bias", bias.shape[0], n)
    _check_shape("out", (out.shape[0], out.shape[1]), (rows, n))
    _check_range("block_rows", block_rows, 1, MAX_BLOCK)
    b = &bias[0] if bias is not None else NULL
    if rows == 0:
        return k.name.decode()
    scratch = _scratch(br * d)
    try:
        with nogil:
            if threads > 0 and dspark_blas_get_threads() != threads:
                dspark_blas_set_threads(threads)
            dspark_fused_forward(k, &x[0, 0], rows, d, &gamma[0], &beta[0], eps, gelu_kind,
                                 &w[0, 0], n, b, &out[0, 0], scratch, br)
    finally:
        free(scratch)
    return k.name.decode()


PANEL_WIDTH = DSPARK_NR


def packed_weights_size(size_t d, size_t n):
    """Floats in W packed as column panels (n rounded up to PANEL_WIDTH, times d)."""
    _check_dim("d", d)
    _check_dim("n", n)
    return dspark_packed_w_floats(d, n)


def pack_weights(const float[:, ::1] w not None, float[::1] packed not None, size_t kc):
    """Pack w (d, n) into the panel layout of fused_forward_packed for K blocks of kc rows
    (done once per layer)."""
    _check_length("packed", packed.shape[0], packed_weights_size(w.shape[0], w.shape[1]))
    _check_range("kc", kc, 1, MAX_BLOCK)
    with nogil:
        dspark_pack_weights(&w[0, 0], w.shape[0], w.shape[1], kc, &packed[0])


def fused_forward_packed(const float[:, ::1] x not None, const float[::1] gamma not None,
                         const float[::1] beta not None, const float[::1] w_packed not None,
                         size_t n, const float[::1] bias_padded, float[:, ::1] out not None,
                         float eps=1e-5, int gelu_kind=0, size_t kc=384, size_t mc=144,
                         size_t nc=128, size_t mb=1024, int threads=1):
    """out = GELU(LayerNorm(x)) @ W + bias over W packed by pack_weights with the same kc,
    GIL released; returns the SIMD path's name."""
    cdef const dspark_simd_kernels *k = _selected()
    cdef const float *b
    cdef int rc
    _check_ln_inputs(x, gamma, beta, gelu_kind)
    _check_length("w_packed", w_packed.shape[0], packed_weights_size(x.shape[1], n))
    if bias_padded is not None:
        _check_length("bias_padded", bias_padded.shape[0], (n + DSPARK_NR - 1) // DSPARK_NR * DSPARK_NR)
    _check_shape("out", (out.shape[0], out.shape[1]), (x.shape[0], n))
    for name, value in (("kc", kc), ("mc", mc), ("mb", mb)):
        _check_range(name, value, 1, MAX_BLOCK)
    _check_range("nc", nc, 0, MAX_BLOCK)
    b = &bias_padded[0] if bias_padded is not None else NULL
    if x.shape[0] == 0:
        return k.name.decode()
    with nogil:
        rc = dspark_fused_forward_packed(k, &x[0, 0], x.shape[0], x.shape[1], &gamma[0], &beta[0],
                                         eps, gelu_kind, &w_packed[0], n, b, &out[0, 0],
                                         kc, mc, nc, mb, threads)
    if rc != 0:
        raise MemoryError("fused layer: could not allocate its work blocks or start its threads")
    return k.name.decode()


def sgemm(const float[:, ::1] a not None, const float[:, ::1] b not None, float[:, ::1] c not None):
    """c = a @ b through the fused layer's BLAS (for measuring its peak), GIL released."""
    _check_dim("a rows", a.shape[0])
    _check_dim("a columns (inner dimension)", a.shape[1])
    _check_dim("b columns", b.shape[1])
    if b.shape[0] != a.shape[1]:
        raise ValueError(f"b: has {b.shape[0]} rows, a has {a.shape[1]} columns (the inner dimension must match)")
    _check_shape("c", (c.shape[0], c.shape[1]), (a.shape[0], b.shape[1]))
    with nogil:
        dspark_sgemm(&a[0, 0], &b[0, 0], &c[0, 0], a.shape[0], a.shape[1], b.shape[1])
