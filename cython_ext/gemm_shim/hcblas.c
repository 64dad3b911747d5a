/* libhcblas: one implementation of cuBLAS's GemmEx contract (see hcblas.h) exported under every
 * vendor's name. This unit holds the contract: argument checks with cuBLAS's status codes, the
 * type table, the dispatch to a kernel path, the convert path (OpenBLAS), the epilogue (alpha,
 * beta, C's type) and the vendor entry points. The bf16/int8 kernels live in per-ISA units. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cblas.h>
#include "cpu_features.h"
#include "hcblas.h"
#include "hcblas_kernels.h"
#include "isa_dispatch.h"
#include "dspark_probes.h"

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

enum { ST_SUCCESS = 0, ST_NOT_INITIALIZED = 1, ST_ALLOC_FAILED = 3, ST_INVALID_VALUE = 7, ST_NOT_SUPPORTED = 15 };
enum { T_32F = 0, T_64F = 1, T_16F = 2, T_8I = 3, T_32I = 10, T_16BF = 14 };
enum {
    C_16F = 64, C_16F_PEDANTIC = 65, C_32F = 68, C_32F_PEDANTIC = 69, C_64F = 70, C_64F_PEDANTIC = 71,
    C_32I = 72, C_32I_PEDANTIC = 73, C_32F_FAST_16F = 74, C_32F_FAST_16BF = 75, C_32F_FAST_TF32 = 77
};
#define CONTEXT_MAGIC 0x68636273u /* "hcbs" */

struct hcblasContext {
    unsigned magic;
};

static __thread char last_error[320] = "no error";

static int fail(int status, const char *format, ...) __attribute__((format(printf, 2, 3)));
static int fail(int status, const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(last_error, sizeof last_error, format, args);
    va_end(args);
    return status;
}

const char *hcblasLastError(void) { return last_error; }

/* --- kernel paths: compiled, supported by this CPU+OS, chosen (DSPARK_GEMM_SIMD) ------------- */
static const char *const path_names[HCBLAS_PATH_COUNT] = {"convert", "avx512bf16", "amx"};

static int amx_permitted(void) {
#if defined(__linux__) && defined(__x86_64__)
    static int permitted = -1;
    if (permitted < 0) /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: once per process */
        permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return permitted;
#else
    return 0;
#endif
}

static int path_runs(int path) {
    if (path == HCBLAS_PATH_CONVERT) return 1;
#if HCBLAS_HAVE_X86_TUS
    dspark_cpu_features f = dspark_detect_cpu_features();
    if (path == HCBLAS_PATH_AVX512BF16)
        return f.avx512f && f.avx512bw && f.avx512bf16 && f.avx512vnni && f.os_avx512;
    if (path == HCBLAS_PATH_AMX)
        return f.amx_tile && f.amx_bf16 && f.amx_int8 && f.os_amx && amx_permitted();
#endif
    return 0;
}

static int path_compiled(int path) { return path == HCBLAS_PATH_CONVERT || HCBLAS_HAVE_X86_TUS; }

/* The GemmEx family of the common dispatcher (isa_dispatch.h). DSPARK_GEMM_SIMD is read on every
 * call, like DSPARK_SIMD for the fused kernel, so tests can force each path. */
static const dspark_isa_family gemm_paths = {"GemmEx", "DSPARK_GEMM_SIMD", HCBLAS_PATH_COUNT, path_names,
                                             path_compiled, path_runs};

static const hcblas_kernels *path_kernels(int path) {
#if HCBLAS_HAVE_X86_TUS
    if (path == HCBLAS_PATH_AMX) return hcblas_kernels_amx();
    if (path == HCBLAS_PATH_AVX512BF16) return hcblas_kernels_avx512bf16();
#endif
    (void)path;
    return NULL;
}

const char *hcblasKernelPath(char *err, int err_len) {
    int path = dspark_path_select(&gemm_paths, err, err_len > 0 ? (size_t)err_len : 0);
    return path < 0 ? NULL : path_names[path];
}

static __thread char path_text[64];
const char *hcblasCompiledPaths(void) { return dspark_path_list(&gemm_paths, 0, path_text, sizeof path_text); }
const char *hcblasSupportedPaths(void) { return dspark_path_list(&gemm_paths, 1, path_text, sizeof path_text); }

/* --- element conversions ---------------------------------------------------------------------- */
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exponent == 0x1f) {
        v.u = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        v.u = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {
        v.f = ldexpf((float)mantissa, -24);
        v.u |= sign;
    }
    return v.f;
}

