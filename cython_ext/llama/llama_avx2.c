/* AVX2 + FMA + F16C llama kernels (Zen 3 and later, Haswell and later): int8 x 4/8-bit dot
 * products with vpmaddubsw + vpmaddwd, one 8-lane vector per half tile. Only the table
 * getter is visible. */
#include <immintrin.h>
#include <math.h>
#include <string.h>
#include "llama_kernels.h"

#define AI static inline __attribute__((always_inline))
#ifndef LLAMA_PF_BLOCKS
#define LLAMA_PF_BLOCKS 8  /* software prefetch distance in blocks of a tile */
#endif
#ifndef LLAMA_PF_SUPER
#define LLAMA_PF_SUPER 4   /* the same in K-quant super-blocks (1 and 2 were 15-25 % slower on Zen 5) */
#endif

AI __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

AI __m256 load_half8(const void *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* R rows x one half (8 columns) of one tile, over all blocks: one sequential stream, as
 * llama_avx512.c (1-2 rows over several tiles at once were ~10 % slower per step on Zen 4's
 * AVX2 path). Q4 products of one block are summed in 16 bits (8 x 2 x 15 x 127 < 2^15); Q8
 * uses the sign trick (|w| times a * sign(w), each pair below 2^15), giving
 * sum(w * a) = sum(u * a) - 128 sum(a) directly. */
AI void half_kernel(const uint8_t *w0, size_t kb, const int fmt, int half, const llama_qact *a,
                    size_t r0, const int R, float *out, size_t ldo) {
    const size_t bb = llama_block_bytes(fmt), so = llama_scale_offset(fmt);
    const __m256i nib = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (size_t b = 0; b < kb; b++) {
        const int8_t *aq[4];
        for (int r = 0; r < R; r++) aq[r] = a->q + (r0 + r) * a->k + b * LLAMA_QK;
        const uint8_t *blk = w0 + b * bb + 32 * half;
#if LLAMA_PF_BLOCKS
        /* from 2 rows the block's arithmetic hides the prefetch (4-8 rows: ~10-20 % faster on
         * Zen 3); at 1 row the hardware prefetcher keeps up and this cost ~10 %. The first
         * half's pass brings the block's lines in; the second reads them from cache. */
        if (half == 0 && R > 1)
            for (size_t line = 0; line < bb; line += 64)
                _mm_prefetch((const char *)blk + LLAMA_PF_BLOCKS * bb + line, _MM_HINT_T0);
#endif
        __m256i isum[4];
        if (fmt == LLAMA_Q8_0) {
            const __m256i flip = _mm256_set1_epi8((char)0x80);
            for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
            for (int g = 0; g < 8; g++) {
                const __m256i ws = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 64 * g)), flip);
                const __m256i aw = _mm256_abs_epi8(ws);
                for (int r = 0; r < R; r++) {
                    const __m256i sa = _mm256_sign_epi8(bcast4(aq[r] + 4 * g), ws);
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sa), ones));
                }
            }
        } else if (llama_has_plane(fmt)) {
            /* 5-bit quants: a pair of products reaches 2 x 31 x 127, so each group's two goes
             * to 32 bits at once (8 groups in 16 bits would overflow) */
            const __m256i plane = _mm256_loadu_si256((const __m256i *)(blk + 256)), bit4 = _mm256_set1_epi8(0x10);
            for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
            for (int l = 0; l < 4; l++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * l));
                const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, nib),
                                                   _mm256_and_si256(_mm256_slli_epi16(plane, 4 - l), bit4));
                const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nib),
                                                   _mm256_and_si256(_mm256_srli_epi16(plane, l), bit4));
                for (int r = 0; r < R; r++) {
                    const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(aq[r] + 4 * l)),
                                                          _mm256_maddubs_epi16(hi, bcast4(aq[r] + 16 + 4 * l)));
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(pair, ones));
                }
            }
        } else {
            __m256i i16[4];
            for (int r = 0; r < R; r++) i16[r] = _mm256_setzero_si256();
            for (int l = 0; l < 4; l++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * l));
                const __m256i lo = _mm256_and_si256(v, nib);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
                for (int r = 0; r < R; r++) {
                    i16[r] = _mm256_add_epi16(i16[r], _mm256_maddubs_epi16(lo, bcast4(aq[r] + 4 * l)));
                    i16[r] = _mm256_add_epi16(i16[r], _mm256_maddubs_epi16(hi, bcast4(aq[r] + 16 + 4 * l)));
                }
            }
            for (int r = 0; r < R; r++) isum[r] = _mm256_madd_epi16(i16[r], ones);
        }
        const __m256 dw = load_half8(blk - 32 * half + so + 16 * half);
        for (int r = 0; r < R; r++) {
            const size_t ab = (r0 + r) * a->kb + b;
            if (fmt == LLAMA_Q4_0 || fmt == LLAMA_Q5_0)
                isum[r] = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(llama_zero_point(fmt) * a->sum[ab]));
            const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a->d[ab]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), scale, acc[r]);
            if (llama_has_m(fmt))
                acc[r] = _mm256_fmadd_ps(load_half8(blk - 32 * half + so + 32 + 16 * half),
                                         _mm256_set1_ps(a->s[ab]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + (r0 + r) * ldo + 8 * half, acc[r]);
}

