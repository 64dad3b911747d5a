/* One run-time dispatcher for every family of per-ISA kernels (the fused layer, the llama
 * kernels, the GemmEx shim). A family names its paths (path 0 is portable: always built, always
 * runnable), the environment variable that forces one, and two rules: which paths this binary
 * holds and which this CPU and OS can run (CPUID + XGETBV, cpu_features.h). The choice ("auto" or
 * unset = the best runnable path), DSPARK_SIMD_HIDE (comma separated path names this process
 * treats as unrunnable: the refusal tested on a CPU that has everything, or what an older CPU
 * would run) and the refusal sentences are the same for every family. */
#ifndef DSPARK_ISA_DISPATCH_H
#define DSPARK_ISA_DISPATCH_H

#include <stddef.h>

#define DSPARK_ISA_SCALAR 0
#define DSPARK_ISA_AVX2 1
#define DSPARK_ISA_AVX512 2
#define DSPARK_ISA_COUNT 3

#if defined(__x86_64__) || defined(__i386__)
#define DSPARK_HAVE_X86_TUS 1 /* the x86 translation units are built and linked */
#else
#define DSPARK_HAVE_X86_TUS 0
#endif

typedef struct dspark_isa_family {
    const char *kernels;              /* in sentences: "the avx2 <kernels> kernels" */
    const char *env;                  /* the variable that forces a path */
    int count;
    const char *const *names;
    int (*compiled)(int path);        /* this binary holds the path */
    int (*runs)(int path);            /* this CPU and OS can run it */
} dspark_isa_family;

#define DSPARK_HIDDEN __attribute__((visibility("hidden")))

/* The families whose paths are scalar, avx2 and avx512 (the fused layer, the llama kernels):
 * their path names, which of them this binary holds, and the table of a path from the family's
 * three table getters (the x86 ones are declared, built and linked on x86 only). */
DSPARK_HIDDEN extern const char *const dspark_isa_names[DSPARK_ISA_COUNT];
DSPARK_HIDDEN int dspark_isa_compiled(int isa);
#if DSPARK_HAVE_X86_TUS
#define DSPARK_ISA_TABLE(isa, scalar, avx2, avx512) \
    ((isa) == DSPARK_ISA_AVX512 ? avx512() : (isa) == DSPARK_ISA_AVX2 ? avx2() : scalar())
#else
#define DSPARK_ISA_TABLE(isa, scalar, avx2, avx512) ((void)(isa), scalar())
#endif

DSPARK_HIDDEN const char *dspark_path_name(const dspark_isa_family *family, int path);
/* compiled, run by this CPU and OS, and not hidden by DSPARK_SIMD_HIDE */
DSPARK_HIDDEN int dspark_path_runnable(const dspark_isa_family *family, int path);
DSPARK_HIDDEN int dspark_path_best(const dspark_isa_family *family);
/* The path `name` names ("auto", "" or NULL: the best), or -1 with a sentence in err. */
DSPARK_HIDDEN int dspark_path_by_name(const dspark_isa_family *family, const char *name, char *err,
                                          size_t err_len);
/* The path the family's variable forces, else the best; -1 with "VAR=value: ..." in err. */
DSPARK_HIDDEN int dspark_path_select(const dspark_isa_family *family, char *err, size_t err_len);
/* Comma separated names of the compiled paths (runnable_only: of the runnable ones) into out. */
DSPARK_HIDDEN const char *dspark_path_list(const dspark_isa_family *family, int runnable_only, char *out,
                                               size_t out_len);

#endif
