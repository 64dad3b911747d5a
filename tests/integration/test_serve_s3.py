"""`dspark serve -r s3://host:port/bucket/path`: a repository in S3 (a moto server on loopback),
served as given, not as a local path."""
from __future__ import annotations

import socket
from unittest import mock

import numpy as np
import pytest
import tritonclient.http as httpclient
from click.testing import CliRunner

from dspark.cli.main import cli
from dspark.paths import project_root
from dspark.rollout import demo
from dspark.server.launcher import ServerPorts

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_reads_a_repository_from_s3(tmp_path):
    s3 = demo.serve_s3(free_port())
    try:
        url = f"s3://127.0.0.1:{s3._port}/models/repo"
        demo.publish_to_s3(project_root() / "model_repository", url, models=("mlp_classifier",))
        ports, seen = ServerPorts.free(), {}

        def ask(server, _api=None, _ready=""):
            client = httpclient.InferenceServerClient(server.http_url)
            tensor = httpclient.InferInput("features", [1, 16], "FP32")
            tensor.set_data_from_numpy(np.ones((1, 16), np.float32))
            seen["probabilities"] = client.infer("mlp_classifier", [tensor]).as_numpy("probabilities")
            client.close()  # Triton's shutdown waits out its exit timeout for an open connection
            server.stop()

        with mock.patch("dspark.cli.serve.serve_until_signal", ask):
            result = CliRunner().invoke(cli, ["serve", "-r", url, f"--http-port={ports.http}",
                                              f"--grpc-port={ports.grpc}", f"--metrics-port={ports.metrics}"])
    finally:
        s3.stop()
    assert result.exit_code == 0, result.output
    assert f"dspark: serving {url}" in result.output
    assert seen["probabilities"].shape == (1, 4) and np.isclose(seen["probabilities"].sum(), 1, atol=1e-5)
