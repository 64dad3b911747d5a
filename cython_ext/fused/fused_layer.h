#ifndef DSPARK_FUSED_LAYER_H
#define DSPARK_FUSED_LAYER_H
#include <stddef.h>
#include "dspark_simd.h"

/* y[rows, n] = GELU(LayerNorm(x[rows, d]; gamma, beta)) @ w[d, n] + bias[n]
 * LayerNorm+GELU run one row block at a time into scratch[block_rows, d]
 * (sized to stay in cache), which feeds the sgemm directly. bias may be NULL. */
void dspark_fused_forward(const dspark_simd_kernels *k, const float *x, size_t rows, size_t d,
                          const float *gamma, const float *beta, float eps, int gelu_kind,
                          const float *w, size_t n, const float *bias, float *y,
                          float *scratch, size_t block_rows);

/* Packed path: W[d, n] packed once, K block by K block (kc rows each, the last shorter), each
 * block as ceil(n / DSPARK_NR) column panels of kc x DSPARK_NR floats (zero-padded past n),
 * so the panels one K block needs are one contiguous stream. */
size_t dspark_packed_w_floats(size_t d, size_t n);
void dspark_pack_weights(const float *w, size_t d, size_t n, size_t kc, float *packed);

/* y[rows, n] = GELU(LayerNorm(x)) @ W + bias over the packed W, blocked like a Goto/BLIS GEMM:
 * mb rows at a time are activated and packed per K block of kc (LayerNorm+GELU run while
 * packing, each element once per thread); then nc columns of W at a time (kc x nc, meant for
 * L2), mc rows at a time (meant for L2), one kc x DSPARK_NR panel at a time (L1). kc must be
 * the one W was packed with; nc = 0 means all columns. bias_padded (n rounded up to
 * DSPARK_NR, or NULL) is added in the epilogue. threads > 1 splits the panels of W across
 * that many threads. Returns 0, or -1 when memory or a thread could not be had. */
int dspark_fused_forward_packed(const dspark_simd_kernels *k, const float *x, size_t rows,
                                size_t d, const float *gamma, const float *beta, float eps,
                                int gelu_kind, const float *w_packed, size_t n,
                                const float *bias_padded, float *y, size_t kc, size_t mc,
                                size_t nc, size_t mb, int threads);

void dspark_blas_set_threads(int threads);
int dspark_blas_get_threads(void);
const char *dspark_blas_corename(void);
const char *dspark_blas_config(void);
/* C[m, n] = A[m, k] @ B[k, n], the same sgemm as the fused layer (for peak measurements). */
void dspark_sgemm(const float *a, const float *b, float *c, size_t m, size_t k, size_t n);
#endif
