/* hcblas: cuBLAS's GemmEx contract under the names of the vendor BLAS libraries that copy it.
 *
 * One implementation (libhcblas.so, CPU: OpenBLAS for fp32/fp64, AMX or AVX512-BF16/VNNI kernels
 * for bf16 and int8 where the CPU has them, conversion to fp32/fp64 elsewhere) exported as
 *   hcblasGemmEx   cublasGemmEx   hipblasGemmEx   mcblasGemmEx   mublasGemmEx
 * with <prefix>Create / <prefix>Destroy, and CANN's aclblasGemmEx (no handle, row-major, stream
 * last). Code written against cuBLAS's GemmEx compiles against this header with the prefix
 * changed (cublas -> hcblas, CUBLAS_ -> HCBLAS_, CUDA_R_ -> HCBLAS_R_) or, for the cuBLAS
 * names themselves, with only the #include changed.
 *
 * The contract (cuBLAS): C = alpha * op(A) * op(B) + beta * C, column-major, op(A) m x k,
 * op(B) k x n, C m x n; lda >= max(1, transa == N ? m : k), ldb >= max(1, transb == N ? k : n),
 * ldc >= max(1, m); beta == 0 means C is not read. alpha and beta point to host scalars of the
 * compute type's scale type (half for COMPUTE_16F, int32 for COMPUTE_32I, double for
 * COMPUTE_64F, float otherwise). Every enum value is cuBLAS's, so the libraries' status codes
 * and constants mean the same thing. Supported (A, B, C, compute) combinations are cuBLAS's
 * GemmEx table for real types; others return <PREFIX>_STATUS_NOT_SUPPORTED.
 */
#ifndef HCBLAS_H
#define HCBLAS_H

