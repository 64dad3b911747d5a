"""Quantized variants of an ONNX model, measured against the float model they came from.

- INT8, dynamic: ONNX Runtime's `quantize_dynamic` (int8 weights; activations quantized per run).
- INT8, static: `quantize_static` in QDQ format, activations calibrated (MinMax) on data from the
  user or generated from the model's inputs.
- INT4: weight-only 4-bit blocks of the MatMuls (`MatMulNBitsQuantizer` -> com.microsoft.MatMulNBits).

`compare` runs both models on the same inputs in ONNX Runtime (CPU provider, interleaved timed
runs, medians) and reports the speed ratio and the accuracy delta.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import numpy as np
import onnx

from dspark.errors import ConfigError

METHODS = ("int8-dynamic", "int8-static", "int4")
NUMPY_OF_ONNX = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64,
                 onnx.TensorProto.FLOAT16: np.float16, onnx.TensorProto.INT64: np.int64,
                 onnx.TensorProto.INT32: np.int32, onnx.TensorProto.INT8: np.int8, onnx.TensorProto.UINT8: np.uint8,
                 onnx.TensorProto.BOOL: np.bool_}
DYNAMIC_DIM = 8  # a dynamic axis (batch, sequence) in generated inputs


def _integer_bound(model: onnx.ModelProto, name: str) -> int:
    """For an integer input that indexes a table (Gather's indices, e.g. token ids), the table's
    first dimension; otherwise 100."""
    shapes = {init.name: list(init.dims) for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == name and node.input[0] in shapes:
            return shapes[node.input[0]][0]
    return 100


def generated_inputs(model_path: Path, samples: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """`samples` feeds shaped like the model's inputs: standard normal floats, integers in the range
    the graph indexes with them. Dynamic axes get DYNAMIC_DIM."""
    model = onnx.load(str(model_path), load_external_data=False)
    initializers = {init.name for init in model.graph.initializer}
    rng = np.random.default_rng(seed)
    feeds = []
    for _ in range(samples):
        feed = {}
        for value in model.graph.input:
            if value.name in initializers:
                continue
            tensor = value.type.tensor_type
            dtype = NUMPY_OF_ONNX.get(tensor.elem_type)
            if dtype is None:
                raise ConfigError(f"input '{value.name}'", f"cannot generate data of ONNX type {tensor.elem_type}: "
                                                           "pass --inputs / --calibration with real data")
            shape = [d.dim_value if d.HasField("dim_value") else DYNAMIC_DIM for d in tensor.shape.dim]
            if np.issubdtype(dtype, np.integer):
                feed[value.name] = rng.integers(0, _integer_bound(model, value.name), shape).astype(dtype)
            else:
                feed[value.name] = rng.standard_normal(shape).astype(dtype)
        feeds.append(feed)
    return feeds


def load_feeds(path: Path, model_path: Path) -> list[dict[str, np.ndarray]]:
    """Feeds from an .npz holding one array per model input, samples along the first axis (each
    sample keeps that axis with length 1, the batch axis)."""
    names = [i.name for i in onnx.load(str(model_path), load_external_data=False).graph.input]
    with np.load(path) as data:
        missing = [name for name in names if name not in data.files]
        if missing:
            raise ConfigError(str(path), f"has no array for input(s) {', '.join(missing)}; "
                                         f"it has {', '.join(data.files)}")
        arrays = {name: data[name] for name in names}
    counts = {len(array) for array in arrays.values()}
    if len(counts) != 1:
        raise ConfigError(str(path), "every input array needs the same number of samples along axis 0")
    return [{name: array[i:i + 1] for name, array in arrays.items()} for i in range(counts.pop())]


class _FeedReader:
    """onnxruntime.quantization.CalibrationDataReader over a list of feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self._feeds = iter(feeds)

    def get_next(self) -> Optional[dict[str, np.ndarray]]:
        return next(self._feeds, None)


def quantize(source: Path, target: Path, method: str, calibration: Optional[list[dict[str, np.ndarray]]] = None,
             block_size: int = 32) -> Path:
    """Write the `method` variant of the ONNX model at `source` to `target`."""
    from onnxruntime import quantization as q

    if method not in METHODS:
        raise ConfigError("method", f"unknown method {method!r}; one of {', '.join(METHODS)}")
    target.parent.mkdir(parents=True, exist_ok=True)
    if method == "int8-dynamic":
        q.quantize_dynamic(str(source), str(target), weight_type=q.QuantType.QInt8)
    elif method == "int8-static":
        if not calibration:
            raise ConfigError("calibration", "static INT8 needs calibration data (give some, or let it generate)")
        q.quantize_static(str(source), str(target), _FeedReader(calibration), quant_format=q.QuantFormat.QDQ,
                          activation_type=q.QuantType.QUInt8, weight_type=q.QuantType.QInt8, per_channel=True,
                          calibrate_method=q.CalibrationMethod.MinMax)
    else:
        try:
            from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
        except ImportError as error:  # the quantizer imports onnx_ir
            raise ConfigError("int4", f"ONNX Runtime's MatMulNBits quantizer cannot load ({error}); "
                                      "pip install onnx-ir") from None
        quantizer = MatMulNBitsQuantizer(gemm_to_matmul(onnx.load(str(source))), block_size=block_size,
                                         is_symmetric=True, accuracy_level=4)
        quantizer.process()
        quantizer.model.save_model_to_file(str(target), use_external_data_format=False)
        if "MatMulNBits" not in quantized_ops(target):
            raise ConfigError("int4", f"{source} has no MatMul with constant weights for MatMulNBits to quantize")
    return target


def gemm_to_matmul(model: onnx.ModelProto) -> onnx.ModelProto:
    """Gemm nodes with constant 2-D weights (alpha = beta = 1, A not transposed) as MatMul + Add,
    which MatMulNBits quantizes (it takes MatMul nodes only)."""
    from onnx import helper, numpy_helper

    weights = {init.name: init for init in model.graph.initializer}
    nodes = []
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (node.op_type != "Gemm" or node.input[1] not in weights or attrs.get("transA", 0)
                or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0):
            nodes.append(node)
            continue
        if attrs.get("transB", 0):
            w = weights[node.input[1]]
            w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w).T.copy(), w.name))
        name = node.name or node.output[0]
        product = node.output[0] + "_matmul" if len(node.input) > 2 else node.output[0]
        nodes.append(helper.make_node("MatMul", list(node.input[:2]), [product], name=f"{name}_matmul"))
        if len(node.input) > 2:
            nodes.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]], name=f"{name}_bias"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def quantized_ops(model_path: Path) -> dict[str, int]:
    """How many nodes of the quantized kinds the model holds (what the quantizer changed)."""
    kinds = ("MatMulNBits", "MatMulInteger", "DynamicQuantizeLinear", "QuantizeLinear", "DequantizeLinear",
             "QLinearMatMul", "DynamicQuantizeMatMul")
    counts: dict[str, int] = {}
    for node in onnx.load(str(model_path), load_external_data=False).graph.node:
        if node.op_type in kinds:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


