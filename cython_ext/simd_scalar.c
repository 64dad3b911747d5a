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

static void ln_gelu_rows(const float *x, size_t x_stride, size_t rows, size_t d,
                         const float *gamma, const float *beta, float eps,
                         int gelu_kind, float *out, size_t out_stride) {
    for (size_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *yr = out + r * out_stride;
        float sum = 0.0f;
        for (size_t i = 0; i < d; i++) sum += xr[i];
        const float mean = sum / (float)d;
        float sq = 0.0f;
        for (size_t i = 0; i < d; i++) {
            const float c = xr[i] - mean;
            sq += c * c;
        }
        const float rstd = 1.0f / sqrtf(sq / (float)d + eps);
        for (size_t i = 0; i < d; i++)
            yr[i] = gelu_scalar((xr[i] - mean) * rstd * gamma[i] + beta[i], gelu_kind);
    }
}

static const dspark_simd_kernels kernels = {"scalar", ln_gelu_rows};

const dspark_simd_kernels *dspark_simd_scalar(void) { return &kernels; }
