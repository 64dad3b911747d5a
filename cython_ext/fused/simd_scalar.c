/* Scalar reference path: plain C, compiled without vectorisation. */
#include <math.h>
#include "dspark_simd.h"

static float gelu_scalar(float v, int kind) {
    if (kind == DSPARK_GELU_TANH) {
        const float k = 0.7978845608028654f; /* sqrt(2/pi) */
        return 0.5f * v * (1.0f + tanhf(k * (v + 0.044715f * v * v * v)));
    }
    return 0.5f * v * (1.0f + erff(v * 0.7071067811865476f));
}

static void row_stats_one(const float *xr, size_t d, float eps, float *mean, float *rstd) {
    float sum = 0.0f;
    for (size_t i = 0; i < d; i++) sum += xr[i];
    const float m = sum / (float)d;
    float sq = 0.0f;
    for (size_t i = 0; i < d; i++) {
        const float c = xr[i] - m;
        sq += c * c;
    }
    *mean = m;
    *rstd = 1.0f / sqrtf(sq / (float)d + eps);
}

static void ln_gelu_span(const float *xr, size_t n, float mean, float rstd, const float *gamma,
                         const float *beta, int gelu_kind, float *out) {
    for (size_t i = 0; i < n; i++)
        out[i] = gelu_scalar((xr[i] - mean) * rstd * gamma[i] + beta[i], gelu_kind);
}

#define VF float
#define VW 1
#define MR 4
#define vset1(v) (v)
#define vadd(a, b) ((a) + (b))
#define vfmadd(a, b, c) ((a) * (b) + (c))
#define vload(p) (*(p))
#define vstore(p, v) (*(p) = (v))

#include "simd_gemm.inc"

DSPARK_SIMD_TABLE(kernels, "scalar");

const dspark_simd_kernels *dspark_simd_scalar(void) { return &kernels; }
