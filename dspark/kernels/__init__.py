"""Compiled CPU kernels: fused LayerNorm+GELU+MatMul, the BFC memory pool, NUMA placement.

The compiled parts live in ``dspark._ext.fused`` and ``dspark._ext.pool`` (sources in
``cython_ext/``); these modules add argument checking, dataclasses and reporting.
"""