#ifdef __cplusplus
extern "C" {
#endif

struct hcblasContext; /* opaque; one handle type behind every vendor's name */

#define HCBLAS_DECLARE_VENDOR(p, P, D)                                                           \
    typedef struct hcblasContext *p##Handle_t;                                                   \
    typedef enum {                                                                               \
        P##_STATUS_SUCCESS = 0, P##_STATUS_NOT_INITIALIZED = 1, P##_STATUS_ALLOC_FAILED = 3,      \
        P##_STATUS_INVALID_VALUE = 7, P##_STATUS_ARCH_MISMATCH = 8, P##_STATUS_MAPPING_ERROR = 11, \
        P##_STATUS_EXECUTION_FAILED = 13, P##_STATUS_INTERNAL_ERROR = 14,                        \
        P##_STATUS_NOT_SUPPORTED = 15                                                            \
    } p##Status_t;                                                                               \
    typedef enum { P##_OP_N = 0, P##_OP_T = 1, P##_OP_C = 2 } p##Operation_t;                    \
    typedef enum {                                                                               \
        D##_R_32F = 0, D##_R_64F = 1, D##_R_16F = 2, D##_R_8I = 3, D##_R_32I = 10, D##_R_16BF = 14 \
    } p##Datatype_t;                                                                             \
    typedef enum {                                                                               \
        P##_COMPUTE_16F = 64, P##_COMPUTE_16F_PEDANTIC = 65, P##_COMPUTE_32F = 68,               \
        P##_COMPUTE_32F_PEDANTIC = 69, P##_COMPUTE_32F_FAST_16F = 74,                            \
        P##_COMPUTE_32F_FAST_16BF = 75, P##_COMPUTE_32F_FAST_TF32 = 77, P##_COMPUTE_64F = 70,    \
        P##_COMPUTE_64F_PEDANTIC = 71, P##_COMPUTE_32I = 72, P##_COMPUTE_32I_PEDANTIC = 73       \
    } p##ComputeType_t;                                                                          \
    typedef enum {                                                                               \
        P##_GEMM_DEFAULT = -1, P##_GEMM_ALGO0 = 0, P##_GEMM_ALGO23 = 23,                         \
        P##_GEMM_DEFAULT_TENSOR_OP = 99, P##_GEMM_DFALT_TENSOR_OP = 99,                          \
        P##_GEMM_ALGO0_TENSOR_OP = 100, P##_GEMM_ALGO15_TENSOR_OP = 115                          \
    } p##GemmAlgo_t;                                                                             \
    p##Status_t p##Create(p##Handle_t *handle);                                                  \
    p##Status_t p##Destroy(p##Handle_t handle);                                                  \
    p##Status_t p##GemmEx(p##Handle_t handle, p##Operation_t transa, p##Operation_t transb,      \
                          int m, int n, int k, const void *alpha,                                \
                          const void *A, p##Datatype_t Atype, int lda,                           \
                          const void *B, p##Datatype_t Btype, int ldb, const void *beta,         \
                          void *C, p##Datatype_t Ctype, int ldc,                                 \
                          p##ComputeType_t computeType, p##GemmAlgo_t algo);

HCBLAS_DECLARE_VENDOR(hcblas, HCBLAS, HCBLAS)  /* the library's own name */
HCBLAS_DECLARE_VENDOR(cublas, CUBLAS, CUDA)    /* NVIDIA cuBLAS */
HCBLAS_DECLARE_VENDOR(hipblas, HIPBLAS, HIP)   /* AMD hipBLAS */
HCBLAS_DECLARE_VENDOR(mcblas, MCBLAS, MACA)    /* MetaX mcBLAS (MACA) */
HCBLAS_DECLARE_VENDOR(mublas, MUBLAS, MUSA)    /* Moore Threads muBLAS (MUSA) */

/* The runtimes' own names for the data-type enum. */
typedef cublasDatatype_t cudaDataType_t;
typedef cublasDatatype_t cudaDataType;
typedef hipblasDatatype_t hipDataType;
typedef mcblasDatatype_t macaDataType;
typedef mublasDatatype_t musaDataType;

/* cuBLAS's v2 header maps cublasCreate/cublasDestroy to these symbols; both are exported. */
cublasStatus_t cublasCreate_v2(cublasHandle_t *handle);
cublasStatus_t cublasDestroy_v2(cublasHandle_t handle);

/* Huawei CANN (Ascend): row-major, no handle, a transC flag and the stream last. lda/ldb/ldc
 * of -1 mean dense rows (CANN's documented value); others are checked as leading dimensions.
 * Supported (A, B, C): (16F, 16F, 16F), (16F, 16F, 32F), (8I, 8I, 32F), (8I, 8I, 32I), plus
 * (32F, 32F, 32F) and bf16 inputs; alpha/beta have C's type (two bytes for 16F and BF16). */
typedef int aclError;
typedef void *aclrtStream;
typedef enum { ACL_TRANS_N = 0, ACL_TRANS_T = 1, ACL_TRANS_NZ = 2, ACL_TRANS_NZ_T = 3 } aclTransType;
typedef enum { ACL_FLOAT = 0, ACL_FLOAT16 = 1, ACL_INT8 = 2, ACL_INT32 = 3, ACL_BF16 = 27 } aclDataType;
typedef enum { ACL_COMPUTE_HIGH_PRECISION = 0, ACL_COMPUTE_LOW_PRECISION = 1 } aclComputeType;
#define ACL_SUCCESS 0
#define ACL_ERROR_INVALID_PARAM 100000
aclError aclblasGemmEx(aclTransType transA, aclTransType transB, aclTransType transC, int m, int n, int k,
                       const void *alpha, const void *matrixA, int lda, aclDataType dataTypeA,
                       const void *matrixB, int ldb, aclDataType dataTypeB, const void *beta,
                       void *matrixC, int ldc, aclDataType dataTypeC, aclComputeType type,
                       aclrtStream stream);

/* dspark's own entry points (the Python binding uses them). */
/* The name of the CPU kernel path the next call uses ("amx", "avx512bf16", "convert"), or NULL
 * with a sentence in err when the DSPARK_GEMM_SIMD override names an unknown/unrunnable path. */
const char *hcblasKernelPath(char *err, int err_len);
/* The paths compiled in and those this CPU+OS runs, comma separated. */
const char *hcblasCompiledPaths(void);
const char *hcblasSupportedPaths(void);
/* The last call's status explained in one sentence (per thread). */
const char *hcblasLastError(void);
/* Validate a GemmEx call without running it: the status the call would return. */
int hcblasGemmExCheck(const void *handle, int transa, int transb, int m, int n, int k,
                      const void *alpha, int Atype, int lda, int Btype, int ldb, const void *beta,
                      int Ctype, int ldc, int computeType, int algo);

#ifdef __cplusplus
}
#endif
#endif
