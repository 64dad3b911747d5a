"""ONNX Runtime sessions as the onnx backend runs them: provider preference, threads, batching."""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence, Union

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument

from dspark.runtimes.accel.providers import ProviderChoice, ProviderRequest, choose, create_session, verify_session
from dspark.errors import RequestError
from dspark.tensors import TensorSpec

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


Dim = Union[int, str, None]  # fixed size, named (symbolic) size, or unknown


def _show_dims(dims: Sequence[Dim]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


@dataclass(frozen=True)
class GraphInput:
    """An input as the ONNX graph declares it; inputs that share a named dim must agree on it."""

    name: str
    dims: tuple[Dim, ...]

    def check(self, array: np.ndarray, sizes: dict[str, tuple[str, int]]) -> None:
        """RequestError if ``array`` breaks a fixed dim, or a named dim another input set
        (``sizes``: dim name -> (first input, its size), filled as inputs are checked)."""
        shape = array.shape
        if len(shape) != len(self.dims) or any(isinstance(want, int) and want != got
                                               for want, got in zip(self.dims, shape)):
            raise RequestError(f"input tensor '{self.name}'",
                               f"has shape {list(shape)}, the ONNX graph expects {_show_dims(self.dims)}")
        for dim, got in zip(self.dims, shape):
            if isinstance(dim, str):
                first, size = sizes.setdefault(dim, (self.name, got))
                if size != got:
                    raise RequestError(
                        f"input tensors '{first}' and '{self.name}'",
                        f"disagree on dimension '{dim}' of the ONNX graph: {first} has {size}, {self.name} has "
                        f"{got} (shapes {list(shape)} vs the graph's {_show_dims(self.dims)}); send equal sizes")


# Where ONNX Runtime says a node could not combine its inputs' shapes (broadcast, reshape, concat...).
ORT_SHAPE_ERROR = re.compile(r"broadcast|shape|dimension|axis", re.IGNORECASE)
# "/onnxruntime_src/...h:563 void f(a, b) axis == 1 || ... was false. " before the sentence that says it
ORT_MESSAGE_NOISE = re.compile(r"^\S+:\d+ [^(]*\([^)]*\)\s*(.*? was false\.\s*)?")
MAX_NAMED = 4


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(f"'{name}'" for name in names[:MAX_NAMED])
    return shown + (f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else "")


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
        self.graph_inputs = [GraphInput(i.name, tuple(i.shape)) for i in self.session.get_inputs()]

    def check_feeds(self, feeds: Mapping[str, np.ndarray]) -> None:
        """One request's inputs against the graph's declared dims (fixed sizes, and named sizes
        shared between inputs), before it is batched with others; RequestError names the inputs."""
        sizes: dict[str, tuple[str, int]] = {}
        for graph_input in self.graph_inputs:
            if graph_input.name in feeds:
                graph_input.check(feeds[graph_input.name], sizes)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            return dict(zip(self.output_names, self.session.run(self.output_names, dict(feeds))))
        except (Fail, InvalidArgument) as error:
            raise self._request_error(error, feeds) from error

    def _request_error(self, error: Exception, feeds: Mapping[str, np.ndarray]) -> Exception:
        """ONNX Runtime's failure on inputs that passed check_feeds as a RequestError naming the
        inputs with named dims and their sizes, when it is a shape disagreement (the graph
        relates them in a way its declared dims cannot say, e.g. S = P + T); any other failure
        is returned unchanged (INTERNAL)."""
        message = str(error)
        if not ORT_SHAPE_ERROR.search(message):
            return error
        node = re.search(r"running (\w+) node", message)
        detail = ORT_MESSAGE_NOISE.sub("", message.split("Status Message:")[-1].strip())
        named, sizes = [], {}
        for graph_input in self.graph_inputs:
            array = feeds.get(graph_input.name)
            dims = [(dim, got) for dim, got in zip(graph_input.dims, getattr(array, "shape", ())) if isinstance(dim, str)]
            if dims:
                named.append(graph_input.name)
                sizes.update(dims)
        sized = ", ".join(f"{dim}={size}" for dim, size in sizes.items())
        return RequestError(f"input tensors {_names(named or list(feeds))}",
                            f"are inconsistent with each other (sizes {sized or 'as sent'}): "
                            f"the graph's {node.group(1) if node else ''} node failed with \"{detail}\"")

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
