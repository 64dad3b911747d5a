"""The onnx backend on a real tritonserver, called with tritonclient over HTTP and gRPC."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import numpy_helper
from tritonclient.utils import InferenceServerException

from dspark.paths import project_root
from tests.conftest import serving

pytestmark = pytest.mark.integration


def reference_classifier(features: np.ndarray) -> np.ndarray:
    """The demo MLP computed in float64 numpy from the weights stored in its ONNX file."""
    model = onnx.load(str(project_root() / "model_repository/mlp_classifier/1/model.onnx"))
    w = {init.name: numpy_helper.to_array(init).astype(np.float64) for init in model.graph.initializer}
    hidden = np.maximum(features @ w["w1"] + w["b1"], 0)
    logits = hidden @ w["w2"] + w["b2"]
    exp = np.exp(logits - logits.max(axis=1, keepdims=True))
    return exp / exp.sum(axis=1, keepdims=True)


def http_infer(server, model: str, arrays: dict, datatypes: dict | None = None):
    client = httpclient.InferenceServerClient(server.http_url)
    inputs = []
    for name, array in arrays.items():
        tensor = httpclient.InferInput(name, list(array.shape), (datatypes or {}).get(name, "FP32"))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return client.infer(model, inputs)


def grpc_infer(server, model: str, arrays: dict):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), "FP32")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return client.infer(model, inputs)


FEATURES = np.random.default_rng(3).standard_normal((5, 16)).astype(np.float32)


def test_demo_models_are_ready_over_both_protocols(triton_server):
    http = httpclient.InferenceServerClient(triton_server.http_url)
    grpc = grpcclient.InferenceServerClient(triton_server.grpc_url)
    for model in ("feature_scaler", "mlp_classifier", "scaled_classifier"):
        assert http.is_model_ready(model), model
        assert grpc.is_model_ready(model), model


def test_http_inference_matches_numpy_reference(triton_server):
    result = http_infer(triton_server, "mlp_classifier", {"features": FEATURES}).as_numpy("probabilities")
    assert result.shape == (5, 4) and result.dtype == np.float32
    np.testing.assert_allclose(result, reference_classifier(FEATURES.astype(np.float64)), rtol=1e-5, atol=1e-6)


def test_grpc_inference_matches_http(triton_server):
    via_grpc = grpc_infer(triton_server, "mlp_classifier", {"features": FEATURES}).as_numpy("probabilities")
    via_http = http_infer(triton_server, "mlp_classifier", {"features": FEATURES}).as_numpy("probabilities")
    np.testing.assert_array_equal(via_grpc, via_http)


def test_ensemble_standardizes_then_classifies(triton_server):
    raw = FEATURES * 2.5 + 10.0
    result = grpc_infer(triton_server, "scaled_classifier", {"raw_features": raw}).as_numpy("probabilities")
    np.testing.assert_allclose(result, reference_classifier(FEATURES.astype(np.float64)), rtol=1e-4, atol=1e-5)


def _counter(server, name: str, model: str) -> float:
    text = requests.get(server.metrics_url, timeout=10).text
    [value] = [float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'model="{model}"' in line]
    return value


def test_concurrent_requests_are_batched_and_each_gets_its_own_rows(triton_server):
    """The batch counters move: fewer ONNX Runtime runs than requests, every row counted once."""
    batches_before = _counter(triton_server, "dspark_onnx_batches_total", "mlp_classifier")
    rows_before = _counter(triton_server, "dspark_onnx_batch_rows_total", "mlp_classifier")
    senders, per_sender = 8, 4
    rows = [np.random.default_rng(i).standard_normal((1 + i % 3, 16)).astype(np.float32)
            for i in range(senders * per_sender)]
    results = [None] * len(rows)
    start = threading.Barrier(senders)

    def send(first: int) -> None:  # one client per thread: requests really are concurrent
        client = httpclient.InferenceServerClient(triton_server.http_url)
        start.wait()
        for i in range(first, len(rows), senders):
            tensor = httpclient.InferInput("features", list(rows[i].shape), "FP32")
            tensor.set_data_from_numpy(rows[i])
            results[i] = client.infer("mlp_classifier", [tensor]).as_numpy("probabilities")

    threads = [threading.Thread(target=send, args=(first,)) for first in range(senders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for array, result in zip(rows, results):
        np.testing.assert_allclose(result, reference_classifier(array.astype(np.float64)), rtol=1e-5, atol=1e-6)
    batches = _counter(triton_server, "dspark_onnx_batches_total", "mlp_classifier") - batches_before
    batched_rows = _counter(triton_server, "dspark_onnx_batch_rows_total", "mlp_classifier") - rows_before
    assert batched_rows == sum(len(array) for array in rows)
    assert 1 <= batches < len(rows), f"{len(rows)} requests ran as {batches} batches"


@pytest.mark.parametrize(
    "arrays, datatypes, expected_words",
    [
        ({"features": FEATURES.astype(np.int32)}, {"features": "INT32"}, ["features", "FP32"]),
        ({"features": np.zeros((2, 7), np.float32)}, None, ["features", "shape"]),
        ({}, None, ["features"]),
    ],
    ids=["wrong-dtype", "wrong-shape", "missing-input"],
)
def test_bad_input_gets_an_error_naming_the_tensor_and_the_model_keeps_serving(
        triton_server, arrays, datatypes, expected_words):
    with pytest.raises(InferenceServerException) as raised:
        http_infer(triton_server, "mlp_classifier", arrays, datatypes)
    message = str(raised.value)
    for word in expected_words:
        assert word in message, message
    good = http_infer(triton_server, "mlp_classifier", {"features": FEATURES}).as_numpy("probabilities")
    np.testing.assert_allclose(good.sum(axis=1), 1.0, rtol=1e-5)


def test_backend_metrics_reach_the_metrics_endpoint(triton_server):
    before = _counter(triton_server, "dspark_onnx_batches_total", "mlp_classifier")
    http_infer(triton_server, "mlp_classifier", {"features": FEATURES})
    assert _counter(triton_server, "dspark_onnx_batches_total", "mlp_classifier") == before + 1


def write_shaped_graph(folder: Path) -> None:
    """A model whose graph names its dimensions: ``scores = (tokens + positions) + keys``, tokens
    and positions of length T, keys of length S (that S must equal T the graph does not declare)."""
    from onnx import TensorProto, helper

    from dspark.repository.modelspec import ModelSpec

    def tensor(name: str, dim: str):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, dim])

    graph = helper.make_graph(
        [helper.make_node("Add", ["tokens", "positions"], ["summed"]),
         helper.make_node("Add", ["summed", "keys"], ["scores"])], "shaped",
        [tensor("tokens", "T"), tensor("positions", "T"), tensor("keys", "S")], [tensor("scores", "T")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (folder / "1").mkdir(parents=True)
    onnx.save(model, str(folder / "1" / "model.onnx"))
    spec = ModelSpec.from_dict({"name": folder.name, "framework": "onnx", "max_batch_size": 0,
                                "versions": [{"semver": "1.0.0", "folder": 1, "artifact": "model.onnx"}],
                                "instance_groups": [{"kind": "CPU", "count": 1}]})
    (folder / "config.pbtxt").write_text(spec.config_text())


@pytest.fixture(scope="module")
def shaped_graph_server(request, tmp_path_factory):
    """A graph with named dimensions (write_shaped_graph) on the onnx backend."""
    repository = tmp_path_factory.mktemp("onnx_repository")
    write_shaped_graph(repository / "shaped")
    with serving(request, [repository]) as server:
        yield server


def shaped_inputs(tokens: int, keys: int, positions: int | None = None) -> dict:
    return {"tokens": np.ones((1, tokens), np.float32), "positions": np.ones((1, positions or tokens), np.float32),
            "keys": np.ones((1, keys), np.float32)}


@pytest.mark.parametrize("shapes, words", [
    ({"tokens": 3, "keys": 3, "positions": 4},
     ["input tensors 'tokens' and 'positions': disagree on dimension 'T'", "tokens has 3, positions has 4"]),
    ({"tokens": 3, "keys": 7},
     ["input tensors 'tokens', 'positions', 'keys': are inconsistent with each other (sizes T=3, S=7)",
      "broadcast"]),
], ids=["named-dim", "undeclared-relation"])
def test_inputs_inconsistent_with_each_other_get_invalid_arg_naming_them(shaped_graph_server, shapes, words):
    """Each tensor passes Triton's own check; together they do not fit the graph."""
    with pytest.raises(InferenceServerException) as raised:
        http_infer(shaped_graph_server, "shaped", shaped_inputs(**shapes))
    assert raised.value.status() == "400", raised.value
    for word in words:
        assert word in str(raised.value)
    scores = http_infer(shaped_graph_server, "shaped", shaped_inputs(tokens=3, keys=3)).as_numpy("scores")
    np.testing.assert_array_equal(scores, np.full((1, 3), 3.0, np.float32))