AI __m256 bytes_ps(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* R rows x one half of a tile of K-quant super-blocks, as half_kernel; the integer sums of a
 * sub-block's first and second 16 inputs stay apart for Q6_K (two products of one group sum
 * below 2 x 63 x 127 per 16-bit lane, so pairs of groups go to 32 bits). */
AI void half_kernel_k(const uint8_t *w0, size_t nsb, const int fmt, int half, const llama_qact *a,
                      size_t r0, const int R, float *out, size_t ldo) {
    const size_t bb = llama_block_bytes(fmt), sb = llama_ksub_bytes(fmt), fb = llama_kfield_bytes(fmt);
    const __m256i nib = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (size_t B = 0; B < nsb; B++) {
        const uint8_t *f = w0 + B * bb, *blk = f + fb;
        const __m256 d = load_half8(f + 256 + 16 * half);
        const __m256 dmin = fmt == LLAMA_Q6_K ? d : load_half8(f + 288 + 16 * half);
        for (int s = 0; s < LLAMA_KSUB; s++) {
            const uint8_t *sub = blk + s * sb + 32 * half;
#if LLAMA_PF_BLOCKS
            /* an eighth of the super-block LLAMA_PF_SUPER ahead per sub-block */
            if (half == 0 && R > 1)
                for (size_t off = 0; off < bb / LLAMA_KSUB; off += 64)
                    _mm_prefetch((const char *)f + LLAMA_PF_SUPER * bb + s * (bb / LLAMA_KSUB) + off, _MM_HINT_T0);
#endif
            const size_t b = B * LLAMA_KSUB + s;
            const int8_t *aq[4];
            for (int r = 0; r < R; r++) aq[r] = a->q + (r0 + r) * a->k + b * LLAMA_QK;
            __m256i lo[4], hi[4];
            for (int l = 0; l < 4; l++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(sub + 64 * l));
                lo[l] = _mm256_and_si256(v, nib);
                hi[l] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
                if (fmt == LLAMA_Q5_K) {
                    const __m256i plane = _mm256_loadu_si256((const __m256i *)(sub + 256)), bit4 = _mm256_set1_epi8(0x10);
                    lo[l] = _mm256_or_si256(lo[l], _mm256_and_si256(_mm256_slli_epi16(plane, 4 - l), bit4));
                    hi[l] = _mm256_or_si256(hi[l], _mm256_and_si256(_mm256_srli_epi16(plane, l), bit4));
                } else if (fmt == LLAMA_Q6_K) {
                    const __m256i p0 = _mm256_loadu_si256((const __m256i *)(sub + 256));
                    const __m256i p1 = _mm256_loadu_si256((const __m256i *)(sub + 320)), bits = _mm256_set1_epi8(0x30);
                    const __m256i s0 = l < 2 ? _mm256_slli_epi16(p0, 4 - 2 * l) : _mm256_srli_epi16(p0, 2 * l - 4);
                    const __m256i s1 = l < 2 ? _mm256_slli_epi16(p1, 4 - 2 * l) : _mm256_srli_epi16(p1, 2 * l - 4);
                    lo[l] = _mm256_or_si256(lo[l], _mm256_and_si256(s0, bits));
                    hi[l] = _mm256_or_si256(hi[l], _mm256_and_si256(s1, bits));
                }
            }
            if (fmt == LLAMA_Q6_K) {
                const __m256i sa = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(f + 32 * s + 8 * half)));
                const __m256i sbv = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(f + 32 * s + 16 + 8 * half)));
                for (int r = 0; r < R; r++) {
                    __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
                    for (int l = 0; l < 4; l += 2) {
                        i0 = _mm256_add_epi32(i0, _mm256_madd_epi16(_mm256_add_epi16(
                            _mm256_maddubs_epi16(lo[l], bcast4(aq[r] + 4 * l)),
                            _mm256_maddubs_epi16(lo[l + 1], bcast4(aq[r] + 4 * l + 4))), ones));
                        i1 = _mm256_add_epi32(i1, _mm256_madd_epi16(_mm256_add_epi16(
                            _mm256_maddubs_epi16(hi[l], bcast4(aq[r] + 16 + 4 * l)),
                            _mm256_maddubs_epi16(hi[l + 1], bcast4(aq[r] + 20 + 4 * l))), ones));
                    }
                    const size_t ab = (r0 + r) * a->kb + b;
                    const int32_t lo_sum = a->sum_lo[ab], hi_sum = a->sum[ab] - lo_sum;
                    i0 = _mm256_sub_epi32(i0, _mm256_set1_epi32(32 * lo_sum));
                    i1 = _mm256_sub_epi32(i1, _mm256_set1_epi32(32 * hi_sum));
                    const __m256i isum = _mm256_add_epi32(_mm256_mullo_epi32(i0, sa), _mm256_mullo_epi32(i1, sbv));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(a->d[ab])), acc[r]);
                }
            } else {
                const __m256 dsc = _mm256_mul_ps(d, bytes_ps(f + 16 * s + 8 * half));
                const __m256 dm = _mm256_mul_ps(dmin, bytes_ps(f + 128 + 16 * s + 8 * half));
                for (int r = 0; r < R; r++) {
                    __m256i isum;
                    if (fmt == LLAMA_Q4_K) {  /* 8 products of 2 x 15 x 127 fit 16 bits */
                        __m256i i16 = _mm256_setzero_si256();
                        for (int l = 0; l < 4; l++) {
                            i16 = _mm256_add_epi16(i16, _mm256_maddubs_epi16(lo[l], bcast4(aq[r] + 4 * l)));
                            i16 = _mm256_add_epi16(i16, _mm256_maddubs_epi16(hi[l], bcast4(aq[r] + 16 + 4 * l)));
                        }
                        isum = _mm256_madd_epi16(i16, ones);
                    } else {
                        isum = _mm256_setzero_si256();
                        for (int l = 0; l < 4; l++)
                            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_add_epi16(
                                _mm256_maddubs_epi16(lo[l], bcast4(aq[r] + 4 * l)),
                                _mm256_maddubs_epi16(hi[l], bcast4(aq[r] + 16 + 4 * l))), ones));
                    }
                    const size_t ab = (r0 + r) * a->kb + b;
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dsc, _mm256_set1_ps(a->d[ab])), acc[r]);
                    acc[r] = _mm256_fnmadd_ps(dm, _mm256_set1_ps(a->s[ab]), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + (r0 + r) * ldo + 8 * half, acc[r]);
}

