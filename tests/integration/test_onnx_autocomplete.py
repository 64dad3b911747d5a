"""A model whose config names only the backend gets inputs, outputs and batching from its ONNX file."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import tritonclient.http as httpclient

from dspark.paths import project_root
from tests.conftest import serving

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def bare_config_server(tmp_path_factory, request):

    repository = tmp_path_factory.mktemp("repository")
    model_dir = repository / "bare_classifier"
    (model_dir / "1").mkdir(parents=True)
    shutil.copy(project_root() / "model_repository/mlp_classifier/1/model.onnx", model_dir / "1/model.onnx")
    (model_dir / "config.pbtxt").write_text('backend: "onnx"\n')
    with serving(request, [repository]) as server:
        yield server


def test_config_is_completed_from_the_onnx_graph(bare_config_server):
    client = httpclient.InferenceServerClient(bare_config_server.http_url)
    config = client.get_model_config("bare_classifier")
    assert config["max_batch_size"] == 8
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [("features", "TYPE_FP32", [16])]
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["output"]] == [("probabilities", "TYPE_FP32", [4])]
    tensor = httpclient.InferInput("features", [3, 16], "FP32")
    tensor.set_data_from_numpy(np.ones((3, 16), np.float32))
    result = client.infer("bare_classifier", [tensor]).as_numpy("probabilities")
    assert result.shape == (3, 4)