static uint16_t float_to_half(float f) { /* round to nearest even */
    union { float f; uint32_t u; } v = {f};
    uint32_t sign = (v.u >> 16) & 0x8000u, magnitude = v.u & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (magnitude >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past 65504 */
    if (magnitude < 0x38800000u) {                                     /* subnormal or zero */
        float scaled = fabsf(f) * 16777216.0f;                          /* units of 2^-24 */
        return (uint16_t)(sign | (uint16_t)nearbyintf(scaled));
    }
    uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
    return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
}

static double load_element(const void *base, int type, size_t index) {
    switch (type) {
    case T_32F: return ((const float *)base)[index];
    case T_64F: return ((const double *)base)[index];
    case T_16F: return half_to_float(((const uint16_t *)base)[index]);
    case T_16BF: return hcblas_bf16_to_f32(((const uint16_t *)base)[index]);
    case T_8I: return ((const int8_t *)base)[index];
    default: return ((const int32_t *)base)[index];
    }
}

static void store_element(void *base, int type, size_t index, double value) {
    switch (type) {
    case T_32F: ((float *)base)[index] = (float)value; break;
    case T_64F: ((double *)base)[index] = value; break;
    case T_16F: ((uint16_t *)base)[index] = float_to_half((float)value); break;
    case T_16BF: ((uint16_t *)base)[index] = hcblas_f32_to_bf16((float)value); break;
    default: ((int32_t *)base)[index] = (int32_t)value; break;
    }
}

/* --- the epilogue: C = alpha * acc + beta * C in C's type (beta == 0: C not read) ------------ */
typedef struct {
    char *c;
    int ctype, acc_int;
    size_t ldc, R, S; /* D (R x S) = C^T */
    float alpha, beta;
    int32_t ialpha, ibeta;
} epilogue_ctx;

static void epilogue(void *ctx_, size_t r0, size_t s0, size_t rows, size_t cols, const void *acc, size_t acc_ld) {
    const epilogue_ctx *e = ctx_;
    if (r0 >= e->R || s0 >= e->S) return;
    rows = rows < e->R - r0 ? rows : e->R - r0;
    cols = cols < e->S - s0 ? cols : e->S - s0;
    for (size_t i = 0; i < rows; i++) {
        size_t base = (r0 + i) * e->ldc + s0;
        if (e->acc_int && e->ctype == T_32I) { /* int32 arithmetic, wrapping like the GPU's */
            const int32_t *a = (const int32_t *)acc + i * acc_ld;
            uint32_t *c = (uint32_t *)e->c + base;
            for (size_t j = 0; j < cols; j++)
                c[j] = (uint32_t)e->ialpha * (uint32_t)a[j] + (e->ibeta ? (uint32_t)e->ibeta * c[j] : 0u);
        } else if (!e->acc_int && e->ctype == T_32F) {
            const float *a = (const float *)acc + i * acc_ld;
            float *c = (float *)e->c + base;
            if (e->beta == 0.0f)
                for (size_t j = 0; j < cols; j++) c[j] = e->alpha * a[j];
            else
                for (size_t j = 0; j < cols; j++) c[j] = e->alpha * a[j] + e->beta * c[j];
        } else {
            for (size_t j = 0; j < cols; j++) {
                double a = e->acc_int ? (double)((const int32_t *)acc)[i * acc_ld + j]
                                      : (double)((const float *)acc)[i * acc_ld + j];
                float value = e->alpha * (float)a;
                if (e->beta != 0.0f) value += e->beta * (float)load_element(e->c, e->ctype, base + j);
                store_element(e->c, e->ctype, base + j, value);
            }
        }
    }
}

/* alpha == 0: C = beta * C without reading A or B (BLAS's rule, so NaN or Inf there stays out of
 * C in every type); the epilogue over a zero accumulator does exactly that. */
static int scale_c(epilogue_ctx *e) {
    int32_t *zeros = calloc(e->S ? e->S : 1, sizeof(int32_t)); /* 0 as int32 and as float */
    if (!zeros) return fail(ST_ALLOC_FAILED, "out of memory");
    e->acc_int = e->ctype == T_32I;
    epilogue(e, 0, 0, e->R, e->S, zeros, 0);
    free(zeros);
    return ST_SUCCESS;
}

/* --- checks -------------------------------------------------------------------------------- */
static const char *type_name(int type) {
    switch (type) {
    case T_32F: return "R_32F";
    case T_64F: return "R_64F";
    case T_16F: return "R_16F";
    case T_16BF: return "R_16BF";
    case T_8I: return "R_8I";
    case T_32I: return "R_32I";
    default: return "unknown";
    }
}

/* cuBLAS's GemmEx table for real types: which (A, B, C) a compute type takes. */
static int combination_supported(int compute, int at, int bt, int ct) {
    if (at != bt) return 0;
    switch (compute) {
    case C_16F: case C_16F_PEDANTIC: return at == T_16F && ct == T_16F;
    case C_32F: case C_32F_PEDANTIC:
        return (at == T_32F && ct == T_32F) || ((at == T_16F || at == T_16BF) && (ct == at || ct == T_32F)) ||
               (at == T_8I && ct == T_32F);
    case C_32F_FAST_16F: case C_32F_FAST_16BF: case C_32F_FAST_TF32: return at == T_32F && ct == T_32F;
    case C_64F: case C_64F_PEDANTIC: return at == T_64F && ct == T_64F;
    case C_32I: case C_32I_PEDANTIC: return at == T_8I && ct == T_32I;
    default: return 0;
    }
}

static int known_compute(int c) {
    return (c >= C_16F && c <= C_32I_PEDANTIC) || c == C_32F_FAST_16F || c == C_32F_FAST_16BF || c == C_32F_FAST_TF32;
}
static int known_type(int t) {
    return t == T_32F || t == T_64F || t == T_16F || t == T_16BF || t == T_8I || t == T_32I;
}

int hcblasGemmExCheck(const void *handle, int transa, int transb, int m, int n, int k, const void *alpha, int Atype,
                      int lda, int Btype, int ldb, const void *beta, int Ctype, int ldc, int computeType, int algo) {
    const struct hcblasContext *context = handle;
    if (!context || context->magic != CONTEXT_MAGIC)
        return fail(ST_NOT_INITIALIZED, "handle: NULL or not made by Create (or already destroyed)");
    if (transa < 0 || transa > 2) return fail(ST_INVALID_VALUE, "transa=%d: expected OP_N, OP_T or OP_C", transa);
    if (transb < 0 || transb > 2) return fail(ST_INVALID_VALUE, "transb=%d: expected OP_N, OP_T or OP_C", transb);
    if (m < 0) return fail(ST_INVALID_VALUE, "m=%d: must be >= 0", m);
    if (n < 0) return fail(ST_INVALID_VALUE, "n=%d: must be >= 0", n);
    if (k < 0) return fail(ST_INVALID_VALUE, "k=%d: must be >= 0", k);
    int a_rows = transa == 0 ? m : k, b_rows = transb == 0 ? k : n;
    if (lda < (a_rows > 1 ? a_rows : 1))
        return fail(ST_INVALID_VALUE, "lda=%d: must be >= max(1, %s)=%d", lda, transa == 0 ? "m" : "k",
                    a_rows > 1 ? a_rows : 1);
    if (ldb < (b_rows > 1 ? b_rows : 1))
        return fail(ST_INVALID_VALUE, "ldb=%d: must be >= max(1, %s)=%d", ldb, transb == 0 ? "k" : "n",
                    b_rows > 1 ? b_rows : 1);
    if (ldc < (m > 1 ? m : 1)) return fail(ST_INVALID_VALUE, "ldc=%d: must be >= max(1, m)=%d", ldc, m > 1 ? m : 1);
    if (!((algo >= -1 && algo <= 23) || (algo >= 99 && algo <= 115)))
        return fail(ST_INVALID_VALUE, "algo=%d: expected GEMM_DEFAULT (-1), ALGO0..23 or the TENSOR_OP values 99..115",
                    algo);
    if (!alpha || !beta) return fail(ST_INVALID_VALUE, "%s: NULL", alpha ? "beta" : "alpha");
    if (!known_compute(computeType)) return fail(ST_INVALID_VALUE, "computeType=%d: not a compute type", computeType);
    if (!known_type(Atype) || !known_type(Btype) || !known_type(Ctype))
        return fail(ST_INVALID_VALUE, "Atype/Btype/Ctype=%d/%d/%d: not all real data types", Atype, Btype, Ctype);
    if (!combination_supported(computeType, Atype, Btype, Ctype))
        return fail(ST_NOT_SUPPORTED, "(Atype, Btype, Ctype)=(%s, %s, %s) with computeType=%d is not in GemmEx's table",
                    type_name(Atype), type_name(Btype), type_name(Ctype), computeType);
    return ST_SUCCESS;
}

/* --- the convert path: widen to fp32 (fp64 for int8, exact) and call OpenBLAS ---------------- */
static void *widen(const void *src, int type, size_t rows, size_t cols, size_t ld, int to_double) {
    void *dst = malloc((rows && cols ? rows * cols : 1) * (to_double ? sizeof(double) : sizeof(float)));
    if (!dst) return NULL;
    for (size_t j = 0; j < cols; j++)
        for (size_t i = 0; i < rows; i++) {
            double v = load_element(src, type, j * ld + i);
            if (to_double) ((double *)dst)[j * rows + i] = v;
            else ((float *)dst)[j * rows + i] = (float)v;
        }
    return dst;
}

static int run_convert(int transa, int transb, int m, int n, int k, const void *A, int at, int lda, const void *B,
                       int ldb, epilogue_ctx *e) {
    const int to_double = at == T_8I;
    e->acc_int = to_double; /* int8 products are exact in fp64, then int32 accumulators */
    size_t a_rows = transa ? k : m, a_cols = transa ? m : k, b_rows = transb ? n : k, b_cols = transb ? k : n;
    void *a = widen(A, at, a_rows, a_cols, (size_t)lda, to_double);
    void *b = widen(B, at, b_rows, b_cols, (size_t)ldb, to_double);
    void *t = malloc((size_t)m * n * (to_double ? sizeof(double) : sizeof(float)) + 1);
    int32_t *exact = to_double ? malloc((size_t)m * n * sizeof(int32_t) + 1) : NULL;
    int status = ST_SUCCESS;
    if (!a || !b || !t || (to_double && !exact)) {
        status = fail(ST_ALLOC_FAILED, "out of memory widening %d x %d x %d operands", m, n, k);
        goto done;
    }
    enum CBLAS_TRANSPOSE ta = transa ? CblasTrans : CblasNoTrans, tb = transb ? CblasTrans : CblasNoTrans;
    blasint lda2 = (blasint)(a_rows ? a_rows : 1), ldb2 = (blasint)(b_rows ? b_rows : 1), ldt = m ? m : 1;
    if (to_double) {
        scipy_cblas_dgemm(CblasColMajor, ta, tb, m, n, k, 1.0, a, lda2, b, ldb2, 0.0, t, ldt);
        for (size_t i = 0; i < (size_t)m * n; i++) /* exact integers; wrap like int32 arithmetic */
            exact[i] = (int32_t)(uint32_t)(int64_t)((double *)t)[i];
        epilogue(e, 0, 0, (size_t)n, (size_t)m, exact, (size_t)m);
    } else {
        scipy_cblas_sgemm(CblasColMajor, ta, tb, m, n, k, 1.0f, a, lda2, b, ldb2, 0.0f, t, ldt);
        epilogue(e, 0, 0, (size_t)n, (size_t)m, t, (size_t)m);
    }
done:
    free(a);
    free(b);
    free(t);
    free(exact);
    return status;
}

/* --- GemmEx --------------------------------------------------------------------------------- */
static int run_gemm_ex(const void *handle, int transa, int transb, int m, int n, int k, const void *alpha,
                       const void *A, int Atype, int lda, const void *B, int Btype, int ldb, const void *beta,
                       void *C, int Ctype, int ldc, int computeType, int algo) {
    int status = hcblasGemmExCheck(handle, transa, transb, m, n, k, alpha, Atype, lda, Btype, ldb, beta, Ctype,
                                   ldc, computeType, algo);
    if (status != ST_SUCCESS) return status;
    if (m == 0 || n == 0) return ST_SUCCESS;
    if (!C || (k > 0 && (!A || !B))) return fail(ST_INVALID_VALUE, "A, B and C must not be NULL");
    char err[160];
    int path = dspark_path_select(&gemm_paths, err, sizeof err);
    if (path < 0) return fail(ST_NOT_SUPPORTED, "%s", err);
    transa = transa != 0; /* OP_C is OP_T for real types */
    transb = transb != 0;

    epilogue_ctx e = {.c = C, .ctype = Ctype, .ldc = (size_t)ldc, .R = (size_t)n, .S = (size_t)m};
    if (computeType == C_32I || computeType == C_32I_PEDANTIC) {
        e.ialpha = *(const int32_t *)alpha;
        e.ibeta = *(const int32_t *)beta;
        e.alpha = (float)e.ialpha;
        e.beta = (float)e.ibeta;
    } else if (computeType == C_16F || computeType == C_16F_PEDANTIC) {
        e.alpha = half_to_float(*(const uint16_t *)alpha);
        e.beta = half_to_float(*(const uint16_t *)beta);
    } else if (computeType == C_64F || computeType == C_64F_PEDANTIC) {
        scipy_cblas_dgemm(CblasColMajor, transa ? CblasTrans : CblasNoTrans, transb ? CblasTrans : CblasNoTrans, m, n,
                          k, *(const double *)alpha, A, lda, B, ldb, *(const double *)beta, C, ldc);
        return ST_SUCCESS;
    } else {
        e.alpha = *(const float *)alpha;
        e.beta = *(const float *)beta;
    }
    if (e.alpha == 0.0f) return scale_c(&e);
    const hcblas_kernels *kernels = path_kernels(path);
    const int bf16_kernel = kernels && (Atype == T_16BF || (Atype == T_32F && computeType == C_32F_FAST_16BF));
    if (Atype == T_32F && !bf16_kernel) { /* fp32: OpenBLAS directly */
        scipy_cblas_sgemm(CblasColMajor, transa ? CblasTrans : CblasNoTrans, transb ? CblasTrans : CblasNoTrans, m, n,
                          k, e.alpha, A, lda, B, ldb, e.beta, C, ldc);
        return ST_SUCCESS;
    }
    if (!bf16_kernel && !(kernels && Atype == T_8I))
        return run_convert(transa, transb, m, n, k, A, Atype, lda, B, ldb, &e);

    hcblas_problem p = {
        .R = (size_t)n, .S = (size_t)m, .K = (size_t)k,
        .x = B, .x_rs = transb ? 1 : ldb, .x_cs = transb ? ldb : 1,
        .y = A, .y_rs = transa ? 1 : lda, .y_cs = transa ? lda : 1,
        .fp32_in = Atype == T_32F, .threads = scipy_openblas_get_num_threads(), .epilogue = epilogue, .ctx = &e,
    };
    e.acc_int = Atype == T_8I;
    int rc = e.acc_int ? kernels->gemm_s8(&p) : kernels->gemm_bf16(&p);
    return rc == 0 ? ST_SUCCESS : fail(ST_ALLOC_FAILED, "out of memory packing %d x %d x %d operands", m, n, k);
}

DSPARK_PROBE_SEMAPHORE(gemm_begin);
DSPARK_PROBE_SEMAPHORE(gemm_end);

static int gemm_ex(const void *handle, int transa, int transb, int m, int n, int k, const void *alpha,
                   const void *A, int Atype, int lda, const void *B, int Btype, int ldb, const void *beta, void *C,
                   int Ctype, int ldc, int computeType, int algo) {
    DSPARK_PROBE(gemm_begin, m, n, k);
    const int status = run_gemm_ex(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C,
                                   Ctype, ldc, computeType, algo);
    DSPARK_PROBE(gemm_end, m, n, k, (Atype & 0xff) | (Btype & 0xff) << 8 | (Ctype & 0xff) << 16 | (computeType & 0xff) << 24,
                 algo, status);
    return status;
}

/* --- the handle and the vendor names ---------------------------------------------------------- */
static int create(struct hcblasContext **handle) {
    if (!handle) return fail(ST_INVALID_VALUE, "handle: NULL pointer");
    struct hcblasContext *context = malloc(sizeof *context);
    if (!context) return fail(ST_ALLOC_FAILED, "out of memory");
    context->magic = CONTEXT_MAGIC;
    *handle = context;
    return ST_SUCCESS;
}

static int destroy(struct hcblasContext *handle) {
    if (!handle || handle->magic != CONTEXT_MAGIC)
        return fail(ST_NOT_INITIALIZED, "handle: NULL or not made by Create");
    handle->magic = 0;
    free(handle);
    return ST_SUCCESS;
}

#define DEFINE_VENDOR(p)                                                                                  \
    p##Status_t p##Create(p##Handle_t *handle) { return (p##Status_t)create(handle); }                    \
    p##Status_t p##Destroy(p##Handle_t handle) { return (p##Status_t)destroy(handle); }                   \
    p##Status_t p##GemmEx(p##Handle_t handle, p##Operation_t transa, p##Operation_t transb, int m, int n, \
                          int k, const void *alpha, const void *A, p##Datatype_t Atype, int lda,          \
                          const void *B, p##Datatype_t Btype, int ldb, const void *beta, void *C,         \
                          p##Datatype_t Ctype, int ldc, p##ComputeType_t computeType, p##GemmAlgo_t algo) { \
        return (p##Status_t)gemm_ex(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, \
                                    C, Ctype, ldc, computeType, algo);                                    \
    }

