/* Internal interface between hcblas.c (the GemmEx contract: checks, dispatch, the convert path,
 * the epilogue) and the per-ISA kernel translation units (hcblas_amx.c, hcblas_avx512bf16.c),
 * each compiled with its own flags into its own static library, chosen at run time.
 *
 * The kernels see the product in row-major terms: D (R x S, row r of D is column r of C, so a row
 * of D is contiguous in C) = X (R x K) * Y (K x S), with X = op(B)^T and Y = op(A)^T read
 * through element strides, so one kernel covers every transpose and leading dimension. */
#ifndef HCBLAS_KERNELS_H
#define HCBLAS_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include "isa_dispatch.h"

/* Receives a block of accumulators (float for bf16, int32 for int8): D[r0 + i][s0 + j] =
 * acc[i * acc_ld + j] for i < rows, j < cols; it clips to R x S, applies alpha/beta and stores
 * in C's type. Threads call it for disjoint rows of D (columns of C). */
typedef void (*hcblas_epilogue_fn)(void *ctx, size_t r0, size_t s0, size_t rows, size_t cols,
                                   const void *acc, size_t acc_ld);

typedef struct {
    size_t R, S, K;
    const void *x;
    ptrdiff_t x_rs, x_cs; /* X[r][p] is element r * x_rs + p * x_cs of x */
    const void *y;
    ptrdiff_t y_rs, y_cs; /* Y[p][s] is element p * y_rs + s * y_cs of y */
    int fp32_in;          /* bf16 kernels: inputs are float to round to bf16 (COMPUTE_32F_FAST_16BF) */
    int threads;          /* threads for the product (OpenBLAS's setting, so every path uses the same) */
    hcblas_epilogue_fn epilogue;
    void *ctx;
} hcblas_problem;

typedef struct {
    const char *name;
    int (*gemm_bf16)(const hcblas_problem *p); /* bf16 x bf16 -> fp32 accumulators */
    int (*gemm_s8)(const hcblas_problem *p);   /* int8 x int8 -> int32 accumulators */
} hcblas_kernels;                              /* each returns 0, or -1 when memory ran out */

#define HCBLAS_PATH_CONVERT 0
#define HCBLAS_PATH_AVX512BF16 1
#define HCBLAS_PATH_AMX 2
#define HCBLAS_PATH_COUNT 3

#if defined(__x86_64__)
#define HCBLAS_HAVE_X86_TUS 1
DSPARK_HIDDEN const hcblas_kernels *hcblas_kernels_avx512bf16(void);
DSPARK_HIDDEN const hcblas_kernels *hcblas_kernels_amx(void);
#else
#define HCBLAS_HAVE_X86_TUS 0
#endif

/* bf16 <-> fp32 (round to nearest even, NaN kept quiet). */
static inline uint16_t hcblas_f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}
static inline float hcblas_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

#endif
