"""A server with explicit model control: the model-repository, shared-memory, logging, trace and
statistics APIs behind a key (in every control mode) that no other local user can read, owner-only
IPC regions, loopback only, configuration errors that name their parameter, and onnx models
loaded, reloaded and unloaded while requests are in flight."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as client_shm
from tritonclient.utils import InferenceServerException

from dspark.paths import project_root
from dspark.server.launcher import shared_memory_regions
from dspark.server.access import API_KEY_ENV, API_KEY_HEADER, GRPC_API_KEY_HEADER
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
    # The key comes from the environment, as `dspark serve` and the Kubernetes entrypoint take it.
    key = secrets.token_urlsafe(32)
    with pytest.MonkeyPatch.context() as environment:
        environment.setenv(API_KEY_ENV, key)
        with serving(request, [repository], model_control="explicit", api_key=key,
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


HTTP_REFUSAL = "This API is restricted, expecting header 'dspark-api-key'"
GRPC_REFUSAL = "This protocol is restricted, expecting header 'triton-grpc-protocol-dspark-api-key'"


def _restricted_calls(stub_region: str) -> list[tuple[str, tuple, dict]]:
    """(client method, arguments, keyword arguments) of every restricted call but the repository's;
    the first is the crash recipe's first step: a model stub's IPC region as a client's region."""
    return [
        ("register_system_shared_memory", ("stolen", f"/{stub_region}", 4096), {}),
        ("get_system_shared_memory_status", (), {}),
        ("unregister_system_shared_memory", (), {}),
        ("register_cuda_shared_memory", ("gpu", b"\0" * 64, 0, 4096), {}),
        ("get_cuda_shared_memory_status", (), {}),
        ("unregister_cuda_shared_memory", (), {}),
        ("get_log_settings", (), {}),
        ("update_log_settings", ({"log_verbose_level": 1},), {}),
        ("get_trace_settings", (), {}),
        ("update_trace_settings", (), {"settings": {"trace_level": ["TIMESTAMPS"]}}),
        ("get_inference_statistics", (), {}),
    ]


def _open_calls(client, calls, headers: dict, refusal: str) -> list[str]:
    """The calls that were not refused with `refusal`."""
    open_calls = []
    for name, args, kwargs in calls:
        try:
            getattr(client, name)(*args, headers=headers, **kwargs)
            open_calls.append(name)
        except InferenceServerException as error:
            if refusal not in str(error):
                open_calls.append(f"{name}: {error}")
    return open_calls


@pytest.mark.parametrize("fixture, model", [("triton_server", "mlp_classifier"), ("control_server", "classifier")])
def test_shared_memory_logging_trace_and_statistics_need_the_key_in_every_control_mode(request, fixture, model):
    """Without the key (or with a wrong one) every call is refused over HTTP and gRPC, registering
    a stub's IPC region included (which crashed the server once another model's output was written
    into it), and nothing is registered or changed; with the key a client's own region registers."""
    server = request.getfixturevalue(fixture)
    http = httpclient.InferenceServerClient(server.http_url)
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    calls = _restricted_calls(sorted(shared_memory_regions(server._process.pid))[0].name)
    wrong = {API_KEY_HEADER: "not-the-key-000000000", GRPC_API_KEY_HEADER: "not-the-key-000000000"}
    for headers in ({}, wrong):
        assert _open_calls(http, calls, headers, HTTP_REFUSAL) == []
        assert _open_calls(grpc, calls, headers, GRPC_REFUSAL) == []
    key = server.repository_headers
    assert http.get_system_shared_memory_status(headers=key) == []
    assert http.get_log_settings(headers=key)["log_verbose_level"] == 0
    assert http.get_trace_settings(headers=key)["trace_level"] == ["OFF"]
    assert model in {m["name"] for m in http.get_inference_statistics(headers=key)["model_stats"]}
    assert "log_info" in grpc.get_log_settings(headers=key, as_json=True)["settings"]
    regions = {name: (f"/dspark-test-{secrets.token_hex(6)}", client) for name, client in
               (("client_http", http), ("client_grpc", grpc))}
    handles = [client_shm.create_shared_memory_region(name, shm_key, 64) for name, (shm_key, _) in regions.items()]
    try:
        for name, (shm_key, client) in regions.items():
            client.register_system_shared_memory(name, shm_key, 64, headers=key)
        assert {r["name"] for r in http.get_system_shared_memory_status(headers=key)} == set(regions)
        http.unregister_system_shared_memory(headers=key)
        assert http.get_system_shared_memory_status(headers=key) == []
    finally:
        for handle in handles:
            client_shm.destroy_shared_memory_region(handle)
    assert http.is_model_ready(model)


def _read_as_another_user(path: str) -> bytes:
    """The file as an unprivileged user reads it (nobody, when the tests run as root)."""
    if os.geteuid() != 0:
        return Path(path).read_bytes()
    return subprocess.run(["cat", path], user="nobody", capture_output=True, check=True).stdout


def test_the_key_is_in_no_process_list_no_environment_and_no_log(control_server):
    key = control_server.api_key.encode()
    server_pid = control_server._process.pid
    command_line = _read_as_another_user(f"/proc/{server_pid}/cmdline")  # what `ps` shows every user
    assert b"--http-restricted-api=" in command_line and key not in command_line
    stubs = _stub_processes(control_server)
    assert len(stubs) >= 2  # classifier, loose_classifier
    for pid in (server_pid, *(stub.pid for stub in stubs)):
        environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert [v for v in environment if key in v or v.startswith(API_KEY_ENV.encode() + b"=")] == [], pid
    assert key.decode() not in control_server.log_text()
    http = httpclient.InferenceServerClient(control_server.http_url)
    assert http.get_log_settings(headers=control_server.repository_headers)  # the server does hold it


def test_the_model_stubs_ipc_regions_are_owner_only(control_server):
    """They carry every request and response of a model: no other local user may read them."""
    regions = shared_memory_regions(control_server._process.pid)
    assert len(regions) >= 2
    modes = {region.name: oct(stat.S_IMODE(region.stat().st_mode)) for region in regions}
    assert set(modes.values()) == {"0o600"}, modes
    if os.geteuid() == 0:
        read = subprocess.run(["cat", str(min(regions))], user="nobody", capture_output=True)
        assert read.returncode == 1 and b"Permission denied" in read.stderr


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
