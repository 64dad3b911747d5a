/* AVX2+FMA path. Compiled with -mavx2 -mfma; only the table getter is visible. */
#include <immintrin.h>
#include <math.h>
#include "dspark_simd.h"

#define W 8

static inline __m256 poly_erf(__m256 x) {
    /* Rational minimax erf on [-4, 4] (odd numerator over even denominator);
       |error| < 1e-7 in float, outside the range erf is +-1 in float. */
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(4.0f)), _mm256_set1_ps(-4.0f));
    const __m256 x2 = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(-2.72614225801306e-10f);
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(2.77068142495902e-08f));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-2.10102402082508e-06f));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-5.69250639462346e-05f));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-7.34990630326855e-04f));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-2.95459980854025e-03f));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-1.60960333262415e-02f));
    p = _mm256_mul_ps(p, x);
    __m256 q = _mm256_set1_ps(-1.45660718464996e-05f);
    q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(-2.13374055278905e-04f));
    q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(-1.68282697438203e-03f));
    q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(-7.37332916720468e-03f));
    q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(-1.42647390514189e-02f));
    return _mm256_div_ps(p, q);
}

static inline __m256 vexp(__m256 x) {
    /* exp(x) = 2^n * exp(r), r = x - n ln2, |r| <= ln2/2, degree-6 polynomial. */
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline __m256 vgelu(__m256 v, int kind) {
    const __m256 half_v = _mm256_mul_ps(_mm256_set1_ps(0.5f), v);
    if (kind == DSPARK_GELU_TANH) {
        /* 0.5 v (1 + tanh(u)) == v / (1 + exp(-2u)) */
        const __m256 v3 = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
        const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                       _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), v3, v));
        const __m256 e = vexp(_mm256_mul_ps(_mm256_set1_ps(-2.0f), u));
        return _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    }
    const __m256 erf = poly_erf(_mm256_mul_ps(v, _mm256_set1_ps(0.7071067811865476f)));
    return _mm256_fmadd_ps(half_v, erf, half_v);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256i tail_mask(size_t n) {
    static const int bits[2 * W] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    return _mm256_loadu_si256((const __m256i *)(bits + W - n));
}

static void ln_gelu_rows(const float *x, size_t x_stride, size_t rows, size_t d,
                         const float *gamma, const float *beta, float eps,
                         int gelu_kind, float *out, size_t out_stride) {
    const size_t main = d - d % W;
    const size_t tail = d - main;
    const __m256i mask = tail_mask(tail);
    for (size_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *yr = out + r * out_stride;
        __m256 acc = _mm256_setzero_ps();
        for (size_t i = 0; i < main; i += W) acc = _mm256_add_ps(acc, _mm256_loadu_ps(xr + i));
        if (tail) acc = _mm256_add_ps(acc, _mm256_maskload_ps(xr + main, mask));
        const float mean = hsum(acc) / (float)d;
        const __m256 vmean = _mm256_set1_ps(mean);
        __m256 sq = _mm256_setzero_ps();
        for (size_t i = 0; i < main; i += W) {
            const __m256 c = _mm256_sub_ps(_mm256_loadu_ps(xr + i), vmean);
            sq = _mm256_fmadd_ps(c, c, sq);
        }
        if (tail) {
            const __m256 c = _mm256_and_ps(_mm256_sub_ps(_mm256_maskload_ps(xr + main, mask), vmean),
                                           _mm256_castsi256_ps(mask));
            sq = _mm256_fmadd_ps(c, c, sq);
        }
        const __m256 rstd = _mm256_set1_ps(1.0f / sqrtf(hsum(sq) / (float)d + eps));
        for (size_t i = 0; i < main; i += W) {
            const __m256 c = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(xr + i), vmean), rstd);
            const __m256 v = _mm256_fmadd_ps(c, _mm256_loadu_ps(gamma + i), _mm256_loadu_ps(beta + i));
            _mm256_storeu_ps(yr + i, vgelu(v, gelu_kind));
        }
        if (tail) {
            const __m256 c = _mm256_mul_ps(_mm256_sub_ps(_mm256_maskload_ps(xr + main, mask), vmean), rstd);
            const __m256 v = _mm256_fmadd_ps(c, _mm256_maskload_ps(gamma + main, mask),
                                             _mm256_maskload_ps(beta + main, mask));
            _mm256_maskstore_ps(yr + main, mask, vgelu(v, gelu_kind));
        }
    }
}

static const dspark_simd_kernels kernels = {"avx2", ln_gelu_rows};

const dspark_simd_kernels *dspark_simd_avx2(void) { return &kernels; }
