/* AVX-512 llama kernels (F, BW, VL, VNNI): int8 x 4/8-bit dot products with vpdpbusd, one
 * 16-lane vector per tile of 16 output columns. Only the table getter is visible. */
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
#ifndef LLAMA_PF_HINT
#define LLAMA_PF_HINT _MM_HINT_T0
#endif

AI __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

AI __m512 load_half16(const void *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* R rows x one tile over all blocks, reading the tile as one sequential stream. One tile per
 * call at every row count: 1-2 rows over 4 or 2 adjacent tiles (4 or 2 streams at once) made
 * 1-row decoder steps ~1.25x slower on Zen 4 (docs/llm_kernels.md). SPLIT keeps two integer
 * accumulators per row so a short kernel has enough independent vpdpbusd chains (up to 6
 * rows: at 7-8 the extra registers cost more than they give). */
AI void tile_kernel(const uint8_t *w0, size_t kb, const int fmt, const llama_qact *a, size_t r0,
                    const int R, float *out, size_t ldo) {
    const size_t bb = llama_block_bytes(fmt), so = llama_scale_offset(fmt);
    const int zero = llama_zero_point(fmt), split = R <= 6;
    const __m512i nib = _mm512_set1_epi8(0x0f);
    __m512 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (size_t b = 0; b < kb; b++) {
        const int8_t *aq[8];
        for (int r = 0; r < R; r++) aq[r] = a->q + (r0 + r) * a->k + b * LLAMA_QK;
        const uint8_t *blk = w0 + b * bb;
#if LLAMA_PF_BLOCKS
        /* the hardware prefetcher alone keeps too few lines in flight for one core */
        for (size_t line = 0; line < bb; line += 64)
            _mm_prefetch((const char *)blk + LLAMA_PF_BLOCKS * bb + line, LLAMA_PF_HINT);
#endif
        __m512i i0[8], i1[8];
        for (int r = 0; r < R; r++) i0[r] = i1[r] = _mm512_setzero_si512();
        if (fmt == LLAMA_Q8_0) {
            for (int g = 0; g < 8; g += 2) {
                const __m512i wa = _mm512_loadu_si512(blk + 64 * g);
                const __m512i wb = _mm512_loadu_si512(blk + 64 * g + 64);
                for (int r = 0; r < R; r++) {
                    i0[r] = _mm512_dpbusd_epi32(i0[r], wa, bcast4(aq[r] + 4 * g));
                    if (split)
                        i1[r] = _mm512_dpbusd_epi32(i1[r], wb, bcast4(aq[r] + 4 * g + 4));
                    else
                        i0[r] = _mm512_dpbusd_epi32(i0[r], wb, bcast4(aq[r] + 4 * g + 4));
                }
            }
        } else {
            const __m512i plane = llama_has_plane(fmt) ? _mm512_loadu_si512(blk + 256) : _mm512_setzero_si512();
            const __m512i bit4 = _mm512_set1_epi8(0x10);
            for (int l = 0; l < 4; l++) {
                const __m512i v = _mm512_loadu_si512(blk + 64 * l);
                __m512i lo = _mm512_and_si512(v, nib);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
                if (llama_has_plane(fmt)) {  /* the fifth bits: bit l (low nibbles) and 4 + l (high) to bit 4 */
                    lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(plane, 4 - l), bit4));
                    hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srli_epi16(plane, l), bit4));
                }
                for (int r = 0; r < R; r++) {
                    i0[r] = _mm512_dpbusd_epi32(i0[r], lo, bcast4(aq[r] + 4 * l));
                    if (split)
                        i1[r] = _mm512_dpbusd_epi32(i1[r], hi, bcast4(aq[r] + 16 + 4 * l));
                    else
                        i0[r] = _mm512_dpbusd_epi32(i0[r], hi, bcast4(aq[r] + 16 + 4 * l));
                }
            }
        }
        const __m512 dw = load_half16(blk + so);
        for (int r = 0; r < R; r++) {
            const size_t ab = (r0 + r) * a->kb + b;
            __m512i isum = split ? _mm512_add_epi32(i0[r], i1[r]) : i0[r];
            if (zero) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(zero * a->sum[ab]));
            const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a->d[ab]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[r]);
            if (llama_has_m(fmt))
                acc[r] = _mm512_fmadd_ps(load_half16(blk + so + 32), _mm512_set1_ps(a->s[ab]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + (r0 + r) * ldo, acc[r]);
}