DEFINE_VENDOR(hcblas)
DEFINE_VENDOR(cublas)
DEFINE_VENDOR(hipblas)
DEFINE_VENDOR(mcblas)
DEFINE_VENDOR(mublas)

cublasStatus_t cublasCreate_v2(cublasHandle_t *handle) { return (cublasStatus_t)create(handle); }
cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) { return (cublasStatus_t)destroy(handle); }

/* CANN: row-major C (m x n) = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, so the operands
 * swap and the transposes stay; the leading dimensions are the row-major row lengths. */
static int acl_type(aclDataType type) {
    switch (type) {
    case ACL_FLOAT: return T_32F;
    case ACL_FLOAT16: return T_16F;
    case ACL_INT8: return T_8I;
    case ACL_INT32: return T_32I;
    case ACL_BF16: return T_16BF;
    default: return -1;
    }
}

aclError aclblasGemmEx(aclTransType transA, aclTransType transB, aclTransType transC, int m, int n, int k,
                       const void *alpha, const void *matrixA, int lda, aclDataType dataTypeA, const void *matrixB,
                       int ldb, aclDataType dataTypeB, const void *beta, void *matrixC, int ldc,
                       aclDataType dataTypeC, aclComputeType type, aclrtStream stream) {
    static struct hcblasContext context = {CONTEXT_MAGIC};
    (void)stream; /* host memory: the call completes before it returns */
    (void)type;   /* both precisions accumulate in fp32 (int32 for int8) here */
    if (transC != ACL_TRANS_N) return fail(ACL_ERROR_INVALID_PARAM, "transC: only ACL_TRANS_N is supported");
    if ((transA != ACL_TRANS_N && transA != ACL_TRANS_T) || (transB != ACL_TRANS_N && transB != ACL_TRANS_T))
        return fail(ACL_ERROR_INVALID_PARAM, "transA/transB: only ACL_TRANS_N and ACL_TRANS_T (no NZ layouts)");
    int at = acl_type(dataTypeA), bt = acl_type(dataTypeB), ct = acl_type(dataTypeC);
    if (at < 0 || bt < 0 || ct < 0) return fail(ACL_ERROR_INVALID_PARAM, "dataType: not a supported aclDataType");
    /* Row-major leading dimensions are row lengths: checked here, in CANN's names. */
    int a_cols = transA == ACL_TRANS_N ? k : m, b_cols = transB == ACL_TRANS_N ? n : k;
    if (lda == -1) lda = a_cols;
    if (ldb == -1) ldb = b_cols;
    if (ldc == -1) ldc = n;
    if (lda < (a_cols > 1 ? a_cols : 1))
        return fail(ACL_ERROR_INVALID_PARAM, "lda=%d: must be -1 or >= %d", lda, a_cols);
    if (ldb < (b_cols > 1 ? b_cols : 1))
        return fail(ACL_ERROR_INVALID_PARAM, "ldb=%d: must be -1 or >= %d", ldb, b_cols);
    if (ldc < (n > 1 ? n : 1)) return fail(ACL_ERROR_INVALID_PARAM, "ldc=%d: must be -1 or >= n=%d", ldc, n);
    /* alpha and beta have C's type: widen a half or a bf16 (two bytes) to the float COMPUTE_32F takes. */
    float alpha_f, beta_f;
    int compute = ct == T_32I ? C_32I : C_32F;
    if (ct == T_16F || ct == T_16BF) {
        float (*widen_scalar)(uint16_t) = ct == T_16F ? half_to_float : hcblas_bf16_to_f32;
        alpha_f = alpha ? widen_scalar(*(const uint16_t *)alpha) : 0.0f;
        beta_f = beta ? widen_scalar(*(const uint16_t *)beta) : 0.0f;
        alpha = alpha ? (const void *)&alpha_f : NULL;
        beta = beta ? (const void *)&beta_f : NULL;
    }
    int status = gemm_ex(&context, transB, transA, n, m, k, alpha, matrixB, bt, ldb, matrixA, at, lda, beta, matrixC,
                         ct, ldc, compute, -1);
    return status == ST_SUCCESS ? ACL_SUCCESS : ACL_ERROR_INVALID_PARAM;
}