#define KERNEL_CASE(FMT, R)                                                                 \
    case R:                                                                                 \
        if (llama_is_k(FMT)) half_kernel_k(w0, kb, FMT, half, a, r0, R, out, ldo);          \
        else half_kernel(w0, kb, FMT, half, a, r0, R, out, ldo);                            \
        break;

#define DEFINE_RUN(FMT, NAME)                                                               \
    static void NAME(const uint8_t *w0, size_t kb, int half, const llama_qact *a, size_t r0, \
                     int R, float *out, size_t ldo) {                                       \
        switch (R) {                                                                        \
            KERNEL_CASE(FMT, 1) KERNEL_CASE(FMT, 2) KERNEL_CASE(FMT, 3) KERNEL_CASE(FMT, 4) \
        }                                                                                   \
    }
DEFINE_RUN(LLAMA_Q4_0, run_q4_0)
DEFINE_RUN(LLAMA_Q4_1, run_q4_1)
DEFINE_RUN(LLAMA_Q8_0, run_q8_0)
DEFINE_RUN(LLAMA_Q5_0, run_q5_0)
DEFINE_RUN(LLAMA_Q5_1, run_q5_1)
DEFINE_RUN(LLAMA_Q4_K, run_q4_k)
DEFINE_RUN(LLAMA_Q5_K, run_q5_k)
DEFINE_RUN(LLAMA_Q6_K, run_q6_k)

