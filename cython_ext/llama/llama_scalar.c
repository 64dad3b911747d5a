/* Scalar llama kernels: the reference semantics (see llama_kernels.h) in plain C, compiled
 * without vectorisation; the AVX2 and AVX-512 paths reproduce these results bit for bit. */
#include <math.h>
#include <string.h>
#include "llama_kernels.h"

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return llama_half_to_float(h);
}

/* K-quant super-blocks: the sub-block formulas of llama_kernels.h. */
static void matmul_k(const llama_matrix *w, size_t tile0, size_t tile1, const llama_qact *a,
                     size_t rows, float *out, size_t ldo) {
    const int fmt = w->fmt;
    const size_t nsb = w->k / LLAMA_QK_K, bb = llama_block_bytes(fmt), sb = llama_ksub_bytes(fmt);
    const size_t fb = llama_kfield_bytes(fmt), kb = w->k / LLAMA_QK;
    for (size_t t = tile0; t < tile1; t++) {
        const uint8_t *tile = w->data + t * nsb * bb;
        for (size_t r = 0; r < rows; r++) {
            for (int c = 0; c < LLAMA_TILE; c++) {
                float acc = 0.0f;
                for (size_t B = 0; B < nsb; B++) {
                    const uint8_t *f = tile + B * bb, *blk = f + fb;
                    for (int s = 0; s < LLAMA_KSUB; s++) {
                        const size_t b = B * LLAMA_KSUB + s, ab = r * kb + b;
                        const int8_t *x = a->q + r * a->k + b * LLAMA_QK;
                        int32_t lo = 0, hi = 0;
                        for (int k = 0; k < 16; k++) lo += llama_quant_at(blk + s * sb, fmt, c, k) * x[k];
                        for (int k = 16; k < 32; k++) hi += llama_quant_at(blk + s * sb, fmt, c, k) * x[k];
                        if (fmt == LLAMA_Q6_K) {
                            const int8_t *sc = (const int8_t *)f + 32 * s + c;
                            const int32_t isum = sc[0] * (lo - 32 * a->sum_lo[ab]) +
                                                 sc[16] * (hi - 32 * (a->sum[ab] - a->sum_lo[ab]));
                            acc = fmaf((float)isum, h2f(f + 256 + 2 * c) * a->d[ab], acc);
                        } else {
                            const float dsc = h2f(f + 256 + 2 * c) * (float)f[16 * s + c];
                            const float dm = h2f(f + 288 + 2 * c) * (float)f[128 + 16 * s + c];
                            acc = fmaf((float)(lo + hi), dsc * a->d[ab], acc);
                            acc = fmaf(-dm, a->s[ab], acc);
                        }
                    }
                }
                out[r * ldo + t * LLAMA_TILE + c] = acc;
            }
        }
    }
}

static void matmul(const llama_matrix *w, size_t tile0, size_t tile1, const llama_qact *a,
                   size_t rows, float *out, size_t ldo) {
    if (llama_is_k(w->fmt)) {
        matmul_k(w, tile0, tile1, a, rows, out, ldo);
        return;
    }
    const size_t kb = w->k / LLAMA_QK, bb = llama_block_bytes(w->fmt);
    const size_t so = llama_scale_offset(w->fmt);
    const int zero = llama_zero_point(w->fmt), fmt = w->fmt;
    const int has_m = llama_has_m(w->fmt);
    for (size_t t = tile0; t < tile1; t++) {
        const uint8_t *tile = w->data + t * kb * bb;
        for (size_t r = 0; r < rows; r++) {
            for (int c = 0; c < LLAMA_TILE; c++) {
                float acc = 0.0f;
                for (size_t b = 0; b < kb; b++) {
                    const uint8_t *blk = tile + b * bb;
                    const int8_t *x = a->q + r * a->k + b * LLAMA_QK;
                    int32_t isum = 0;
                    for (int k = 0; k < LLAMA_QK; k++) isum += llama_quant_at(blk, fmt, c, k) * x[k];
                    isum -= zero * a->sum[r * kb + b];
                    acc = fmaf((float)isum, h2f(blk + so + 2 * c) * a->d[r * kb + b], acc);
                    if (has_m) acc = fmaf(h2f(blk + so + 32 + 2 * c), a->s[r * kb + b], acc);
                }
                out[r * ldo + t * LLAMA_TILE + c] = acc;
            }
        }
    }
}

