"""ONNX Runtime sessions as the onnx backend runs them: provider preference, threads, batching."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort

from dspark.accel.providers import ProviderChoice, ProviderRequest, choose, create_session, verify_session
from dspark.triton.tensors import TensorSpec

log = logging.getLogger(__name__)

GRAPH_OPTIMIZATION_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
ONNX_TO_TRITON = {
    onnx.TensorProto.BOOL: "TYPE_BOOL",
    onnx.TensorProto.UINT8: "TYPE_UINT8",
    onnx.TensorProto.UINT16: "TYPE_UINT16",
    onnx.TensorProto.UINT32: "TYPE_UINT32",
    onnx.TensorProto.UINT64: "TYPE_UINT64",
    onnx.TensorProto.INT8: "TYPE_INT8",
    onnx.TensorProto.INT16: "TYPE_INT16",
    onnx.TensorProto.INT32: "TYPE_INT32",
    onnx.TensorProto.INT64: "TYPE_INT64",
    onnx.TensorProto.FLOAT16: "TYPE_FP16",
    onnx.TensorProto.FLOAT: "TYPE_FP32",
    onnx.TensorProto.DOUBLE: "TYPE_FP64",
    onnx.TensorProto.STRING: "TYPE_STRING",
}


def make_session_options(
    intra_op_threads: int = 1,
    inter_op_threads: int = 1,
    allow_spinning: bool = False,
    graph_optimization_level: str = "all",
) -> ort.SessionOptions:
    """Session options with thread spinning off by default.

    ORT's default busy-waiting made two sessions on 2 cores slow each other down almost 2x.
    """
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = inter_op_threads
    options.graph_optimization_level = GRAPH_OPTIMIZATION_LEVELS[graph_optimization_level]
    spin = "1" if allow_spinning else "0"
    options.add_session_config_entry("session.intra_op.allow_spinning", spin)
    options.add_session_config_entry("session.inter_op.allow_spinning", spin)
    return options


def _dims(value_info: onnx.ValueInfoProto) -> list[int]:
    return [d.dim_value if d.HasField("dim_value") else -1 for d in value_info.type.tensor_type.shape.dim]


@dataclass(frozen=True)
class GraphSignature:
    """Inputs and outputs of an ONNX graph, in Triton's terms, with dims including any batch axis."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]

    def batchable(self) -> bool:
        """True when every tensor has a leading dynamic axis that can be Triton's batch dimension."""
        tensors = self.inputs + self.outputs
        return bool(tensors) and all(t.dims and t.dims[0] == -1 for t in tensors)


def read_graph_signature(model_path: Path) -> GraphSignature:
    model = onnx.load(str(model_path), load_external_data=False)
    initializers = {init.name for init in model.graph.initializer}

    def specs(values) -> list[TensorSpec]:
        result = []
        for value in values:
            if value.name in initializers:
                continue
            elem = value.type.tensor_type.elem_type
            if elem not in ONNX_TO_TRITON:
                raise ValueError(f"{model_path}: tensor '{value.name}' has ONNX type {elem}, which Triton cannot carry")
            result.append(TensorSpec(value.name, ONNX_TO_TRITON[elem], tuple(_dims(value))))
        return result

    return GraphSignature(inputs=specs(model.graph.input), outputs=specs(model.graph.output))


@dataclass
class OnnxRunner:
    """One ORT session with the options the backend was configured with."""

    model_path: Path
    providers: ProviderRequest = ProviderRequest()  # preference, options, fallback policy
    intra_op_threads: int = 1
    inter_op_threads: int = 1
    allow_spinning: bool = False
    graph_optimization_level: str = "all"
    choice: ProviderChoice = field(init=False)

    def __post_init__(self) -> None:
        self.choice = choose(self.providers)
        options = make_session_options(
            self.intra_op_threads, self.inter_op_threads, self.allow_spinning, self.graph_optimization_level
        )
        self.session = create_session(self.model_path, options, self.choice)
        self.choice = verify_session(self.choice, self.session.get_providers())
        self.output_names = [output.name for output in self.session.get_outputs()]

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self.session.run(self.output_names, dict(feeds))))

    def run_batched(self, requests: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """Run requests of equal per-row shapes as one batch along axis 0, then split the outputs back."""
        if len(requests) == 1:
            return [self.run(requests[0])]
        rows = [len(next(iter(feeds.values()))) for feeds in requests]
        merged = {name: np.concatenate([feeds[name] for feeds in requests]) for name in requests[0]}
        outputs = self.run(merged)
        bounds = np.cumsum(rows)[:-1]
        split = {name: np.split(value, bounds) for name, value in outputs.items()}
        return [{name: parts[i] for name, parts in split.items()} for i in range(len(requests))]


def batch_groups(requests: Sequence[Mapping[str, np.ndarray]]) -> list[list[int]]:
    """Indices of requests that can share one batch: equal dtypes and shapes past the batch axis."""
    groups: dict[tuple, list[int]] = {}
    for index, feeds in enumerate(requests):
        key = tuple(sorted((name, array.dtype.str, array.shape[1:]) for name, array in feeds.items()))
        groups.setdefault(key, []).append(index)
    return list(groups.values())
