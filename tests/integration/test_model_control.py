"""A server with explicit model control: the model-repository API behind a key, loopback only,
configuration errors that name their parameter, and onnx models loaded, reloaded and unloaded
while requests are in flight."""
from __future__ import annotations

import json
import shutil
import socket
import threading
import time

import numpy as np
import psutil
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from dspark.paths import project_root
from dspark.triton.server import API_KEY_HEADER, GRPC_API_KEY_HEADER
from tests.conftest import serving

pytestmark = pytest.mark.integration

DEMO = project_root() / "model_repository"
ONNX_CLASSIFIER = DEMO / "mlp_classifier/1/model.onnx"
CLASSIFIER_CONFIG = """
name: "{name}"
backend: "onnx"
max_batch_size: 8
input {{ name: "features" data_type: TYPE_FP32 dims: [ {dims} ] }}
output {{ name: "probabilities" data_type: TYPE_FP32 dims: [ 4 ] }}
dynamic_batching {{ max_queue_delay_microseconds: 200 }}
{extra}
"""


def _onnx_model(repository, name: str, dims: str = "16", extra: str = "") -> None:
    (repository / name / "1").mkdir(parents=True)
    shutil.copy(ONNX_CLASSIFIER, repository / name / "1/model.onnx")
    (repository / name / "config.pbtxt").write_text(CLASSIFIER_CONFIG.format(name=name, dims=dims, extra=extra))


@pytest.fixture(scope="module")
def control_server(tmp_path_factory, request):
    repository = tmp_path_factory.mktemp("control_repository")
    _onnx_model(repository, "classifier")
    _onnx_model(repository, "loose_classifier", dims="-1")  # looser than the graph's [batch, 16]
    _onnx_model(repository, "bad_level", extra='parameters { key: "graph_optimization_level" value { string_value: "fast" } }')
    fused = repository / "bad_numa"
    (fused / "1").mkdir(parents=True)
    (fused / "1/weights.npz").symlink_to(DEMO / "fused_transformer/1/weights.npz")
    (fused / "config.pbtxt").write_text((DEMO / "fused_transformer/config.pbtxt").read_text()
                                        .replace('name: "fused_transformer"', 'name: "bad_numa"')
                                        .replace('string_value: "0"', 'string_value: "x"'))
    with serving(request, [repository], model_control="explicit",
                 load_models=["classifier", "loose_classifier"]) as server:
        yield server


def _features(rows: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 16)).astype(np.float32)


def _infer(server, model: str, array: np.ndarray, timeout_s: float = 30):
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=timeout_s)
    tensor = httpclient.InferInput("features", list(array.shape), "FP32")
    tensor.set_data_from_numpy(array)
    return client.infer(model, [tensor]).as_numpy("probabilities")


def test_the_repository_api_needs_the_key_over_http_and_grpc(control_server):
    http = httpclient.InferenceServerClient(control_server.http_url)
    grpc = grpcclient.InferenceServerClient(control_server.grpc_url)
    wrong = {API_KEY_HEADER: "not-the-key-000000000", GRPC_API_KEY_HEADER: "not-the-key-000000000"}
    for headers in ({}, wrong):
        with pytest.raises(InferenceServerException, match="restricted, expecting header 'dspark-api-key'"):
            http.load_model("classifier", headers=headers)
        with pytest.raises(InferenceServerException, match="expecting header 'triton-grpc-protocol-dspark-api-key'"):
            grpc.unload_model("classifier", headers=headers)
        with pytest.raises(InferenceServerException, match="restricted"):
            http.get_model_repository_index(headers=headers)
    assert http.is_model_ready("classifier")  # nothing was unloaded
    headers = control_server.repository_headers
    http.load_model("classifier", headers=headers)
    grpc.load_model("classifier", headers=headers)
    index = {entry["name"]: entry for entry in http.get_model_repository_index(headers=headers)}
    assert index["classifier"]["state"] == "READY"
    assert _infer(control_server, "classifier", _features()).shape == (2, 4)


def _non_loopback_addresses() -> list[str]:
    return [address.address for addresses in psutil.net_if_addrs().values() for address in addresses
            if address.family == socket.AF_INET and not address.address.startswith("127.")]


