"""What this CPU and OS support, for choosing a kernel path at run time."""

cdef extern from "cpu_features.h":
    ctypedef struct dspark_cpu_features:
        int sse42, avx, avx2, fma, f16c
        int avx512f, avx512bw, avx512vl, avx512dq, avx512bf16, avx512vnni
        int amx_tile, amx_bf16, amx_int8
        int os_avx, os_avx512, os_amx
    dspark_cpu_features dspark_detect_cpu_features()
    int dspark_built_with_avx2()
    int dspark_built_with_avx512f()
    int dspark_cpu_runs_avx2()
    int dspark_cpu_runs_avx512()

_CPU_FIELDS = ("sse42", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
               "avx512bf16", "avx512vnni", "amx_tile", "amx_bf16", "amx_int8",
               "os_avx", "os_avx512", "os_amx")


def runtime_features() -> dict:
    """CPUID feature bits and the OS's XSAVE state support (XCR0), as booleans."""
    cdef dspark_cpu_features f = dspark_detect_cpu_features()
    values = (f.sse42, f.avx, f.avx2, f.fma, f.f16c, f.avx512f, f.avx512bw, f.avx512vl, f.avx512dq,
              f.avx512bf16, f.avx512vnni, f.amx_tile, f.amx_bf16, f.amx_int8,
              f.os_avx, f.os_avx512, f.os_amx)
    return {name: bool(value) for name, value in zip(_CPU_FIELDS, values)}


def build_features() -> dict:
    """ISA macros the compiler set for code built with the package's default flags."""
    return {"avx2": bool(dspark_built_with_avx2()), "avx512f": bool(dspark_built_with_avx512f())}


def usable_isas() -> list:
    """Instruction sets both the CPU and the OS support, best first; 'scalar' always last."""
    isas = []
    if dspark_cpu_runs_avx512():
        isas.append("avx512")
    if dspark_cpu_runs_avx2():
        isas.append("avx2")
    isas.append("scalar")
    return isas
