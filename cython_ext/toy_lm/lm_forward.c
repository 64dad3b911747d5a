/* The speculative LM's forward pass in C over OpenBLAS (see lm_forward.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <cblas.h>
#include "lm_forward.h"

/* Up to this many rows one sgemv per row beats OpenBLAS's sgemm, which packs its operands on
 * every call (a draft step of 4 rows: 0.32 vs 0.49 ms; 8 rows: 0.61 vs 0.83 ms). */
#define GEMV_MAX_ROWS 8

/* y[t, n] = alpha x[t, k] @ W + beta y, with W = w[k, n] or, if w_transposed, w[n, k]^T;
 * ldx / ldw / ldy are row strides. */
static void matmul(const float *x, size_t ldx, size_t t, size_t k, const float *w, size_t ldw,
                   int w_transposed, size_t n, float alpha, float beta, float *y, size_t ldy) {
    if (t <= GEMV_MAX_ROWS) {
        for (size_t r = 0; r < t; r++) {
            if (w_transposed)
                scipy_cblas_sgemv(CblasRowMajor, CblasNoTrans, (blasint)n, (blasint)k, alpha, w,
                                  (blasint)ldw, x + r * ldx, 1, beta, y + r * ldy, 1);
            else
                scipy_cblas_sgemv(CblasRowMajor, CblasTrans, (blasint)k, (blasint)n, alpha, w,
                                  (blasint)ldw, x + r * ldx, 1, beta, y + r * ldy, 1);
        }
        return;
    }
    scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, w_transposed ? CblasTrans : CblasNoTrans,
                      (blasint)t, (blasint)n, (blasint)k, alpha, x, (blasint)ldx, w, (blasint)ldw,
                      beta, y, (blasint)ldy);
}

/* y[t, n] = bias in every row (a product then accumulates onto it). */
static void set_rows(float *y, size_t t, size_t n, const float *bias) {
    for (size_t r = 0; r < t; r++) memcpy(y + r * n, bias, n * sizeof(float));
}

static void add_bias(float *y, size_t t, size_t n, const float *bias) {
    for (size_t r = 0; r < t; r++)
        for (size_t j = 0; j < n; j++) y[r * n + j] += bias[j];
}

static void layer_norm(const float *x, size_t t, size_t d, const float *w, const float *b,
                       float *out) {
    for (size_t r = 0; r < t; r++) {
        const float *xr = x + r * d;
        float mean = 0.0f, var = 0.0f;
        for (size_t j = 0; j < d; j++) mean += xr[j];
        mean /= (float)d;
        for (size_t j = 0; j < d; j++) var += (xr[j] - mean) * (xr[j] - mean);
        const float inv = 1.0f / sqrtf(var / (float)d + 1e-5f);
        for (size_t j = 0; j < d; j++) out[r * d + j] = (xr[j] - mean) * inv * w[j] + b[j];
    }
}

static void gelu_tanh(float *x, size_t n) {
    const float c = 0.7978845608028654f;  /* sqrt(2 / pi) */
    for (size_t i = 0; i < n; i++) {
        const float v = x[i];
        x[i] = 0.5f * v * (1.0f + tanhf(c * (v + 0.044715f * v * v * v)));
    }
}

