/* The llama kernels' family for the common dispatcher (isa_dispatch.h): the same path names and
 * DSPARK_SIMD override as the fused layer, stricter CPU rules (F16C; AVX-512 with BW, VL, VNNI). */
#include "cpu_features.h"
#include "llama_kernels.h"

static int runs(int isa) {
    dspark_cpu_features f = dspark_detect_cpu_features();
    switch (isa) {
    case DSPARK_ISA_AVX2: return f.avx2 && f.fma && f.f16c && f.os_avx;
    case DSPARK_ISA_AVX512: return f.avx512f && f.avx512bw && f.avx512vl && f.avx512vnni && f.fma && f.os_avx512;
    default: return isa == DSPARK_ISA_SCALAR;
    }
}

const dspark_isa_family llama_paths = {"llama", "DSPARK_SIMD", DSPARK_ISA_COUNT, dspark_isa_names,
                                       dspark_isa_compiled, runs};

const llama_kernels *llama_isa_kernels(int isa) {
    return DSPARK_ISA_TABLE(isa, llama_kernels_scalar, llama_kernels_avx2, llama_kernels_avx512);
}
