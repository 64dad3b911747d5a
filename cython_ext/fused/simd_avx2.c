/* AVX2+FMA path. Compiled with -mavx2 -mfma; only the table getter is visible. */
#include <immintrin.h>
#include <math.h>
#include "dspark_simd.h"

#define VF __m256
#define VW 8
#define VMASK __m256i
#define vset1 _mm256_set1_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmul _mm256_mul_ps
#define vdiv _mm256_div_ps
#define vmin _mm256_min_ps
#define vmax _mm256_max_ps
#define vfmadd _mm256_fmadd_ps
#define vfnmadd _mm256_fnmadd_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vload_tail(mask, p) _mm256_maskload_ps((p), (mask))
#define vstore_tail(mask, p, v) _mm256_maskstore_ps((p), (mask), (v))
#define vzero_tail(mask, v) _mm256_and_ps((v), _mm256_castsi256_ps(mask))
#define vround(v) _mm256_round_ps((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vexp2i(n) _mm256_castsi256_ps(_mm256_slli_epi32( \
    _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))

static inline float vhsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256i tail_mask(size_t n) {
    static const int bits[2 * VW] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    return _mm256_loadu_si256((const __m256i *)(bits + VW - n));
}

#include "simd_ln_gelu.inc"

#define MR 6
#include "simd_gemm.inc"

DSPARK_SIMD_TABLE(kernels, "avx2");

const dspark_simd_kernels *dspark_simd_avx2(void) { return &kernels; }
