"""The onnx backend on a real tritonserver, called with tritonclient over HTTP and gRPC."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import numpy_helper
from tritonclient.utils import InferenceServerException

from dspark.paths import project_root

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


def test_concurrent_requests_are_batched_and_each_gets_its_own_rows(triton_server):
    client = httpclient.InferenceServerClient(triton_server.http_url, concurrency=8)
    rows = [np.random.default_rng(i).standard_normal((1 + i % 3, 16)).astype(np.float32) for i in range(24)]
    pending = []
    for array in rows:
        tensor = httpclient.InferInput("features", list(array.shape), "FP32")
        tensor.set_data_from_numpy(array)
        pending.append(client.async_infer("mlp_classifier", [tensor]))
    for array, job in zip(rows, pending):
        np.testing.assert_allclose(job.get_result().as_numpy("probabilities"),
                                   reference_classifier(array.astype(np.float64)), rtol=1e-5, atol=1e-6)


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
    http_infer(triton_server, "mlp_classifier", {"features": FEATURES})
    text = requests.get(triton_server.metrics_url, timeout=10).text
    runs = [line for line in text.splitlines()
            if line.startswith("dspark_onnx_batches_total") and 'model="mlp_classifier"' in line]
    assert runs and float(runs[0].split()[-1]) >= 1
