/* AVX-512F path. Compiled with -mavx512f -mfma; only the table getter is visible. */
#include <immintrin.h>
#include <math.h>
#include "dspark_simd.h"

#define W 16

static inline __m512 poly_erf(__m512 x) {
    /* Same rational erf as the AVX2 path (see simd_avx2.c). */
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(4.0f)), _mm512_set1_ps(-4.0f));
    const __m512 x2 = _mm512_mul_ps(x, x);
    __m512 p = _mm512_set1_ps(-2.72614225801306e-10f);
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(2.77068142495902e-08f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-2.10102402082508e-06f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-5.69250639462346e-05f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-7.34990630326855e-04f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-2.95459980854025e-03f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-1.60960333262415e-02f));
    p = _mm512_mul_ps(p, x);
    __m512 q = _mm512_set1_ps(-1.45660718464996e-05f);
    q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(-2.13374055278905e-04f));
    q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(-1.68282697438203e-03f));
    q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(-7.37332916720468e-03f));
    q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(-1.42647390514189e-02f));
    return _mm512_div_ps(p, q);
}

static inline __m512 vexp(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

static inline __m512 vgelu(__m512 v, int kind) {
    const __m512 half_v = _mm512_mul_ps(_mm512_set1_ps(0.5f), v);
    if (kind == DSPARK_GELU_TANH) {
        const __m512 v3 = _mm512_mul_ps(_mm512_mul_ps(v, v), v);
        const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                       _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), v3, v));
        const __m512 e = vexp(_mm512_mul_ps(_mm512_set1_ps(-2.0f), u));
        return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    }
    const __m512 erf = poly_erf(_mm512_mul_ps(v, _mm512_set1_ps(0.7071067811865476f)));
    return _mm512_fmadd_ps(half_v, erf, half_v);
}

static void ln_gelu_rows(const float *x, size_t x_stride, size_t rows, size_t d,
                         const float *gamma, const float *beta, float eps,
                         int gelu_kind, float *out, size_t out_stride) {
    const size_t main = d - d % W;
    const size_t tail = d - main;
    const __mmask16 mask = (__mmask16)((1u << tail) - 1u);
    for (size_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *yr = out + r * out_stride;
        __m512 acc = _mm512_setzero_ps();
        for (size_t i = 0; i < main; i += W) acc = _mm512_add_ps(acc, _mm512_loadu_ps(xr + i));
        if (tail) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, xr + main));
        const float mean = _mm512_reduce_add_ps(acc) / (float)d;
        const __m512 vmean = _mm512_set1_ps(mean);
        __m512 sq = _mm512_setzero_ps();
        for (size_t i = 0; i < main; i += W) {
            const __m512 c = _mm512_sub_ps(_mm512_loadu_ps(xr + i), vmean);
            sq = _mm512_fmadd_ps(c, c, sq);
        }
        if (tail) {
            const __m512 c = _mm512_maskz_sub_ps(mask, _mm512_maskz_loadu_ps(mask, xr + main), vmean);
            sq = _mm512_fmadd_ps(c, c, sq);
        }
        const __m512 rstd = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sq) / (float)d + eps));
        for (size_t i = 0; i < main; i += W) {
            const __m512 c = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(xr + i), vmean), rstd);
            const __m512 v = _mm512_fmadd_ps(c, _mm512_loadu_ps(gamma + i), _mm512_loadu_ps(beta + i));
            _mm512_storeu_ps(yr + i, vgelu(v, gelu_kind));
        }
        if (tail) {
            const __m512 c = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, xr + main), vmean), rstd);
            const __m512 v = _mm512_fmadd_ps(c, _mm512_maskz_loadu_ps(mask, gamma + main),
                                             _mm512_maskz_loadu_ps(mask, beta + main));
            _mm512_mask_storeu_ps(yr + main, mask, vgelu(v, gelu_kind));
        }
    }
}

static const dspark_simd_kernels kernels = {"avx512", ln_gelu_rows};

const dspark_simd_kernels *dspark_simd_avx512(void) { return &kernels; }
