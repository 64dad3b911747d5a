"""The config parameters of dspark's `onnx` and `fused_transformer` backends, as pydantic models.

`parse_parameters(OnnxParameters, model_config)` turns a model config's string parameters into
typed values; a bad one fails the load with an error naming the parameter, e.g.
``parameter 'graph_optimization_level': Input should be 'disable', 'basic', 'extended' or 'all'
(got 'fast')``.
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field

from dspark.triton.adapter import ConfigParameters

Count = Annotated[int, Field(ge=0)]


class OnnxParameters(ConfigParameters):
    """backends/onnx: ONNX Runtime's session options (the provider parameters are
    dspark.accel.providers.ProviderRequest's)."""

    intra_op_threads: Count = 1  # 0: ONNX Runtime's default (one per core)
    inter_op_threads: Count = 1
    allow_spinning: bool = False
    graph_optimization_level: Literal["disable", "basic", "extended", "all"] = "all"


class FusedTransformerParameters(ConfigParameters):
    """backends/fused_transformer: kernel threads, NUMA pinning, the activation pool."""

    threads: Annotated[int, Field(ge=1)] = 1
    numa_node: Optional[Count] = None  # pin this instance's threads and first touch to that node
    use_pool: bool = True
    pool_bytes: Count = 64 << 20
    lock_pages: bool = False
    huge_pages: bool = True
    matmul: Literal["fused", "gemm"] = "fused"  # gemm: every product through the GemmEx shim (dspark.accel)
    gemm_vendor: Literal["hcblas", "cublas", "hipblas", "mcblas", "mublas"] = "hcblas"
    gemm_device: Literal["auto", "cpu", "cuda"] = "auto"
    gemm_compute: Literal["fp32", "bf16"] = "fp32"
