/* Fused LayerNorm+GELU+MatMul driver over OpenBLAS (scipy-openblas32). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <cblas.h>
#include "fused_layer.h"
#include "dspark_probes.h"

DSPARK_PROBE_SEMAPHORE(fused_begin);
DSPARK_PROBE_SEMAPHORE(fused_end);

/* Up to this many rows, one sgemv per row beats sgemm: OpenBLAS's sgemm packs all of W on
 * every call, sgemv just streams it (measured 0.56 ms vs 1.9 ms at 1x768x3072). */
#define DSPARK_GEMV_MAX_ROWS 3

void dspark_fused_forward(const dspark_simd_kernels *k, const float *x, size_t rows, size_t d,
                          const float *gamma, const float *beta, float eps, int gelu_kind,
                          const float *w, size_t n, const float *bias, float *y,
                          float *scratch, size_t block_rows) {
    DSPARK_PROBE(fused_begin, rows, d, n, k->name, 0);
    for (size_t r0 = 0; r0 < rows; r0 += block_rows) {
        const size_t br = rows - r0 < block_rows ? rows - r0 : block_rows;
        k->ln_gelu_rows(x + r0 * d, d, br, d, gamma, beta, eps, gelu_kind, scratch, d);
        float *yb = y + r0 * n;
        if (bias)
            for (size_t r = 0; r < br; r++) memcpy(yb + r * n, bias, n * sizeof(float));
        if (br <= DSPARK_GEMV_MAX_ROWS) {
            for (size_t r = 0; r < br; r++)
                scipy_cblas_sgemv(CblasRowMajor, CblasTrans, (blasint)d, (blasint)n, 1.0f, w,
                                  (blasint)n, scratch + r * d, 1, bias ? 1.0f : 0.0f, yb + r * n, 1);
            continue;
        }
        scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (blasint)br, (blasint)n,
                          (blasint)d, 1.0f, scratch, (blasint)d, w, (blasint)n,
                          bias ? 1.0f : 0.0f, yb, (blasint)n);
    }
    DSPARK_PROBE(fused_end, rows, 0);
}

size_t dspark_packed_w_floats(size_t d, size_t n) {
    return d * ((n + DSPARK_NR - 1) / DSPARK_NR) * DSPARK_NR;
}

void dspark_pack_weights(const float *w, size_t d, size_t n, size_t kc, float *packed) {
    for (size_t pc = 0; pc < d; pc += kc) {
        const size_t kb = d - pc < kc ? d - pc : kc;
        for (size_t col = 0; col < n; col += DSPARK_NR) {
            const size_t nc = n - col < DSPARK_NR ? n - col : DSPARK_NR;
            for (size_t k = pc; k < pc + kb; k++, packed += DSPARK_NR) {
                memcpy(packed, w + k * n + col, nc * sizeof(float));
                memset(packed + nc, 0, (DSPARK_NR - nc) * sizeof(float));
            }
        }
    }
}

typedef struct {
    const dspark_simd_kernels *k;
    const float *x, *gamma, *beta, *mean, *rstd, *w_packed, *bias;
    float *y, *work;  /* work: mb * d packed A + mr * kc activation rows */
    size_t rows, d, n, kc, mc, nc_panels, mb, panel_begin, panel_end;
    int gelu_kind;
} packed_job;

/* One mc x (panels p0..p1) block: the panels of W (kc x DSPARK_NR each) stream through L1
 * while the block's packed rows stay in L2. */
static void packed_block(const packed_job *j, const float *a_block, size_t mc, size_t kc,
                         const float *w_block, size_t p0, size_t p1, float *y, int accumulate) {
    const dspark_simd_kernels *k = j->k;
    for (size_t p = p0; p < p1; p++) {
        const size_t col = p * DSPARK_NR;
        const size_t ncols = j->n - col < DSPARK_NR ? j->n - col : DSPARK_NR;
        const float *b = w_block + p * kc * DSPARK_NR;
        const float *bias = j->bias && !accumulate ? j->bias + col : NULL;
        if (mc == 1 && p + 4 <= p1 && col + 4 * DSPARK_NR <= j->n) {
            k->gemv_4panels(kc, a_block, b, kc * DSPARK_NR, y + col, accumulate, bias);
            p += 3;
            continue;
        }
        const float *a = a_block;
        for (size_t ir = 0; ir < mc; ir += k->mr) {
            const size_t m = mc - ir < k->mr ? mc - ir : k->mr;
            k->gemm_tile[m](kc, a, b, y + ir * j->n + col, j->n, ncols, accumulate, bias,
                            ir == 0 && p + 1 < p1 ? b + kc * DSPARK_NR : NULL);
            a += m * kc;
        }
    }
}

/* Goto/BLIS loop nest: mb rows at a time are activated and packed for every K block (W
 * streams from memory once per mb rows; LayerNorm+GELU run once per element); then nc_panels
 * panels of W at a time, with the K blocks inside, so the C block those panels produce stays
 * in cache across K blocks; per K block, kc x nc of W (L2) serves every mc block of rows (L2),
 * one kc x DSPARK_NR panel (L1) at a time. */
