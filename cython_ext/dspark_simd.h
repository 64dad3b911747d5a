/* Per-instruction-set kernels for the fused LayerNorm+GELU+MatMul layer.
 *
 * Each ISA lives in its own translation unit compiled with its own flags
 * (simd_scalar.c, simd_avx2.c, simd_avx512.c). Their kernels have internal
 * linkage; each TU exports only one table getter, and simd_dispatch.c picks a
 * table at run time from CPUID + XGETBV, overridable with DSPARK_SIMD.
 */
#ifndef DSPARK_SIMD_H
#define DSPARK_SIMD_H

#include <stddef.h>

#define DSPARK_GELU_ERF 0
#define DSPARK_GELU_TANH 1

typedef struct {
    const char *name;
    /* out[r, :] = GELU(LayerNorm(x[r, :]) * gamma + beta) for r in [0, rows). */
    void (*ln_gelu_rows)(const float *x, size_t x_stride, size_t rows, size_t d,
                         const float *gamma, const float *beta, float eps,
                         int gelu_kind, float *out, size_t out_stride);
} dspark_simd_kernels;

#define DSPARK_ISA_SCALAR 0
#define DSPARK_ISA_AVX2 1
#define DSPARK_ISA_AVX512 2
#define DSPARK_ISA_COUNT 3

#define DSPARK_HIDDEN __attribute__((visibility("hidden")))

DSPARK_HIDDEN const dspark_simd_kernels *dspark_simd_scalar(void);
#if defined(__x86_64__) || defined(__i386__)
DSPARK_HIDDEN const dspark_simd_kernels *dspark_simd_avx2(void);
DSPARK_HIDDEN const dspark_simd_kernels *dspark_simd_avx512(void);
#define DSPARK_HAVE_X86_TUS 1
#else
#define DSPARK_HAVE_X86_TUS 0
#endif

/* Dispatch (simd_dispatch.c). */
const char *dspark_isa_name(int isa);
int dspark_isa_compiled(int isa);   /* built into this binary */
int dspark_isa_supported(int isa);  /* CPU and OS can run it */
int dspark_isa_best(void);          /* best supported */
/* The ISA to use now: DSPARK_SIMD if set, else the best. Returns -1 and fills
 * err (a sentence) when the override names an unknown or unsupported ISA. */
int dspark_isa_select(char *err, size_t err_len);
const dspark_simd_kernels *dspark_isa_kernels(int isa);

#endif
