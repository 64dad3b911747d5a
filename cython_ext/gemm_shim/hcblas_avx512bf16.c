/* AVX512-BF16 + AVX512-VNNI path (Zen 4, Cooper Lake, Sapphire Rapids): bf16 dot products with
 * VDPBF16PS (two bf16 products per fp32 lane) and int8 with VPDPBUSD (four u8 x s8 products per
 * int32 lane). Compiled with -mavx512f -mavx512bw -mavx512bf16 -mavx512vnni; only the table
 * getter is visible.
 *
 * Micro-kernel: MR rows x 32 columns (2 x MR zmm accumulators); per step one pair (bf16) or quad
 * (int8) of k: two loads of Y's packed panels and MR broadcasts of X's packed pairs/quads.
 * VPDPBUSD multiplies unsigned by signed bytes, so X is stored + 128 and 128 x the column sums
 * of Y are taken off the accumulators before the epilogue. */
#include <immintrin.h>
#include "hcblas_kernels.h"
#include "hcblas_pack.inc"

#define MR 14
#define PANELS_PER_BLOCK 16 /* 256 columns of Y kept in L2 while every row block passes */

/* X as micro-panels of MR rows: for each group g of `per` consecutive k (a pair or a quad), MR
 * 32-bit words; word i of group g holds X[r0 + i][g * per .. g * per + per - 1]. */
#define XB_INDEX(r, k, groups, per) \
    ((((r) / MR) * (groups) + (k) / (per)) * MR * (per) + ((r) % MR) * (per) + (k) % (per))

/* What every thread of one product shares: packed X (32-bit groups), packed Y, geometry, and
 * for int8 the column sums of Y. */
typedef struct {
    const hcblas_problem *p;
    const uint32_t *xw;
    const char *yb;
    size_t groups, panels;
    const int32_t *colsum;
} vnni_job;

/* Row blocks [begin, end) of MR rows, one worker per element type: STEP is the dot product of a
 * broadcast group of X with a panel row of Y, STORE writes the accumulators, FIX adjusts them
 * before the epilogue (the int8 VNNI correction). */
#define KERNEL_WORKER(name, ACC_T, OUT_T, ZERO, STEP, STORE, FIX)                                  \
    static void name(void *arg, size_t begin, size_t end) {                                        \
        const vnni_job *job = arg;                                                                 \
        const hcblas_problem *p = job->p;                                                          \
        const size_t groups = job->groups, panels = job->panels;                                   \
        OUT_T out[MR * 32] __attribute__((aligned(64)));                                           \
        for (size_t s_block = 0; s_block < panels; s_block += PANELS_PER_BLOCK) {                   \
            size_t s_end = s_block + PANELS_PER_BLOCK < panels ? s_block + PANELS_PER_BLOCK : panels; \
            for (size_t rb = begin * MR; rb < end * MR; rb += MR) {                                \
                const uint32_t *a = job->xw + rb * groups;                                         \
                for (size_t sp = s_block; sp < s_end; sp += 2) {                                   \
                    const char *b0 = job->yb + sp * groups * 64, *b1 = b0 + groups * 64;           \
                    ACC_T acc[MR][2];                                                              \
                    _Pragma("GCC unroll 14") for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = ZERO; \
                    for (size_t g = 0; g < groups; g++) {                                          \
                        __m512i y0 = _mm512_load_si512(b0 + g * 64), y1 = _mm512_load_si512(b1 + g * 64); \
                        _Pragma("GCC unroll 14") for (int i = 0; i < MR; i++) {                    \
                            __m512i x = _mm512_set1_epi32((int)a[g * MR + i]);                      \
                            acc[i][0] = STEP(acc[i][0], x, y0);                                     \
                            acc[i][1] = STEP(acc[i][1], x, y1);                                     \
                        }                                                                          \
                    }                                                                              \
                    _Pragma("GCC unroll 14") for (int i = 0; i < MR; i++) {                        \
                        STORE(out + i * 32, acc[i][0]);                                            \
                        STORE(out + i * 32 + 16, acc[i][1]);                                       \
                    }                                                                              \
                    FIX;                                                                           \
                    p->epilogue(p->ctx, rb, sp * 16, MR, 32, out, 32);                             \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }

static inline __m512 dot_bf16(__m512 acc, __m512i x, __m512i y) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)y);
}