def test_the_server_listens_on_loopback_only(control_server):
    """Triton was told to bind 127.0.0.1, and this machine's other addresses refuse connections."""
    server_process = psutil.Process(control_server._process.pid)
    listening = {(c.laddr.ip.removeprefix("::ffff:"), c.laddr.port)  # gRPC: IPv4-mapped on a v6 socket
                 for c in server_process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    ports = control_server.ports
    assert listening == {("127.0.0.1", ports.http), ("127.0.0.1", ports.grpc), ("127.0.0.1", ports.metrics)}
    for address in _non_loopback_addresses():
        for port in (ports.http, ports.grpc, ports.metrics):
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((address, port), timeout=5).close()


@pytest.mark.parametrize("model, words", [
    ("bad_level", ["parameter 'graph_optimization_level'", "'disable', 'basic', 'extended' or 'all'", "got 'fast'"]),
    ("bad_numa", ["parameter 'numa_node'", "valid integer", "got 'x'"]),
])
def test_a_bad_config_parameter_fails_the_load_naming_it_and_the_server_keeps_serving(control_server, model, words):
    client = httpclient.InferenceServerClient(control_server.http_url)
    with pytest.raises(InferenceServerException) as raised:
        client.load_model(model, headers=control_server.repository_headers)
    for word in words:
        assert word in str(raised.value)
    assert not client.is_model_ready(model)
    np.testing.assert_allclose(_infer(control_server, "classifier", _features()).sum(axis=1), 1.0, rtol=1e-5)


def test_a_shape_tritons_check_lets_through_gets_invalid_arg_from_dspark(control_server):
    """The config says [-1] where the graph says [batch, 16]: Triton passes [2, 7], dspark refuses it."""
    with pytest.raises(InferenceServerException) as raised:
        _infer(control_server, "loose_classifier", np.zeros((2, 7), np.float32))
    assert raised.value.status() == "400"
    assert "input tensor 'features': has shape [2, 7], the ONNX graph expects [batch, 16]" in str(raised.value)
    assert _infer(control_server, "loose_classifier", _features()).shape == (2, 4)


def _stub_processes(server) -> list[psutil.Process]:
    return [p for p in psutil.Process(server._process.pid).children(recursive=True)
            if "triton_python_backend_stub" in " ".join(p.cmdline())]


def _metric_lines(server, name: str, model: str) -> list[str]:
    text = requests.get(server.metrics_url, timeout=10).text
    return [line for line in text.splitlines() if line.startswith(name) and f'model="{model}"' in line]


def test_reload_unload_and_load_with_requests_in_flight(control_server):
    """Every request gets an answer: the right probabilities, or (while the model is unloaded) a
    clean 'unknown model' error (404); no stub or metric family is left behind."""
    client = httpclient.InferenceServerClient(control_server.http_url)
    headers = control_server.repository_headers
    expected = _infer(control_server, "classifier", _features(3, seed=7))
    stubs_before = len(_stub_processes(control_server))
    outcomes: list[tuple[str, str]] = []
    stop = threading.Event()

    def keep_sending():
        while not stop.is_set():
            try:
                result = _infer(control_server, "classifier", _features(3, seed=7), timeout_s=60)
                outcomes.append(("ok", "") if np.allclose(result, expected, rtol=1e-5) else ("wrong", str(result)))
            except InferenceServerException as error:
                outcomes.append(("error", str(error)))

    senders = [threading.Thread(target=keep_sending) for _ in range(3)]
    for sender in senders:
        sender.start()
    try:
        time.sleep(0.5)
        config = client.get_model_config("classifier")
        config["parameters"] = {"intra_op_threads": {"string_value": "2"}}
        client.load_model("classifier", headers=headers, config=json.dumps(config))  # reload, new config
        time.sleep(0.5)
        assert client.get_model_config("classifier")["parameters"]["intra_op_threads"]["string_value"] == "2"
        client.unload_model("classifier", headers=headers, unload_dependents=False)
        deadline = time.monotonic() + 30
        while client.is_model_ready("classifier") and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        client.load_model("classifier", headers=headers)
        time.sleep(0.5)
    finally:
        stop.set()
        for sender in senders:
            sender.join(timeout=90)
    assert not any(sender.is_alive() for sender in senders), "a request never got an answer"
    kinds = [kind for kind, _ in outcomes]
    assert "wrong" not in kinds, [o for o in outcomes if o[0] == "wrong"][:3]
    errors = [message for kind, message in outcomes if kind == "error"]
    assert all(word in m for m in errors for word in ("unknown model", "classifier")), errors[:3]
    assert kinds.count("ok") >= 10 and kinds[-1] == "ok"
    assert len(_stub_processes(control_server)) == stubs_before
    assert len(_metric_lines(control_server, "dspark_onnx_batches_total", "classifier")) == 1