static void matmul(const llama_matrix *w, size_t tile0, size_t tile1, const llama_qact *a,
                   size_t rows, float *out, size_t ldo) {
    /* kb: blocks per tile (of 32 inputs, or K-quant super-blocks) */
    const size_t kb = w->k / llama_block_inputs(w->fmt), tb = llama_tile_bytes(w);
    void (*const runs[LLAMA_FORMATS])(const uint8_t *, size_t, int, const llama_qact *, size_t, int, float *, size_t) = {
        [LLAMA_Q4_0] = run_q4_0, [LLAMA_Q4_1] = run_q4_1, [LLAMA_Q8_0] = run_q8_0, [LLAMA_Q5_0] = run_q5_0,
        [LLAMA_Q4_K] = run_q4_k, [LLAMA_Q5_K] = run_q5_k, [LLAMA_Q6_K] = run_q6_k, [LLAMA_Q5_1] = run_q5_1};
    void (*run)(const uint8_t *, size_t, int, const llama_qact *, size_t, int, float *, size_t) = runs[w->fmt];
    for (size_t t = tile0; t < tile1; t += 4) {  /* 4 tiles stay in cache across row groups */
        const size_t chunk = tile1 - t < 4 ? tile1 - t : 4;
        for (size_t r0 = 0; r0 < rows; r0 += 4) {
            const int R = rows - r0 < 4 ? (int)(rows - r0) : 4;
            for (size_t c = 0; c < chunk; c++)
                for (int half = 0; half < 2; half++)  /* the second half reads the tile from L1 */
                    run(w->data + (t + c) * tb, kb, half, a, r0, R, out + (t + c) * LLAMA_TILE, ldo);
        }
    }
}

AI float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static void quantize(const float *x, size_t ldx, size_t rows, llama_qact *a) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (size_t r = 0; r < rows; r++) {
        for (size_t b = 0; b < a->kb; b++) {
            const float *xb = x + r * ldx + b * LLAMA_QK;
            __m256 v[4], m = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xb + 8 * i);
                m = _mm256_max_ps(m, _mm256_and_ps(v[i], absmask));
            }
            const float amax = hmax8(m);
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            const __m256 vid = _mm256_set1_ps(id);
            __m256i q[4];
            for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
            const __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
            s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
            const int32_t sum = _mm_cvtsi128_si32(s);
            const __m256i l2 = _mm256_add_epi32(q[0], q[1]);
            __m128i sl = _mm_add_epi32(_mm256_castsi256_si128(l2), _mm256_extracti128_si256(l2, 1));
            sl = _mm_add_epi32(sl, _mm_unpackhi_epi64(sl, sl));
            sl = _mm_add_epi32(sl, _mm_shuffle_epi32(sl, 1));
            const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(a->q + r * a->k + b * LLAMA_QK),
                                _mm256_permutevar8x32_epi32(packed, order));
            a->d[r * a->kb + b] = d;
            a->sum[r * a->kb + b] = sum;
            a->sum_lo[r * a->kb + b] = _mm_cvtsi128_si32(sl);
            a->s[r * a->kb + b] = d * (float)sum;
        }
    }
}

/* Mask of the first n (0..8) lanes for maskload/maskstore. */
AI __m256i lanes(size_t n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n > 8 ? 8 : n)), idx);
}
AI __m256 load_n(const float *p, size_t n) { return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes(n)); }
AI void store_n(float *p, size_t n, __m256 v) {
    if (n >= 8) _mm256_storeu_ps(p, v);
    else _mm256_maskstore_ps(p, lanes(n), v);
}

/* lo holds lanes 0-7, hi lanes 8-15 of the canonical 16: fold i + i+8, +4, +2, +1. */
AI float fold16(__m256 lo, __m256 hi) {
    const __m256 a = _mm256_add_ps(lo, hi);
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}

static float sum_squares(const float *x, size_t n) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (size_t i = 0; i < n; i += 16) {
        const __m256 a = load_n(x + i, n - i);
        lo = _mm256_fmadd_ps(a, a, lo);
        if (i + 8 < n) {
            const __m256 b = load_n(x + i + 8, n - i - 8);
            hi = _mm256_fmadd_ps(b, b, hi);
        }
    }
    return fold16(lo, hi);
}

#define VF __m256
#define vset1 _mm256_set1_ps
#define vmin _mm256_min_ps
#define vmax _mm256_max_ps
#define vmul _mm256_mul_ps
#define vadd _mm256_add_ps
#define vfmadd _mm256_fmadd_ps
#define vround(v) _mm256_round_ps((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vexp2i(n) _mm256_castsi256_ps(_mm256_slli_epi32( \
    _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
#include "llama_exp.inc"

static void swiglu(const float *gate, const float *up, size_t n, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (size_t i = 0; i < n; i += 8) {
        const __m256 g = load_n(gate + i, n - i), u = load_n(up + i, n - i);
        const __m256 e = exp_canonical(_mm256_sub_ps(_mm256_setzero_ps(), g));
        store_n(out + i, n - i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u));
    }
}