static void run_packed_job(const packed_job *j) {
    const size_t panels = (j->n + DSPARK_NR - 1) / DSPARK_NR;
    float *a_rows = j->work, *tmp = j->work + j->mb * j->d;
    for (size_t i0 = 0; i0 < j->rows; i0 += j->mb) {
        const size_t mb = j->rows - i0 < j->mb ? j->rows - i0 : j->mb;
        for (size_t pc = 0; pc < j->d; pc += j->kc) {  /* K block pc starts at a_rows + pc * mb */
            const size_t kc = j->d - pc < j->kc ? j->d - pc : j->kc;
            j->k->pack_ln_gelu(j->x + i0 * j->d + pc, j->d, mb, kc, j->mean + i0, j->rstd + i0,
                               j->gamma + pc, j->beta + pc, j->gelu_kind, a_rows + pc * mb, tmp);
        }
        for (size_t p0 = j->panel_begin; p0 < j->panel_end; p0 += j->nc_panels) {
            const size_t p1 = j->panel_end - p0 < j->nc_panels ? j->panel_end : p0 + j->nc_panels;
            for (size_t pc = 0; pc < j->d; pc += j->kc) {
                const size_t kc = j->d - pc < j->kc ? j->d - pc : j->kc;
                const float *w_block = j->w_packed + pc * panels * DSPARK_NR;
                for (size_t ic = 0; ic < mb; ic += j->mc) {
                    const size_t mc = mb - ic < j->mc ? mb - ic : j->mc;
                    packed_block(j, a_rows + pc * mb + ic * kc, mc, kc, w_block, p0, p1,
                                 j->y + (i0 + ic) * j->n, pc > 0);
                }
            }
        }
    }
}

static void *packed_job_thread(void *arg) {
    run_packed_job((const packed_job *)arg);
    return NULL;
}

#define DSPARK_MAX_THREADS 64
#define DSPARK_MAX_PACKED_A ((size_t)1 << 20) /* floats: 4 MiB of packed rows per thread */

int dspark_fused_forward_packed(const dspark_simd_kernels *k, const float *x, size_t rows,
                                size_t d, const float *gamma, const float *beta, float eps,
                                int gelu_kind, const float *w_packed, size_t n,
                                const float *bias_padded, float *y, size_t kc, size_t mc,
                                size_t nc, size_t mb, int threads) {
    DSPARK_PROBE(fused_begin, rows, d, n, k->name, 1);
    const size_t panels = (n + DSPARK_NR - 1) / DSPARK_NR;
    if (kc > d) kc = d;
    mc = (mc + k->mr - 1) / k->mr * k->mr;       /* micro-panel offsets need mr | mc */
    if (mb < mc) mb = mc;
    mb = mb / mc * mc;
    if (mb > rows) mb = (rows + k->mr - 1) / k->mr * k->mr;
    if (mb > mc && mb * d > DSPARK_MAX_PACKED_A) /* keep the packed rows L3-sized */
        mb = DSPARK_MAX_PACKED_A / d / mc * mc > mc ? DSPARK_MAX_PACKED_A / d / mc * mc : mc;
    size_t nc_panels = nc ? (nc + DSPARK_NR - 1) / DSPARK_NR : panels;
    size_t nt = threads < 1 ? 1 : (size_t)threads;
    if (nt > DSPARK_MAX_THREADS) nt = DSPARK_MAX_THREADS;
    if (nt > panels) nt = panels;
    const size_t work_floats = mb * d + k->mr * kc + 16; /* + 16: keep each thread's block 64-B apart */
    float *mem = NULL;
    if (posix_memalign((void **)&mem, 64, (2 * rows + nt * work_floats) * sizeof(float)) != 0)
        return -1;
    float *mean = mem + nt * work_floats, *rstd = mean + rows;
    k->row_stats(x, d, rows, d, eps, mean, rstd);

    packed_job jobs[DSPARK_MAX_THREADS];
    pthread_t tids[DSPARK_MAX_THREADS];
    size_t started = 0;
    int rc = 0;
    for (size_t t = 0; t < nt; t++) {
        jobs[t] = (packed_job){k, x, gamma, beta, mean, rstd, w_packed, bias_padded, y,
                               mem + t * work_floats, rows, d, n, kc, mc, nc_panels, mb,
                               panels * t / nt, panels * (t + 1) / nt, gelu_kind};
    }
    for (size_t t = 1; t < nt; t++) {
        if (pthread_create(&tids[t], NULL, packed_job_thread, &jobs[t]) != 0) {
            rc = -1;
            break;
        }
        started = t;
    }
    if (rc == 0) run_packed_job(&jobs[0]);
    for (size_t t = 1; t <= started; t++) pthread_join(tids[t], NULL);
    free(mem);
    DSPARK_PROBE(fused_end, rows, rc);
    return rc;
}

void dspark_blas_set_threads(int threads) { scipy_openblas_set_num_threads(threads); }
int dspark_blas_get_threads(void) { return scipy_openblas_get_num_threads(); }
const char *dspark_blas_corename(void) { return scipy_openblas_get_corename(); }
const char *dspark_blas_config(void) { return scipy_openblas_get_config(); }

void dspark_sgemm(const float *a, const float *b, float *c, size_t m, size_t k, size_t n) {
    scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (blasint)m, (blasint)n,
                      (blasint)k, 1.0f, a, (blasint)k, b, (blasint)n, 0.0f, c, (blasint)n);
}
