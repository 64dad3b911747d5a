/* Run-time choice of the per-ISA kernel table: CPUID plus OS support of the register state
 * (XGETBV), from cpu_features.h, overridable by DSPARK_SIMD. DSPARK_SIMD_HIDE (comma separated
 * ISA names) makes this process treat those as unsupported: tests of the refusal on a CPU that
 * has everything, or a look at what an older CPU would run. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "dspark_simd.h"

static const char *const isa_names[DSPARK_ISA_COUNT] = {"scalar", "avx2", "avx512"};

const char *dspark_isa_name(int isa) {
    return (isa >= 0 && isa < DSPARK_ISA_COUNT) ? isa_names[isa] : "unknown";
}

int dspark_isa_compiled(int isa) {
    if (isa == DSPARK_ISA_SCALAR) return 1;
    return DSPARK_HAVE_X86_TUS && (isa == DSPARK_ISA_AVX2 || isa == DSPARK_ISA_AVX512);
}

#if DSPARK_HAVE_X86_TUS
#include "cpu_features.h"

int dspark_isa_supported(int isa) {
    if (isa != DSPARK_ISA_SCALAR && isa >= 0 && isa < DSPARK_ISA_COUNT && dspark_isa_hidden(isa_names[isa])) return 0;
    switch (isa) {
    case DSPARK_ISA_SCALAR: return 1;
    case DSPARK_ISA_AVX2: return dspark_cpu_runs_avx2();
    case DSPARK_ISA_AVX512: return dspark_cpu_runs_avx512();
    default: return 0;
    }
}

const dspark_simd_kernels *dspark_isa_kernels(int isa) {
    switch (isa) {
    case DSPARK_ISA_AVX2: return dspark_simd_avx2();
    case DSPARK_ISA_AVX512: return dspark_simd_avx512();
    default: return dspark_simd_scalar();
    }
}
#else
int dspark_isa_supported(int isa) { return isa == DSPARK_ISA_SCALAR; }
const dspark_simd_kernels *dspark_isa_kernels(int isa) { (void)isa; return dspark_simd_scalar(); }
#endif

int dspark_isa_best(void) {
    for (int isa = DSPARK_ISA_COUNT - 1; isa > 0; isa--)
        if (dspark_isa_compiled(isa) && dspark_isa_supported(isa)) return isa;
    return DSPARK_ISA_SCALAR;
}

int dspark_isa_select(char *err, size_t err_len) {
    const char *want = getenv("DSPARK_SIMD");
    if (!want || !*want || strcmp(want, "auto") == 0) return dspark_isa_best();
    for (int isa = 0; isa < DSPARK_ISA_COUNT; isa++) {
        if (strcmp(want, isa_names[isa]) != 0) continue;
        if (!dspark_isa_compiled(isa)) {
            snprintf(err, err_len, "DSPARK_SIMD=%s: this build has no %s kernels", want, want);
            return -1;
        }
        if (!dspark_isa_supported(isa)) {
            snprintf(err, err_len, "DSPARK_SIMD=%s: this CPU or OS cannot run %s (best here: %s)",
                     want, want, isa_names[dspark_isa_best()]);
            return -1;
        }
        return isa;
    }
    snprintf(err, err_len, "DSPARK_SIMD=%s: expected one of auto, scalar, avx2, avx512", want);
    return -1;
}
