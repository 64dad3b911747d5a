"""The config parameters of dspark's backends, as pydantic models read by
``dspark.params.parse_parameters`` (the execution-provider and TensorRT parameters an ``onnx``
model may also carry are in dspark.runtimes.accel: ``ProviderParameters``, ``TensorRTParameters``)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

from pydantic import Field

from dspark.errors import ConfigError
from dspark.params import ConfigParameters
from dspark.runtimes.accel.vendors import DEVICES, VENDORS

Count = Annotated[int, Field(ge=0)]


class OnnxParameters(ConfigParameters):
    """backends/onnx: ONNX Runtime's session options (the provider parameters are
    dspark.runtimes.accel.providers.ProviderRequest's)."""

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
    matmul: Literal["fused", "gemm"] = "fused"  # gemm: every product through the GemmEx shim (dspark.runtimes.accel)
    gemm_vendor: Literal[VENDORS] = "hcblas"
    gemm_device: Literal[DEVICES] = "auto"
    gemm_compute: Literal["fp32", "bf16"] = "fp32"


class SpeculativeParameters(ConfigParameters):
    """backends/speculative: the model it serves, its speculative defaults, the request pool."""

    # a real LLM imported by `dspark llm import`: its folder, relative to the version folder
    llm_model: str = Field(min_length=1)
    # a draft LLM of the same vocabulary (another imported folder, relative to the version
    # folder), for the methods draft and tree; none: those methods are not offered
    draft_llm: str = ""
    default_method: str = "hybrid"
    num_speculative_tokens: int = Field(4, ge=1, le=16)
    tree_width: int = Field(4, ge=1, le=8)
    intra_op_threads: int = Field(2, ge=1, le=256)
    stream_interval_ms: int = Field(10, ge=0, le=10_000)
    max_concurrent_requests: int = Field(4, ge=1, le=256)
    max_queued_requests: int = Field(16, ge=0, le=100_000)
    max_queue_wait_ms: int = Field(30_000, ge=0)
    batch_verification: bool = False
    max_context: int = Field(0, ge=0)  # 0 = the model's own context
    # MiB of the target's KV rows kept for prompts that start as earlier ones did; 0: off
    prefix_cache_mb: float = Field(256, ge=0, le=1 << 20)


class RouterParameters(ConfigParameters):
    """backends/qos_router: the model it fronts, the versions it may route to, its routing file."""

    target_model: str = Field(min_length=1)  # the model to front (required)
    # versions the routing file may name, e.g. "1,2"; "*": any the target serves (a rollout adds new ones)
    target_versions: str = "1"
    routing_file: str = "routing.yaml"  # relative to the router's model folder; re-read on change
    # how often the router looks for a changed routing file and exports its counters to /metrics
    poll_interval_ms: Annotated[float, Field(ge=10, le=60_000)] = 500.0

    def routing_path(self, model_dir: Path) -> Path:
        path = Path(self.routing_file)
        return path if path.is_absolute() else Path(model_dir) / path

    def versions(self) -> Optional[set[int]]:
        """The target versions as numbers; None for "*" (any)."""
        raw = self.target_versions.strip()
        if raw == "*":
            return None
        try:
            return {int(v) for v in raw.split(",") if v.strip()}
        except ValueError:
            raise ConfigError("parameter 'target_versions'",
                              f"must list version numbers, e.g. \"1,2\", or \"*\" for any; got {raw!r}") from None