/* The unsigned quants of group L's low (first 16 inputs) and high (second 16) nibbles of a
 * K-quant sub-block, the fifth bits (Q5_K) or two high bits (Q6_K) merged in. */
AI void k_quants(const uint8_t *sub, const int fmt, int l, __m512i *lo, __m512i *hi) {
    const __m512i nib = _mm512_set1_epi8(0x0f), v = _mm512_loadu_si512(sub + 64 * l);
    *lo = _mm512_and_si512(v, nib);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
    if (fmt == LLAMA_Q5_K) {
        const __m512i plane = _mm512_loadu_si512(sub + 256), bit4 = _mm512_set1_epi8(0x10);
        *lo = _mm512_or_si512(*lo, _mm512_and_si512(_mm512_slli_epi16(plane, 4 - l), bit4));
        *hi = _mm512_or_si512(*hi, _mm512_and_si512(_mm512_srli_epi16(plane, l), bit4));
    } else if (fmt == LLAMA_Q6_K) {  /* bits 2l, 2l+1 of each plane to bits 4, 5 */
        const __m512i p0 = _mm512_loadu_si512(sub + 256), p1 = _mm512_loadu_si512(sub + 320);
        const __m512i bits = _mm512_set1_epi8(0x30);
        const __m512i s0 = l < 2 ? _mm512_slli_epi16(p0, 4 - 2 * l) : _mm512_srli_epi16(p0, 2 * l - 4);
        const __m512i s1 = l < 2 ? _mm512_slli_epi16(p1, 4 - 2 * l) : _mm512_srli_epi16(p1, 2 * l - 4);
        *lo = _mm512_or_si512(*lo, _mm512_and_si512(s0, bits));
        *hi = _mm512_or_si512(*hi, _mm512_and_si512(s1, bits));
    }
}

AI __m512 bytes_ps(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))); }

/* R rows x one tile of K-quant super-blocks: per sub-block, the integer sums of its first and
 * second 16 inputs (i0, i1), then the float steps of llama_kernels.h. */
