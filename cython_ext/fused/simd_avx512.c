/* AVX-512F path. Compiled with -mavx512f -mfma; only the table getter is visible. */
#include <immintrin.h>
#include <math.h>
#include "dspark_simd.h"

#define VF __m512
#define VW 16
#define VMASK __mmask16
#define vset1 _mm512_set1_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmul _mm512_mul_ps
#define vdiv _mm512_div_ps
#define vmin _mm512_min_ps
#define vmax _mm512_max_ps
#define vfmadd _mm512_fmadd_ps
#define vfnmadd _mm512_fnmadd_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vload_tail(mask, p) _mm512_maskz_loadu_ps((mask), (p))
#define vstore_tail(mask, p, v) _mm512_mask_storeu_ps((p), (mask), (v))
#define vzero_tail(mask, v) _mm512_maskz_mov_ps((mask), (v))
#define vround(v) _mm512_roundscale_ps((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vexp2i(n) _mm512_castsi512_ps(_mm512_slli_epi32( \
    _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
#define vhsum _mm512_reduce_add_ps

static inline __mmask16 tail_mask(size_t n) { return (__mmask16)((1u << n) - 1u); }

#include "simd_ln_gelu.inc"

#define MR 14
#include "simd_gemm.inc"

DSPARK_SIMD_TABLE(kernels, "avx512");

const dspark_simd_kernels *dspark_simd_avx512(void) { return &kernels; }
