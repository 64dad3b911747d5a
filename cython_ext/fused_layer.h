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

void dspark_blas_set_threads(int threads);
int dspark_blas_get_threads(void);
const char *dspark_blas_corename(void);
const char *dspark_blas_config(void);
/* C[m, n] = A[m, k] @ B[k, n], the same sgemm as the fused layer (for peak measurements). */
void dspark_sgemm(const float *a, const float *b, float *c, size_t m, size_t k, size_t n);
#endif
