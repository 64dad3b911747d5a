"""The baselines the fused layer is measured against: the same layer as unfused
numpy/scipy calls, and as an ONNX graph run by ONNX Runtime at ORT_ENABLE_ALL."""
from __future__ import annotations

import math
import os
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from scipy.special import erf

from dspark.runtimes.onnx_session import make_session_options


def unfused_numpy(x, gamma, beta, w, b, eps: float = 1e-5) -> np.ndarray:
    """What a user writes without a fused kernel: separate LayerNorm, GELU, matmul."""
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    h = (x - mean) / np.sqrt(var + eps) * gamma + beta
    h = 0.5 * h * (1.0 + erf(h * np.float32(1 / math.sqrt(2))))
    return h @ w + b


def layer_graph(gamma, beta, w, b, eps: float = 1e-5) -> onnx.ModelProto:
    """LayerNormalization -> erf GELU (the x/sqrt(2) form ORT's Gelu fusion matches) -> MatMul -> Add."""
    d, n = w.shape
    inits = [numpy_helper.from_array(a, name) for a, name in
             ((gamma, "gamma"), (beta, "beta"), (w, "W"), (b, "b"),
              (np.array(math.sqrt(2), np.float32), "sqrt2"),
              (np.array(1.0, np.float32), "one"), (np.array(0.5, np.float32), "half"))]
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["ln"], axis=-1, epsilon=eps),
        helper.make_node("Div", ["ln", "sqrt2"], ["s"]),
        helper.make_node("Erf", ["s"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["e1"]),
        helper.make_node("Mul", ["ln", "e1"], ["g0"]),
        helper.make_node("Mul", ["g0", "half"], ["g"]),
        helper.make_node("MatMul", ["g", "W"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "fused_layer",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", d])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class OrtFusedLayer:
    """The layer in ONNX Runtime at ORT_ENABLE_ALL; ``optimized_op_types`` shows its fusions."""

    def __init__(self, gamma, beta, w, b, *, threads: int = 1, eps: float = 1e-5) -> None:
        so = make_session_options(threads, 1, graph_optimization_level="all")
        so.log_severity_level = 3  # no warning for saving the optimized graph: it is only read back for its op types
        with tempfile.TemporaryDirectory() as tmp:
            so.optimized_model_filepath = os.path.join(tmp, "opt.onnx")
            self.session = ort.InferenceSession(layer_graph(gamma, beta, w, b, eps).SerializeToString(),
                                                so, providers=["CPUExecutionProvider"])
            optimized = onnx.load(so.optimized_model_filepath)
        self.optimized_op_types = [
            f"{node.domain}.{node.op_type}" if node.domain else node.op_type for node in optimized.graph.node]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.session.run(None, {"x": x})[0]