@dataclass(frozen=True)
class Comparison:
    float_ms: float
    quantized_ms: float
    speedup: float  # float_ms / quantized_ms
    max_abs_err: float
    mean_abs_err: float
    max_rel_err: float  # max |quantized - float| / max |float|
    top1_agreement: Optional[float]  # share of rows whose argmax agrees (2-D outputs), else None
    float_bytes: int
    quantized_bytes: int


def compare(float_path: Path, quantized_path: Path, feeds: list[Mapping[str, np.ndarray]], rounds: int = 15,
            threads: int = 1) -> Comparison:
    """Both models on the same feeds, CPU provider, `threads` intra-op threads: accuracy of the
    first output over every feed, and the median of `rounds` interleaved passes over the feeds."""
    from dspark.runtimes.onnx_session import make_session_options
    import onnxruntime as ort

    sessions = [ort.InferenceSession(str(path), sess_options=make_session_options(threads),
                                     providers=["CPUExecutionProvider"]) for path in (float_path, quantized_path)]
    outputs = [[session.run(None, dict(feed))[0] for feed in feeds] for session in sessions]
    reference, candidate = (np.concatenate([o.reshape(-1, o.shape[-1]) for o in out]).astype(np.float64)
                            for out in outputs)
    delta = np.abs(candidate - reference)
    top1 = None
    if all(o.ndim == 2 for o in outputs[0]):
        top1 = float(np.mean(reference.argmax(-1) == candidate.argmax(-1)))
    timings: list[list[float]] = [[], []]
    for _ in range(rounds):
        for index, session in enumerate(sessions):
            start = time.perf_counter()
            for feed in feeds:
                session.run(None, dict(feed))
            timings[index].append(time.perf_counter() - start)
    float_ms, quantized_ms = (float(np.median(t)) * 1e3 for t in timings)
    return Comparison(float_ms=float_ms, quantized_ms=quantized_ms, speedup=float_ms / quantized_ms,
                      max_abs_err=float(delta.max()), mean_abs_err=float(delta.mean()),
                      max_rel_err=float(delta.max() / max(np.abs(reference).max(), 1e-30)), top1_agreement=top1,
                      float_bytes=float_path.stat().st_size, quantized_bytes=quantized_path.stat().st_size)