AI void tile_kernel_k(const uint8_t *w0, size_t nsb, const int fmt, const llama_qact *a, size_t r0,
                      const int R, float *out, size_t ldo) {
    const size_t bb = llama_block_bytes(fmt), sb = llama_ksub_bytes(fmt), fb = llama_kfield_bytes(fmt);
    __m512 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (size_t B = 0; B < nsb; B++) {
        const uint8_t *f = w0 + B * bb, *blk = f + fb;
        const __m512 d = load_half16(f + 256);
        const __m512 dmin = fmt == LLAMA_Q6_K ? d : load_half16(f + 288);
        for (int s = 0; s < LLAMA_KSUB; s++) {
            const uint8_t *sub = blk + s * sb;
#if LLAMA_PF_BLOCKS
            /* an eighth of the super-block LLAMA_PF_SUPER ahead per sub-block */
            for (size_t off = 0; off < bb / LLAMA_KSUB; off += 64)
                _mm_prefetch((const char *)f + LLAMA_PF_SUPER * bb + s * (bb / LLAMA_KSUB) + off, LLAMA_PF_HINT);
#endif
            const size_t b = B * LLAMA_KSUB + s;
            __m512i i0[8], i1[8];
            for (int r = 0; r < R; r++) i0[r] = i1[r] = _mm512_setzero_si512();
            for (int l = 0; l < 4; l++) {
                __m512i lo, hi;
                k_quants(sub, fmt, l, &lo, &hi);
                for (int r = 0; r < R; r++) {
                    const int8_t *aq = a->q + (r0 + r) * a->k + b * LLAMA_QK;
                    i0[r] = _mm512_dpbusd_epi32(i0[r], lo, bcast4(aq + 4 * l));
                    i1[r] = _mm512_dpbusd_epi32(i1[r], hi, bcast4(aq + 16 + 4 * l));
                }
            }
            if (fmt == LLAMA_Q6_K) {
                const __m512i sa = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(f + 32 * s)));
                const __m512i sbv = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(f + 32 * s + 16)));
                for (int r = 0; r < R; r++) {
                    const size_t ab = (r0 + r) * a->kb + b;
                    const int32_t lo_sum = a->sum_lo[ab], hi_sum = a->sum[ab] - lo_sum;
                    const __m512i lo = _mm512_sub_epi32(i0[r], _mm512_set1_epi32(32 * lo_sum));
                    const __m512i hi = _mm512_sub_epi32(i1[r], _mm512_set1_epi32(32 * hi_sum));
                    const __m512i isum = _mm512_add_epi32(_mm512_mullo_epi32(lo, sa), _mm512_mullo_epi32(hi, sbv));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(a->d[ab])), acc[r]);
                }
            } else {
                const __m512 dsc = _mm512_mul_ps(d, bytes_ps(f + 16 * s));
                const __m512 dm = _mm512_mul_ps(dmin, bytes_ps(f + 128 + 16 * s));
                for (int r = 0; r < R; r++) {
                    const size_t ab = (r0 + r) * a->kb + b;
                    const __m512 isum = _mm512_cvtepi32_ps(_mm512_add_epi32(i0[r], i1[r]));
                    acc[r] = _mm512_fmadd_ps(isum, _mm512_mul_ps(dsc, _mm512_set1_ps(a->d[ab])), acc[r]);
                    acc[r] = _mm512_fnmadd_ps(dm, _mm512_set1_ps(a->s[ab]), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + (r0 + r) * ldo, acc[r]);
}

#define KERNEL_CASE(FMT, R)                                                                 \
    case R:                                                                                 \
        if (llama_is_k(FMT)) tile_kernel_k(w0, kb, FMT, a, r0, R, out, ldo);                \
        else tile_kernel(w0, kb, FMT, a, r0, R, out, ldo);                                  \
        break;

#define DEFINE_RUN(FMT, NAME)                                                               \
    static void NAME(const uint8_t *w0, size_t kb, const llama_qact *a, size_t r0, int R,    \
                     float *out, size_t ldo) {                                              \
        switch (R) {                                                                        \
            KERNEL_CASE(FMT, 1) KERNEL_CASE(FMT, 2) KERNEL_CASE(FMT, 3)                     \
            KERNEL_CASE(FMT, 4) KERNEL_CASE(FMT, 5) KERNEL_CASE(FMT, 6)                     \
            KERNEL_CASE(FMT, 7) KERNEL_CASE(FMT, 8)                                         \
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
    void (*const runs[LLAMA_FORMATS])(const uint8_t *, size_t, const llama_qact *, size_t, int, float *, size_t) = {
        [LLAMA_Q4_0] = run_q4_0, [LLAMA_Q4_1] = run_q4_1, [LLAMA_Q8_0] = run_q8_0, [LLAMA_Q5_0] = run_q5_0,
        [LLAMA_Q4_K] = run_q4_k, [LLAMA_Q5_K] = run_q5_k, [LLAMA_Q6_K] = run_q6_k, [LLAMA_Q5_1] = run_q5_1};
    void (*run)(const uint8_t *, size_t, const llama_qact *, size_t, int, float *, size_t) = runs[w->fmt];
    for (size_t t = tile0; t < tile1; t += 4) {  /* 4 tiles stay in cache across row groups */
        const size_t chunk = tile1 - t < 4 ? tile1 - t : 4;
        for (size_t r0 = 0; r0 < rows; r0 += 8) {
            const int R = rows - r0 < 8 ? (int)(rows - r0) : 8;
            for (size_t c = 0; c < chunk; c++)
                run(w->data + (t + c) * tb, kb, a, r0, R, out + (t + c) * LLAMA_TILE, ldo);
        }
    }
}

static void quantize(const float *x, size_t ldx, size_t rows, llama_qact *a) {
    for (size_t r = 0; r < rows; r++) {
        for (size_t b = 0; b < a->kb; b++) {
            const float *xb = x + r * ldx + b * LLAMA_QK;
            const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
            const __m512 m = _mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1));
            const float amax = _mm512_reduce_max_ps(m);
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            const __m512 vid = _mm512_set1_ps(id);
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, vid));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, vid));
            int8_t *q = a->q + r * a->k + b * LLAMA_QK;
            _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(q1));
            const int32_t sum_lo = _mm512_reduce_add_epi32(q0);
            const int32_t sum = sum_lo + _mm512_reduce_add_epi32(q1);
            a->d[r * a->kb + b] = d;
            a->sum[r * a->kb + b] = sum;
            a->sum_lo[r * a->kb + b] = sum_lo;
            a->s[r * a->kb + b] = d * (float)sum;
        }
    }
}