/* att[t, d] = softmax(q k^T / sqrt(Dh) + ALiBi, masked) v, head by head; scores is [t, s]. */
static void attention(const dspark_lm_model *m, const float *keys, const float *values,
                      const float *qkv, size_t qkv_n, size_t t, const uint8_t *mask, size_t s,
                      const int64_t *positions, const int64_t *key_positions, float *scores,
                      float *att) {
    const size_t h_n = m->n_head, dh = m->head_dim, d = m->d_model;
    const size_t k_stride = h_n * dh, v_stride = h_n * (dh + 1);
    const float scale = 1.0f / sqrtf((float)dh);
    for (size_t h = 0; h < h_n; h++) {
        const float *q = qkv + h * dh;
        const float *k = keys + h * dh;
        const float *v = values + h * (dh + 1);
        matmul(q, qkv_n, t, dh, k, k_stride, 1, s, scale, 0.0f, scores, s);  /* q k^T */
        const float slope = m->neg_slopes[h];
        for (size_t r = 0; r < t; r++) {
            float *row = scores + r * s;
            const uint8_t *visible = mask + r * s;
            float top = -INFINITY;
            for (size_t j = 0; j < s; j++) {
                row[j] = visible[j] ? row[j] + slope * (float)(positions[r] - key_positions[j])
                                    : -INFINITY;
                if (row[j] > top) top = row[j];
            }
            float sum = 0.0f;
            for (size_t j = 0; j < s; j++) {
                row[j] = visible[j] ? expf(row[j] - top) : 0.0f;
                sum += row[j];
            }
            const float inv = 1.0f / sum;
            for (size_t j = 0; j < s; j++) row[j] *= inv;
        }
        matmul(scores, s, t, s, v, v_stride, 0, dh, 1.0f, 0.0f, att + h * dh, d);
    }
}

int dspark_lm_forward(const dspark_lm_model *m, const dspark_lm_layer *layers,
                      float *const *keys, float *const *values, const int64_t *tokens,
                      const int64_t *positions, size_t t, const uint8_t *mask, size_t length,
                      const int64_t *key_positions, float *logits) {
    const size_t d = m->d_model, dh = m->head_dim, h_n = m->n_head, ff = m->ff;
    const size_t qkv_n = 2 * d + h_n * (dh + 1), s = length + t;
    float *buf = malloc(sizeof(float) * t * (3 * d + qkv_n + ff + s));
    if (!buf) return -1;
    float *x = buf, *a = x + t * d, *att = a + t * d, *qkv = att + t * d, *hid = qkv + t * qkv_n;
    float *scores = hid + t * ff;
    for (size_t r = 0; r < t; r++) memcpy(x + r * d, m->tok_emb + tokens[r] * d, d * sizeof(float));
    for (size_t i = 0; i < m->n_layer; i++) {
        const dspark_lm_layer *L = layers + i;
        layer_norm(x, t, d, L->ln1_w, L->ln1_b, a);
        set_rows(qkv, t, qkv_n, L->qkv_b);
        matmul(a, d, t, d, L->qkv_w, qkv_n, 0, qkv_n, 1.0f, 1.0f, qkv, qkv_n);
        for (size_t r = 0; r < t; r++) {
            memcpy(keys[i] + (length + r) * h_n * dh, qkv + r * qkv_n + d, d * sizeof(float));
            memcpy(values[i] + (length + r) * h_n * (dh + 1), qkv + r * qkv_n + 2 * d,
                   h_n * (dh + 1) * sizeof(float));
        }
        attention(m, keys[i], values[i], qkv, qkv_n, t, mask, s, positions, key_positions, scores, att);
        add_bias(x, t, d, L->proj_b);
        matmul(att, d, t, d, L->proj_w, d, 0, d, 1.0f, 1.0f, x, d);
        layer_norm(x, t, d, L->ln2_w, L->ln2_b, a);
        set_rows(hid, t, ff, L->fc_b);
        matmul(a, d, t, d, L->fc_w, ff, 0, ff, 1.0f, 1.0f, hid, ff);
        gelu_tanh(hid, t * ff);
        add_bias(x, t, d, L->fc_proj_b);
        matmul(hid, ff, t, ff, L->fc_proj_w, d, 0, d, 1.0f, 1.0f, x, d);
    }
    layer_norm(x, t, d, m->lnf_w, m->lnf_b, a);
    matmul(a, d, t, d, m->tok_emb_t, m->vocab, 0, m->vocab, 1.0f, 0.0f, logits, m->vocab);
    free(buf);
    return 0;
}