static void quantize(const float *x, size_t ldx, size_t rows, llama_qact *a) {
    for (size_t r = 0; r < rows; r++) {
        for (size_t b = 0; b < a->kb; b++) {
            const float *xb = x + r * ldx + b * LLAMA_QK;
            float amax = 0.0f;
            for (int k = 0; k < LLAMA_QK; k++) amax = fmaxf(amax, fabsf(xb[k]));
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int8_t *q = a->q + r * a->k + b * LLAMA_QK;
            int32_t sum = 0, sum_lo = 0;
            for (int k = 0; k < LLAMA_QK; k++) {
                q[k] = (int8_t)(int)rintf(xb[k] * id);
                sum += q[k];
                if (k == 15) sum_lo = sum;
            }
            a->d[r * a->kb + b] = d;
            a->sum[r * a->kb + b] = sum;
            a->sum_lo[r * a->kb + b] = sum_lo;
            a->s[r * a->kb + b] = d * (float)sum;
        }
    }
}

static float fold16(float *acc) {
    for (int width = 8; width >= 1; width /= 2)
        for (int l = 0; l < width; l++) acc[l] += acc[l + width];
    return acc[0];
}

static float sum_squares(const float *x, size_t n) {
    float acc[16] = {0};
    for (size_t i = 0; i < n; i++) acc[i % 16] = fmaf(x[i], x[i], acc[i % 16]);
    return fold16(acc);
}

static inline float exp2i(float n) {
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return scale;
}

#define VF float
#define vset1(v) (v)
#define vmin fminf
#define vmax fmaxf
#define vmul(a, b) ((a) * (b))
#define vadd(a, b) ((a) + (b))
#define vfmadd fmaf
#define vround rintf
#define vexp2i exp2i
#include "llama_exp.inc"

static void swiglu(const float *gate, const float *up, size_t n, float *out) {
    for (size_t i = 0; i < n; i++)
        out[i] = gate[i] / (1.0f + exp_canonical(-gate[i])) * up[i];
}

static void scores(const float *const *q, size_t nq, size_t hd, const uint16_t *kt, size_t n,
                   float *s, size_t ls) {
    for (size_t h = 0; h < nq; h++)
        for (size_t j = 0; j < n; j++) {
            const uint16_t *kj = kt + (j / 16) * hd * 16 + j % 16;
            float acc = 0.0f;
            for (size_t d = 0; d < hd; d++)
                acc = fmaf(q[h][d], llama_half_to_float(kj[d * 16]), acc);
            s[h * ls + j] = acc;
        }
}

static float softmax(float *p, size_t n) {
    float mx = -INFINITY, acc[16] = {0};
    for (size_t i = 0; i < n; i++) mx = fmaxf(mx, p[i]);
    for (size_t i = 0; i < n; i++) {
        p[i] = exp_canonical(p[i] - mx);
        acc[i % 16] += p[i];
    }
    return fold16(acc);
}

static void values(const float *p, size_t lp, size_t nq, const float *scale, size_t hd,
                   const uint16_t *v, const int32_t *idx, size_t n, float *out) {
    for (size_t h = 0; h < nq; h++)
        for (size_t d = 0; d < hd; d++) {
            float acc = 0.0f;
            for (size_t c = 0; c < n; c++)
                acc = fmaf(p[h * lp + c], llama_half_to_float(v[(size_t)idx[c] * hd + d]), acc);
            out[h * hd + d] = acc * scale[h];
        }
}

static const llama_kernels kernels = {
    "scalar", matmul, quantize, sum_squares, swiglu, scores, softmax, values,
};

const llama_kernels *llama_kernels_scalar(void) { return &kernels; }
