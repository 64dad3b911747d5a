/* A C program written against cuBLAS's GemmEx (as if for an NVIDIA GPU, host memory aside).
 * tests/unit/runtimes/test_accel_gemm.py compiles it against libhcblas with the include line changed and,
 * for the other vendors, the prefix changed (cublas -> hipblas, CUBLAS_ -> HIPBLAS_, CUDA_ -> HIP_). */
#include <cublas_v2.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint16_t to_bf16(float f) { /* truncation is enough for test data */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}
static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

int main(void) {
    enum { M = 37, N = 29, K = 45, LDA = 50, LDB = 48, LDC = 40 }; /* A is K x M (op(A) = A^T), B is K x N */
    cublasHandle_t handle;
    if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) return 10;
    float *A = calloc(LDA * M, 4), *B = calloc(LDB * N, 4), *C = calloc(LDC * N, 4);
    uint16_t *Ab = calloc(LDA * M, 2), *Bb = calloc(LDB * N, 2);
    int8_t *Ai = calloc(LDA * M, 1), *Bi = calloc(LDB * N, 1);
    int32_t *Ci = calloc(LDC * N, 4);
    float *Cb = calloc(LDC * N, 4);
    srand(7);
    for (int i = 0; i < LDA * M; i++) { A[i] = (float)(rand() % 17 - 8) / 8; Ab[i] = to_bf16(A[i]); Ai[i] = (int8_t)(rand() % 255 - 127); }
    for (int i = 0; i < LDB * N; i++) { B[i] = (float)(rand() % 17 - 8) / 8; Bb[i] = to_bf16(B[i]); Bi[i] = (int8_t)(rand() % 255 - 127); }
    for (int i = 0; i < LDC * N; i++) { C[i] = 1.0f; Cb[i] = 1.0f; Ci[i] = 3; }
    const float alpha = 1.5f, beta = 0.5f;
    const int32_t ialpha = 2, ibeta = -1;
    /* C = alpha * A^T * B + beta * C, op(A) = A^T (M x K), op(B) = B (K x N) */
    cublasStatus_t s1 = cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, M, N, K, &alpha, A, CUDA_R_32F, LDA, B, CUDA_R_32F,
                                     LDB, &beta, C, CUDA_R_32F, LDC, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cublasStatus_t s2 = cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, M, N, K, &alpha, Ab, CUDA_R_16BF, LDA, Bb,
                                     CUDA_R_16BF, LDB, &beta, Cb, CUDA_R_32F, LDC, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cublasStatus_t s3 = cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, M, N, K, &ialpha, Ai, CUDA_R_8I, LDA, Bi,
                                     CUDA_R_8I, LDB, &ibeta, Ci, CUDA_R_32I, LDC, CUBLAS_COMPUTE_32I, CUBLAS_GEMM_DEFAULT);
    /* lda smaller than op(A)'s stored rows (K): the invalid-value status, C untouched */
    cublasStatus_t bad = cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, M, N, K, &alpha, A, CUDA_R_32F, K - 1, B,
                                      CUDA_R_32F, LDB, &beta, C, CUDA_R_32F, LDC, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s1 != CUBLAS_STATUS_SUCCESS || s2 != CUBLAS_STATUS_SUCCESS || s3 != CUBLAS_STATUS_SUCCESS) {
        printf("status %d %d %d\n", s1, s2, s3);
        return 1;
    }
    if (bad != CUBLAS_STATUS_INVALID_VALUE) {
        printf("lda < K gave status %d, expected %d\n", bad, CUBLAS_STATUS_INVALID_VALUE);
        return 2;
    }
    double worst = 0, worst_bf16 = 0;
    long int_errors = 0;
    for (int j = 0; j < N; j++)
        for (int i = 0; i < M; i++) {
            double ref = 0, ref_bf16 = 0;
            long ref_int = 0;
            for (int p = 0; p < K; p++) {
                ref += (double)A[i * LDA + p] * B[j * LDB + p];
                ref_bf16 += (double)from_bf16(Ab[i * LDA + p]) * from_bf16(Bb[j * LDB + p]);
                ref_int += (long)Ai[i * LDA + p] * Bi[j * LDB + p];
            }
            worst = fmax(worst, fabs(C[j * LDC + i] - (alpha * ref + beta * 1.0)));
            worst_bf16 = fmax(worst_bf16, fabs(Cb[j * LDC + i] - (alpha * ref_bf16 + beta * 1.0)));
            int_errors += Ci[j * LDC + i] != (int32_t)(ialpha * ref_int + ibeta * 3);
        }
    for (int j = 0; j < N; j++) /* rows M..LDC-1 of C are padding: untouched */
        for (int i = M; i < LDC; i++) int_errors += C[j * LDC + i] != 1.0f || Ci[j * LDC + i] != 3;
    cublasDestroy(handle);
    printf("fp32 max error %.3g, bf16 max error %.3g, int8 mismatches %ld\n", worst, worst_bf16, int_errors);
    return worst < 1e-4 && worst_bf16 < 1e-4 && int_errors == 0 ? 0 : 3;
}
