"""`dspark serve` on a repository where one model cannot load: the reason is shown (also when it
mentions the GPU), and --keep-serving serves the other models."""
from __future__ import annotations

import shutil
from unittest import mock

import numpy as np
import pytest
import tritonclient.http as httpclient
from click.testing import CliRunner

from dspark.cli.main import cli
from dspark.paths import project_root
from dspark.server.launcher import ServerPorts

pytestmark = pytest.mark.integration

CLASSIFIER = project_root() / "model_repository/mlp_classifier"
# Triton's reason names the GPU on any machine: "... has kind KIND_GPU but no GPUs are available"
# without one, "... specifies invalid or unsupported gpu id 99. GPUs with at least the minimum
# required CUDA compute compatibility ..." with one
GPU_REASON = "failed to load 'on_gpu' version 1: Invalid argument: instance group on_gpu_0 of model on_gpu "


@pytest.fixture
def repository(tmp_path):
    """Two copies of the demo classifier: `classifier`, and `on_gpu` asking for GPU 99."""
    for name, kind in (("classifier", "KIND_CPU"), ("on_gpu", "KIND_GPU gpus: [ 99 ]")):
        (tmp_path / name / "1").mkdir(parents=True)
        shutil.copy(CLASSIFIER / "1/model.onnx", tmp_path / name / "1/model.onnx")
        config = (CLASSIFIER / "config.pbtxt").read_text()
        (tmp_path / name / "config.pbtxt").write_text(
            config.replace('name: "mlp_classifier"', f'name: "{name}"').replace("KIND_CPU", kind))
    return tmp_path


def serve(repository, *options, while_serving=None):
    ports = ServerPorts.free()
    seen = {}

    def instead_of_waiting(server, _api=None, _ready=""):
        seen["answer"] = while_serving(server) if while_serving else None
        server.stop()

    with mock.patch("dspark.cli.serve.serve_until_signal", instead_of_waiting):
        result = CliRunner().invoke(cli, ["serve", "-r", str(repository), f"--http-port={ports.http}",
                                          f"--grpc-port={ports.grpc}", f"--metrics-port={ports.metrics}", *options])
    return result, seen


def test_a_model_that_fails_to_load_is_named_with_its_gpu_reason(repository):
    result, _ = serve(repository)
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dspark: tritonserver exited with code 1 before it was ready: ")
    assert GPU_REASON in lines[0] and "GPU" in lines[0].split(GPU_REASON)[1]


def test_keep_serving_serves_the_other_models_and_says_why_one_failed(repository):
    def ask(server):
        client = httpclient.InferenceServerClient(server.http_url)
        tensor = httpclient.InferInput("features", [1, 16], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 16), np.float32))
        return (client.infer("classifier", [tensor]).as_numpy("probabilities"),
                client.is_model_ready("classifier"), client.is_model_ready("on_gpu"))

    result, seen = serve(repository, "--keep-serving", while_serving=ask)
    assert result.exit_code == 0, result.output
    warning = next(line for line in result.output.splitlines() if line.startswith("dspark: warning: "))
    assert warning.startswith(f"dspark: warning: {GPU_REASON}") and "GPU" in warning.split(GPU_REASON)[1]
    assert warning.endswith("(serving the other models: --keep-serving)")
    probabilities, classifier_ready, gpu_ready = seen["answer"]
    assert probabilities.shape == (1, 4) and np.isclose(probabilities.sum(), 1, atol=1e-5)
    assert classifier_ready and not gpu_ready
