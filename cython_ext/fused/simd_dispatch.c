/* The fused layer's kernel family for the common dispatcher (isa_dispatch.h): its CPU rules, the
 * DSPARK_SIMD override, and which table each path runs. */
#include "dspark_simd.h"
#include "cpu_features.h"

static int runs(int isa) {
    switch (isa) {
    case DSPARK_ISA_AVX2: return dspark_cpu_runs_avx2();
    case DSPARK_ISA_AVX512: return dspark_cpu_runs_avx512();
    default: return isa == DSPARK_ISA_SCALAR;
    }
}

const dspark_isa_family dspark_fused_paths = {"fused", "DSPARK_SIMD", DSPARK_ISA_COUNT, dspark_isa_names,
                                              dspark_isa_compiled, runs};

const dspark_simd_kernels *dspark_isa_kernels(int isa) {
    return DSPARK_ISA_TABLE(isa, dspark_simd_scalar, dspark_simd_avx2, dspark_simd_avx512);
}