KERNEL_WORKER(rows_bf16, __m512, float, _mm512_setzero_ps(), dot_bf16, _mm512_store_ps, (void)0)
KERNEL_WORKER(rows_s8, __m512i, int32_t, _mm512_setzero_si512(), _mm512_dpbusd_epi32, _mm512_store_si512,
              for (int i = 0; i < MR; i++) for (int j = 0; j < 32; j++)
                  out[i * 32 + j] -= 128 * job->colsum[sp * 16 + j])

static int gemm_bf16(const hcblas_problem *p) {
    const size_t Kp = round_up(p->K, 32), groups = Kp / 2, Rp = round_up(p->R, MR), Sp = round_up(p->S, 32);
    const size_t panels = Sp / 16;
    uint16_t *xp = aligned_zeroed(Rp * Kp * sizeof(uint16_t));
    uint16_t *yp = pack_y_bf16(p, Kp, Sp);
    if (!xp || !yp) {
        free(xp);
        free(yp);
        return -1;
    }
    if (!p->fp32_in && p->x_cs == 1) /* rows of X contiguous: whole pairs at once */
        for (size_t r = 0; r < p->R; r++) {
            const uint16_t *row = (const uint16_t *)p->x + (ptrdiff_t)r * p->x_rs;
            for (size_t k = 0; k < p->K; k += 2) {
                uint32_t pair = row[k] | (k + 1 < p->K ? (uint32_t)row[k + 1] << 16 : 0u);
                ((uint32_t *)xp)[((r / MR) * groups + k / 2) * MR + r % MR] = pair;
            }
        }
    else
        FOR_EACH_X(p, xp[XB_INDEX(r, k, groups, 2)] = x_bf16(p, r, k));
    vnni_job job = {p, (const uint32_t *)xp, (const char *)yp, groups, panels, NULL};
    run_parallel(rows_bf16, &job, Rp / MR, p->threads);
    free(xp);
    free(yp);
    return 0;
}

static int gemm_s8(const hcblas_problem *p) {
    const size_t Kp = round_up(p->K, 64), groups = Kp / 4, Rp = round_up(p->R, MR), Sp = round_up(p->S, 32);
    const size_t panels = Sp / 16;
    uint8_t *xp = aligned_zeroed(Rp * Kp);
    int32_t *colsum = aligned_zeroed(Sp * sizeof(int32_t));
    int8_t *yp = colsum ? pack_y_s8(p, Kp, Sp, colsum) : NULL;
    if (!xp || !yp) {
        free(xp);
        free(yp);
        free(colsum);
        return -1;
    }
    /* Padding stays 0: past K, Y is 0; past R, rows are clipped by the epilogue. */
    if (p->x_cs == 1) /* rows of X contiguous: whole quads at once, + 128 as XOR 0x80 per byte */
        for (size_t r = 0; r < p->R; r++) {
            const uint8_t *row = (const uint8_t *)p->x + (ptrdiff_t)r * p->x_rs;
            for (size_t k = 0; k < p->K; k += 4) {
                uint32_t quad = 0;
                for (size_t e = 0; e < 4 && k + e < p->K; e++) quad |= (uint32_t)(row[k + e] ^ 0x80u) << (8 * e);
                ((uint32_t *)xp)[((r / MR) * groups + k / 4) * MR + r % MR] = quad;
            }
        }
    else
        FOR_EACH_X(p, xp[XB_INDEX(r, k, groups, 4)] = (uint8_t)(x_s8(p, r, k) + 128));
    vnni_job job = {p, (const uint32_t *)xp, (const char *)yp, groups, panels, colsum};
    run_parallel(rows_s8, &job, Rp / MR, p->threads);
    free(xp);
    free(yp);
    free(colsum);
    return 0;
}

static const hcblas_kernels kernels = {"avx512bf16", gemm_bf16, gemm_s8};

const hcblas_kernels *hcblas_kernels_avx512bf16(void) { return &kernels; }
