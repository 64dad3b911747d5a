/* Run-time choice of the llama kernels' instruction set: CPUID + XGETBV (cpu_features.h),
 * overridable by DSPARK_SIMD and narrowed by DSPARK_SIMD_HIDE (the same names and rules as the
 * fused kernel's dispatch). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cpu_features.h"
#include "llama_kernels.h"

static const char *const isa_names[LLAMA_ISA_COUNT] = {"scalar", "avx2", "avx512"};

const char *llama_isa_name(int isa) {
    return (isa >= 0 && isa < LLAMA_ISA_COUNT) ? isa_names[isa] : "unknown";
}

int llama_isa_compiled(int isa) {
    return isa == LLAMA_ISA_SCALAR ||
           (LLAMA_HAVE_X86_TUS && (isa == LLAMA_ISA_AVX2 || isa == LLAMA_ISA_AVX512));
}

int llama_isa_supported(int isa) {
    if (isa != LLAMA_ISA_SCALAR && isa >= 0 && isa < LLAMA_ISA_COUNT && dspark_isa_hidden(isa_names[isa])) return 0;
    dspark_cpu_features f = dspark_detect_cpu_features();
    switch (isa) {
    case LLAMA_ISA_SCALAR: return 1;
    case LLAMA_ISA_AVX2: return f.avx2 && f.fma && f.f16c && f.os_avx;
    case LLAMA_ISA_AVX512:
        return f.avx512f && f.avx512bw && f.avx512vl && f.avx512vnni && f.fma && f.os_avx512;
    default: return 0;
    }
}

const llama_kernels *llama_isa_kernels(int isa) {
#if LLAMA_HAVE_X86_TUS
    if (isa == LLAMA_ISA_AVX2) return llama_kernels_avx2();
    if (isa == LLAMA_ISA_AVX512) return llama_kernels_avx512();
#endif
    (void)isa;
    return llama_kernels_scalar();
}

int llama_isa_best(void) {
    for (int isa = LLAMA_ISA_COUNT - 1; isa > 0; isa--)
        if (llama_isa_compiled(isa) && llama_isa_supported(isa)) return isa;
    return LLAMA_ISA_SCALAR;
}

int llama_isa_by_name(const char *name, char *err, size_t err_len) {
    if (!name || !*name || strcmp(name, "auto") == 0) return llama_isa_best();
    for (int isa = 0; isa < LLAMA_ISA_COUNT; isa++) {
        if (strcmp(name, isa_names[isa]) != 0) continue;
        if (!llama_isa_compiled(isa)) {
            snprintf(err, err_len, "%s: this build has no %s kernels", name, name);
            return -1;
        }
        if (!llama_isa_supported(isa)) {
            snprintf(err, err_len, "%s: this CPU or OS cannot run the %s llama kernels (best here: %s)",
                     name, name, isa_names[llama_isa_best()]);
            return -1;
        }
        return isa;
    }
    snprintf(err, err_len, "%s: expected one of auto, scalar, avx2, avx512", name);
    return -1;
}

int llama_isa_select(char *err, size_t err_len) {
    char inner[200] = "";
    const char *want = getenv("DSPARK_SIMD");
    int isa = llama_isa_by_name(want, inner, sizeof(inner));
    if (isa < 0) snprintf(err, err_len, "DSPARK_SIMD=%s", inner);
    return isa;
}
