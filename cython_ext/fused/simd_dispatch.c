/* The fused layer's kernel family for the common dispatcher (isa_dispatch.h): its paths, the
 * DSPARK_SIMD override, and which table each path runs. */
#include "dspark_simd.h"
#include "cpu_features.h"

static const char *const names[DSPARK_ISA_COUNT] = {"scalar", "avx2", "avx512"};

static int compiled(int isa) { return isa == DSPARK_ISA_SCALAR || DSPARK_HAVE_X86_TUS; }

static int runs(int isa) {
    switch (isa) {
    case DSPARK_ISA_AVX2: return dspark_cpu_runs_avx2();
    case DSPARK_ISA_AVX512: return dspark_cpu_runs_avx512();
    default: return isa == DSPARK_ISA_SCALAR;
    }
}

const dspark_isa_family dspark_fused_paths = {"fused", "DSPARK_SIMD", DSPARK_ISA_COUNT, names, compiled, runs};

const dspark_simd_kernels *dspark_isa_kernels(int isa) {
#if DSPARK_HAVE_X86_TUS
    if (isa == DSPARK_ISA_AVX2) return dspark_simd_avx2();
    if (isa == DSPARK_ISA_AVX512) return dspark_simd_avx512();
#endif
    (void)isa;
    return dspark_simd_scalar();
}
