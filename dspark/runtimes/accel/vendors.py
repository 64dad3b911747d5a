"""The GemmEx shim's names, written once: the vendor prefixes libhcblas exports
(cython_ext/gemm_shim/hcblas.h declares the same list; a unit test compares them) and the
devices a product may run on. Plain tuples, cheap to import (the config parameters' Literals are
built from them)."""
from __future__ import annotations

VENDORS = ("hcblas", "cublas", "hipblas", "mcblas", "mublas")
DEVICES = ("auto", "cpu", "cuda")
