"""Which SIMD path the fused kernels run, and why (build-time vs run-time support)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from dspark._ext import fused as _fused

SIMD_ENV = "DSPARK_SIMD"
HIDE_ENV = "DSPARK_SIMD_HIDE"  # ISAs to treat as unsupported here (tests; what an older CPU runs)
ISAS = ("scalar", "avx2", "avx512")  # isa_dispatch.c's dspark_isa_names, in its order (a unit test compares)


@dataclass(frozen=True)
class DispatchReport:
    compiled: list[str]   # translation units built into this binary
    supported: list[str]  # what this CPU and OS can run (CPUID + XGETBV)
    best: str             # what auto-dispatch picks
    chosen: str           # what the next call uses (DSPARK_SIMD applied), or "error: ..."
    override: str | None  # the DSPARK_SIMD value, if set
    blas: str             # the GEMM library and the kernel core it picked
    blas_threads: int


def dispatch_report() -> DispatchReport:
    simd = _fused.simd_info()
    blas = _fused.blas_info()
    return DispatchReport(
        compiled=simd["compiled"],
        supported=simd["supported"],
        best=simd["best"],
        chosen=simd["chosen"],
        override=os.environ.get(SIMD_ENV) or None,
        blas=f"{blas['library']} ({blas['config']})",
        blas_threads=blas["threads"],
    )


def available_isas() -> list[str]:
    """ISAs both compiled in and runnable here: the ones tests force one by one."""
    info = _fused.simd_info()
    return [isa for isa in info["compiled"] if isa in info["supported"]]