AI __mmask16 tail_mask(size_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

/* lane i + lane i+8, +4, +2, +1: the canonical fold. */
AI float fold16(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}

static float sum_squares(const float *x, size_t n) {
    __m512 acc = _mm512_setzero_ps();
    for (size_t i = 0; i < n; i += 16) {
        const __m512 v = _mm512_maskz_loadu_ps(tail_mask(n - i), x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    return fold16(acc);
}

#define VF __m512
#define vset1 _mm512_set1_ps
#define vmin _mm512_min_ps
#define vmax _mm512_max_ps
#define vmul _mm512_mul_ps
#define vadd _mm512_add_ps
#define vfmadd _mm512_fmadd_ps
#define vround(v) _mm512_roundscale_ps((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vexp2i(n) _mm512_castsi512_ps(_mm512_slli_epi32( \
    _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
#include "llama_exp.inc"

static void swiglu(const float *gate, const float *up, size_t n, float *out) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (size_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 g = _mm512_maskz_loadu_ps(m, gate + i), u = _mm512_maskz_loadu_ps(m, up + i);
        const __m512 e = exp_canonical(_mm512_sub_ps(_mm512_setzero_ps(), g));
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), u));
    }
}

/* NQ queries x NB blocks of 16 keys: NQ * NB independent chains of fma over the dims, each
 * key converted from fp16 once for all NQ queries. */
AI void scores_nq(const float *const *q, const int NQ, const int NB, size_t hd, const uint16_t *kt,
                  size_t n, float *s, size_t ls) {
    for (size_t j = 0; j < n; j += 16 * (size_t)NB) {
        const uint16_t *kb[8];
        for (int i = 0; i < NB; i++)  /* blocks past n repeat the first: computed, never stored */
            kb[i] = kt + ((j + 16 * i < n ? j + 16 * i : j) / 16) * hd * 16;
        __m512 acc[6][8];
        for (int h = 0; h < NQ; h++)
            for (int i = 0; i < NB; i++) acc[h][i] = _mm512_setzero_ps();
        for (size_t d = 0; d < hd; d++) {
            __m512 k[8];
            for (int i = 0; i < NB; i++) k[i] = load_half16(kb[i] + d * 16);
            for (int h = 0; h < NQ; h++) {
                const __m512 qd = _mm512_set1_ps(q[h][d]);
                for (int i = 0; i < NB; i++) acc[h][i] = _mm512_fmadd_ps(qd, k[i], acc[h][i]);
            }
        }
        for (int i = 0; i < NB; i++) {
            if (j + 16 * i >= n) break;
            const __mmask16 m = tail_mask(n - j - 16 * i);
            for (int h = 0; h < NQ; h++) _mm512_mask_storeu_ps(s + h * ls + j + 16 * i, m, acc[h][i]);
        }
    }
}