AI void scores_nq(const float *const *q, const int NQ, size_t hd, const uint16_t *kt, size_t n,
                  float *s, size_t ls) {
    for (size_t j = 0; j < n; j += 16) {
        const uint16_t *kb = kt + (j / 16) * hd * 16;
        __m256 acc[4][2];
        for (int h = 0; h < NQ; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
        for (size_t d = 0; d < hd; d++) {
            const __m256 k0 = load_half8(kb + d * 16), k1 = load_half8(kb + d * 16 + 8);
            for (int h = 0; h < NQ; h++) {
                const __m256 qd = _mm256_set1_ps(q[h][d]);
                acc[h][0] = _mm256_fmadd_ps(qd, k0, acc[h][0]);
                acc[h][1] = _mm256_fmadd_ps(qd, k1, acc[h][1]);
            }
        }
        for (int h = 0; h < NQ; h++) {
            store_n(s + h * ls + j, n - j, acc[h][0]);
            if (j + 8 < n) store_n(s + h * ls + j + 8, n - j - 8, acc[h][1]);
        }
    }
}

static void scores(const float *const *q, size_t nq, size_t hd, const uint16_t *kt, size_t n,
                   float *s, size_t ls) {
    for (size_t h = 0; h < nq; h += 4) {
        switch (nq - h >= 4 ? 4 : nq - h) {
        case 4: scores_nq(q + h, 4, hd, kt, n, s + h * ls, ls); break;
        case 3: scores_nq(q + h, 3, hd, kt, n, s + h * ls, ls); break;
        case 2: scores_nq(q + h, 2, hd, kt, n, s + h * ls, ls); break;
        default: scores_nq(q + h, 1, hd, kt, n, s + h * ls, ls); break;
        }
    }
}

static float softmax(float *p, size_t n) {
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (size_t i = 0; i < n; i += 8) {
        const __m256 v = load_n(p + i, n - i);
        mx = _mm256_max_ps(mx, n - i >= 8 ? v : _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v,
                                                                 _mm256_castsi256_ps(lanes(n - i))));
    }
    const __m256 top = _mm256_set1_ps(hmax8(mx));
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (size_t i = 0; i < n; i += 8) {
        __m256 e = exp_canonical(_mm256_sub_ps(load_n(p + i, n - i), top));
        if (n - i < 8) e = _mm256_and_ps(e, _mm256_castsi256_ps(lanes(n - i)));
        store_n(p + i, n - i, e);
        if ((i / 8) % 2 == 0) lo = _mm256_add_ps(lo, e);
        else hi = _mm256_add_ps(hi, e);
    }
    return fold16(lo, hi);
}

/* NQ (<= 2) queries x 32 dims (4 vectors) starting at dim d0. */
AI void values_block(const float *p, size_t lp, const int NQ, const float *scale, size_t hd,
                     size_t d0, const uint16_t *v, const int32_t *idx, size_t n, float *out) {
    __m256 acc[2][4];
    for (int h = 0; h < NQ; h++)
        for (int i = 0; i < 4; i++) acc[h][i] = _mm256_setzero_ps();
    for (size_t c = 0; c < n; c++) {
        const uint16_t *row = v + (size_t)idx[c] * hd + d0;
        __m256 vv[4];
        for (int i = 0; i < 4; i++) vv[i] = load_half8(row + 8 * i);
        for (int h = 0; h < NQ; h++) {
            const __m256 ph = _mm256_set1_ps(p[h * lp + c]);
            for (int i = 0; i < 4; i++) acc[h][i] = _mm256_fmadd_ps(ph, vv[i], acc[h][i]);
        }
    }
    for (int h = 0; h < NQ; h++)
        for (int i = 0; i < 4; i++)
            _mm256_storeu_ps(out + h * hd + d0 + 8 * i, _mm256_mul_ps(acc[h][i], _mm256_set1_ps(scale[h])));
}

static void values(const float *p, size_t lp, size_t nq, const float *scale, size_t hd,
                   const uint16_t *v, const int32_t *idx, size_t n, float *out) {
    for (size_t d0 = 0; d0 < hd; d0 += 32)
        for (size_t h = 0; h < nq; h += 2) {
            if (nq - h >= 2) values_block(p + h * lp, lp, 2, scale + h, hd, d0, v, idx, n, out + h * hd);
            else values_block(p + h * lp, lp, 1, scale + h, hd, d0, v, idx, n, out + h * hd);
        }
}

static const llama_kernels kernels = {
    "avx2", matmul, quantize, sum_squares, swiglu, scores, softmax, values,
};

const llama_kernels *llama_kernels_avx2(void) { return &kernels; }
