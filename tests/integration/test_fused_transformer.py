"""The fused_transformer backend on the real server, against the same network in the onnx backend."""
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from dspark.paths import project_root

pytestmark = pytest.mark.integration

VOCAB, MAX_POSITIONS, D_MODEL = 512, 128, 256


def _infer(client_module, url, model, ids, dtype="INT64"):
    client = client_module.InferenceServerClient(url)
    tensor = client_module.InferInput("INPUT_IDS", list(ids.shape), dtype)
    tensor.set_data_from_numpy(ids)
    return client.infer(model, [tensor]).as_numpy("HIDDEN")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 24), (2, 128)])
def test_matches_onnx_runtime_within_1e4(triton_server, protocol, shape):
    module, url = ((httpclient, triton_server.http_url) if protocol == "http"
                   else (grpcclient, triton_server.grpc_url))
    ids = np.random.default_rng(sum(shape)).integers(0, VOCAB, shape).astype(np.int64)
    fused = _infer(module, url, "fused_transformer", ids)
    reference = _infer(module, url, "fused_transformer_onnx", ids)
    assert fused.shape == reference.shape == (*shape, D_MODEL)
    assert np.abs(fused - reference).max() / np.abs(reference).max() < 1e-4


@pytest.mark.parametrize("ids,dtype,match", [
    (np.zeros((1, 4), np.float32), "FP32", "INPUT_IDS"),
    (np.zeros((1, MAX_POSITIONS + 1), np.int64), "INT64", "INPUT_IDS: sequence length 129 is outside 1..128"),
    (np.full((1, 3), VOCAB, np.int64), "INT64", "INPUT_IDS: token ids must be in 0..511"),
])
def test_bad_requests_get_invalid_arg_naming_the_tensor(triton_server, ids, dtype, match):
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    tensor = grpcclient.InferInput("INPUT_IDS", list(ids.shape), dtype)
    tensor.set_data_from_numpy(ids)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("fused_transformer", [tensor])
    assert match in caught.value.message()
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    # and the model keeps serving
    ok = _infer(grpcclient, triton_server.grpc_url, "fused_transformer", np.zeros((1, 2), np.int64))
    assert ok.shape == (1, 2, D_MODEL)


def test_pool_gauge_is_exported(triton_server):
    import requests

    _infer(httpclient, triton_server.http_url, "fused_transformer", np.zeros((1, 5), np.int64))
    metrics = requests.get(triton_server.metrics_url, timeout=10).text
    line = next(line for line in metrics.splitlines()
                if line.startswith("dspark_fused_pool_bytes_in_use") and 'model="fused_transformer"' in line)
    with np.load(project_root() / "model_repository/fused_transformer/1/weights.npz") as weights:
        weight_bytes = sum(weights[name].nbytes for name in weights.files if name != "config_json")
    assert weight_bytes <= float(line.split()[-1]) <= weight_bytes * 1.01 + (1 << 20)  # the weights live in the pool


def test_log_says_how_it_was_loaded(triton_server):
    from dspark.kernels.dispatch import dispatch_report

    line = next(line for line in triton_server.log_text().splitlines()
                if "fused_transformer: loaded fused_transformer " in line)
    assert f"SIMD {dispatch_report().best}" in line
    assert "pool on" in line and "numa_node 0" in line
