/* Per-instruction-set kernels for the fused LayerNorm+GELU+MatMul layer.
 *
 * Each ISA lives in its own translation unit compiled with its own flags
 * (simd_scalar.c, simd_avx2.c, simd_avx512.c). Their kernels have internal
 * linkage; each TU exports only one table getter, and the common dispatcher
 * (isa_dispatch.h) picks a table at run time from CPUID + XGETBV, overridable with DSPARK_SIMD.
 */
#ifndef DSPARK_SIMD_H
#define DSPARK_SIMD_H

#include <stddef.h>

#include "isa_dispatch.h"

#define DSPARK_GELU_ERF 0
#define DSPARK_GELU_TANH 1

/* The packed GEMM: W is packed once into column panels of DSPARK_NR floats (each panel
 * K x DSPARK_NR contiguous, zero-padded past n), the same layout for every ISA so a layer
 * packed under one path runs under any other. A block of rows is packed as micro-panels of
 * up to `mr` rows (element (r, k) at k * rows_in_panel + r). */
#define DSPARK_NR 16
#define DSPARK_MR_MAX 16

/* c[r, j] (+)= sum_k a[k * mr + r] * b[k * DSPARK_NR + j] for r < mr, j < ncols; with
 * accumulate == 0 the tile is overwritten (plus bias[j] when bias is not NULL). b_next, when
 * not NULL, is the next panel of W, prefetched alongside (the driver passes it with the
 * first tile of each panel, so W streams from memory while this panel computes). */
typedef void (*dspark_gemm_tile_fn)(size_t kc, const float *a, const float *b, float *c,
                                    size_t ldc, size_t ncols, int accumulate, const float *bias,
                                    const float *b_next);

typedef struct {
    const char *name;
    /* out[r, :] = GELU(LayerNorm(x[r, :]) * gamma + beta) for r in [0, rows). */
    void (*ln_gelu_rows)(const float *x, size_t x_stride, size_t rows, size_t d,
                         const float *gamma, const float *beta, float eps,
                         int gelu_kind, float *out, size_t out_stride);
    /* mean[r] and rstd[r] = 1 / sqrt(var + eps) of each row (LayerNorm statistics). */
    void (*row_stats)(const float *x, size_t x_stride, size_t rows, size_t d, float eps,
                      float *mean, float *rstd);
    /* Pack rows x kc of GELU((x - mean) * rstd * gamma + beta) as micro-panels of `mr`
     * rows (the last one shorter) into dst; tmp holds mr * kc floats. x, gamma, beta point
     * at column k0 of the block. */
    void (*pack_ln_gelu)(const float *x, size_t x_stride, size_t rows, size_t kc,
                         const float *mean, const float *rstd, const float *gamma,
                         const float *beta, int gelu_kind, float *dst, float *tmp);
    /* One row against four adjacent full panels (panel_stride floats apart) at once. */
    void (*gemv_4panels)(size_t kc, const float *a, const float *b, size_t panel_stride,
                         float *c, int accumulate, const float *bias);
    size_t mr;                                   /* rows per micro-tile */
    dspark_gemm_tile_fn gemm_tile[DSPARK_MR_MAX + 1];  /* [m] computes m <= mr rows */
} dspark_simd_kernels;

DSPARK_HIDDEN const dspark_simd_kernels *dspark_simd_scalar(void);
#if DSPARK_HAVE_X86_TUS
DSPARK_HIDDEN const dspark_simd_kernels *dspark_simd_avx2(void);
DSPARK_HIDDEN const dspark_simd_kernels *dspark_simd_avx512(void);
#endif

/* Dispatch (simd_dispatch.c): the fused family of the common dispatcher, and its tables. */
extern const dspark_isa_family dspark_fused_paths;
const dspark_simd_kernels *dspark_isa_kernels(int isa);

#endif