static void scores(const float *const *q, size_t nq, size_t hd, const uint16_t *kt, size_t n,
                   float *s, size_t ls) {
    for (size_t h = 0; h < nq; h += 6) {
        switch (nq - h >= 6 ? 6 : nq - h) {
        case 6: scores_nq(q + h, 6, 2, hd, kt, n, s + h * ls, ls); break;
        case 5: scores_nq(q + h, 5, 2, hd, kt, n, s + h * ls, ls); break;
        case 4: scores_nq(q + h, 4, 3, hd, kt, n, s + h * ls, ls); break;
        case 3: scores_nq(q + h, 3, 4, hd, kt, n, s + h * ls, ls); break;
        case 2: scores_nq(q + h, 2, 6, hd, kt, n, s + h * ls, ls); break;
        default: scores_nq(q + h, 1, 8, hd, kt, n, s + h * ls, ls); break;
        }
    }
}

static float softmax(float *p, size_t n) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (size_t i = 0; i < n; i += 16)
        mx = _mm512_mask_max_ps(mx, tail_mask(n - i), mx, _mm512_maskz_loadu_ps(tail_mask(n - i), p + i));
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 acc = _mm512_setzero_ps();
    for (size_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 e = exp_canonical(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p + i), top));
        _mm512_mask_storeu_ps(p + i, m, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(m, e));
    }
    return fold16(acc);
}

/* NQ queries x 64 dims (4 vectors) from hd-wide value rows starting at dim d0. */
AI void values_block(const float *p, size_t lp, const int NQ, const float *scale, size_t hd,
                     size_t d0, const uint16_t *v, const int32_t *idx, size_t n, float *out) {
    __m512 acc[4][4];
    for (int h = 0; h < NQ; h++)
        for (int i = 0; i < 4; i++) acc[h][i] = _mm512_setzero_ps();
    for (size_t c = 0; c < n; c++) {
        const uint16_t *row = v + (size_t)idx[c] * hd + d0;
        __m512 vv[4];
        for (int i = 0; i < 4; i++) vv[i] = load_half16(row + 16 * i);
        for (int h = 0; h < NQ; h++) {
            const __m512 ph = _mm512_set1_ps(p[h * lp + c]);
            for (int i = 0; i < 4; i++) acc[h][i] = _mm512_fmadd_ps(ph, vv[i], acc[h][i]);
        }
    }
    for (int h = 0; h < NQ; h++)
        for (int i = 0; i < 4; i++)
            _mm512_storeu_ps(out + h * hd + d0 + 16 * i, _mm512_mul_ps(acc[h][i], _mm512_set1_ps(scale[h])));
}

static void values(const float *p, size_t lp, size_t nq, const float *scale, size_t hd,
                   const uint16_t *v, const int32_t *idx, size_t n, float *out) {
    for (size_t d0 = 0; d0 < hd; d0 += 64)
        for (size_t h = 0; h < nq; h += 4) {
            const float *ph = p + h * lp;
            float *oh = out + h * hd;
            switch (nq - h >= 4 ? 4 : nq - h) {
            case 4: values_block(ph, lp, 4, scale + h, hd, d0, v, idx, n, oh); break;
            case 3: values_block(ph, lp, 3, scale + h, hd, d0, v, idx, n, oh); break;
            case 2: values_block(ph, lp, 2, scale + h, hd, d0, v, idx, n, oh); break;
            default: values_block(ph, lp, 1, scale + h, hd, d0, v, idx, n, oh); break;
            }
        }
}

static const llama_kernels kernels = {
    "avx512", matmul, quantize, sum_squares, swiglu, scores, softmax, values,
};

const llama_kernels *llama_kernels_avx512(void) { return &kernels; }
