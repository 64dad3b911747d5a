"""kernels layer (see docs/ARCHITECTURE.md): fused LayerNorm+GELU+MatMul, the BFC memory
pool, NUMA placement. The compiled parts are ``dspark._ext.fused`` and ``dspark._ext.pool``
(sources in ``cython_ext/``); these modules add argument checks, dataclasses and reporting."""
