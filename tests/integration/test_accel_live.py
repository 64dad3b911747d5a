"""The accelerator layer on a real tritonserver, on this CPU-only machine.

Execution-provider preference: a model asking for [CUDA, CPU] serves on CPU with one warning and a
fallback metric; the same model with fallback forbidden, or with a misspelled provider option,
fails to load with an error that names the cause. The fused transformer with `matmul: gemm` runs
every product through the GemmEx shim (device auto: the CPU here) and matches the fused engine.
`dspark quantize --int8` adds a version of the demo classifier that Triton serves."""
from __future__ import annotations

import re
import shutil

import numpy as np
import onnxruntime as ort
import pytest
import requests
import tritonclient.http as httpclient
from click.testing import CliRunner

from dspark.cli.main import cli
from dspark.runtimes.fused_transformer import FusedTransformer
from dspark.paths import project_root
from dspark.repository.modelspec import ExecutionProvider, ModelSpec, TensorSpec, VersionRecord
from tests.conftest import serving

pytestmark = pytest.mark.integration

CLASSIFIER = project_root() / "model_repository/mlp_classifier/1/model.onnx"
TRANSFORMER = project_root() / "model_repository/fused_transformer/1/weights.npz"
MODELS = {
    "ep_fallback": dict(execution_providers=[ExecutionProvider("CUDA"), ExecutionProvider("CPU")]),
    "ep_strict": dict(execution_providers=[ExecutionProvider("CUDA"), ExecutionProvider("CPU")],
                      disable_cpu_ep_fallback=True),
    # written as raw parameters: a ModelSpec would refuse the misspelling before Triton sees it
    "ep_misspelled": dict(parameters={"execution_providers": "CUDA,CPU",
                                      "execution_provider_options": '{"CUDA": {"devce_id": "0"}}'}),
}


@pytest.fixture(scope="module")
def provider_server(request, tmp_path_factory):
    repository = tmp_path_factory.mktemp("providers")
    for name, fields in MODELS.items():
        spec = ModelSpec(name=name, framework="onnx", versions=[VersionRecord("1.0.0", 1)], max_batch_size=8,
                         inputs=[TensorSpec("features", "FP32", [16])],
                         outputs=[TensorSpec("probabilities", "FP32", [4])], **fields)
        (repository / name / "1").mkdir(parents=True)
        shutil.copy(CLASSIFIER, repository / name / "1" / "model.onnx")
        (repository / name / "config.pbtxt").write_text(spec.config_text())
    # the demo transformer, every product through the shim under the MUSA name, bf16 on this CPU
    spec = ModelSpec(name="transformer_gemm", framework="python", backend="fused_transformer",
                     default_model_filename="weights.npz", versions=[VersionRecord("1.0.0", 1)], max_batch_size=8,
                     inputs=[TensorSpec("INPUT_IDS", "INT64", [-1])], outputs=[TensorSpec("HIDDEN", "FP32", [-1, 256])],
                     parameters={"matmul": "gemm", "gemm_vendor": "mublas", "gemm_device": "auto",
                                 "gemm_compute": "bf16"})
    (repository / spec.name / "1").mkdir(parents=True)
    shutil.copy(TRANSFORMER, repository / spec.name / "1" / "weights.npz")
    (repository / spec.name / "config.pbtxt").write_text(spec.config_text())
    # the demo classifier with an INT8 version 2 made by `dspark quantize` (Triton serves the newest)
    shutil.copytree(CLASSIFIER.parent.parent, repository / "mlp_classifier")
    quantized = CliRunner().invoke(cli, ["quantize", "mlp_classifier", "--int8", "--repository", str(repository),
                                         "--rounds", "1", "--samples", "4"])
    assert quantized.exit_code == 0, quantized.output
    # Keep serving the models that load; the others' errors stay readable in the repository index.
    with serving(request, [repository], extra_args=["--exit-on-error=false", "--strict-readiness=false"]) as server:
        yield server


def model_states_all(server) -> list[dict]:
    return requests.post(f"http://{server.http_url}/v2/repository/index", json={}, headers=server.repository_headers,
                         timeout=10).json()


def model_states(server) -> dict[str, dict]:
    return {entry["name"]: entry for entry in model_states_all(server)}


def test_cuda_then_cpu_serves_on_cpu_with_one_warning_and_a_fallback_metric(provider_server):
    client = httpclient.InferenceServerClient(provider_server.http_url)
    features = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    tensor = httpclient.InferInput("features", [3, 16], "FP32")
    tensor.set_data_from_numpy(features)
    probabilities = client.infer("ep_fallback", [tensor]).as_numpy("probabilities")
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)

    warnings = [line for line in provider_server.log_text().splitlines()
                if line.startswith("W") and "ep_fallback" in line]
    assert len(warnings) == 1, warnings
    assert "runs on CPUExecutionProvider" in warnings[0] and "CUDAExecutionProvider not usable" in warnings[0]

    metrics = requests.get(provider_server.metrics_url, timeout=10).text
    fallback = re.search(r'dspark_execution_provider_fallback_total\{([^}]*)\} (\d+)', metrics)
    assert fallback and 'model="ep_fallback"' in fallback.group(1), metrics
    assert 'requested="CUDAExecutionProvider"' in fallback.group(1)
    assert 'chosen="CPUExecutionProvider"' in fallback.group(1)
    assert fallback.group(2) == "1"
    chosen = re.search(r'dspark_execution_provider\{([^}]*model="ep_fallback"[^}]*)\} 1', metrics)
    assert chosen and 'provider="CPUExecutionProvider"' in chosen.group(1) and 'reason="fallback"' in chosen.group(1)


def test_fallback_forbidden_fails_the_load_naming_the_missing_provider(provider_server):
    state = model_states(provider_server)["ep_strict"]
    assert state["state"] == "UNAVAILABLE"
    assert "CUDAExecutionProvider is not usable here" in state["reason"]
    assert "disable_cpu_ep_fallback is set" in state["reason"]


def test_a_misspelled_provider_option_fails_the_load_naming_the_known_ones(provider_server):
    state = model_states(provider_server)["ep_misspelled"]
    assert state["state"] == "UNAVAILABLE"
    assert "has no option 'devce_id' (did you mean device_id?)" in state["reason"]
    assert "gpu_mem_limit" in state["reason"] and "cudnn_conv_algo_search" in state["reason"]


def test_the_transformer_runs_its_products_through_the_shim_and_matches_the_fused_engine(provider_server):
    ids = np.random.default_rng(1).integers(0, 512, (2, 24)).astype(np.int64)
    tensor = httpclient.InferInput("INPUT_IDS", list(ids.shape), "INT64")
    tensor.set_data_from_numpy(ids)
    hidden = httpclient.InferenceServerClient(provider_server.http_url).infer(
        "transformer_gemm", [tensor]).as_numpy("HIDDEN")
    reference = FusedTransformer.load(TRANSFORMER, use_pool=False).forward(ids)
    assert hidden.shape == reference.shape == (2, 24, 256)
    # bf16 products (FAST_16BF) on LayerNorm-ed activations: the output is LayerNorm-ed too
    assert np.abs(hidden - reference).max() < 0.1 and np.abs(hidden - reference).mean() < 0.01
    loaded = [line for line in provider_server.log_text().splitlines() if "loaded transformer_gemm" in line]
    assert len(loaded) == 1 and "mublasGemmEx on the CPU" in loaded[0] and "COMPUTE_32F_FAST_16BF" in loaded[0]


def test_the_int8_version_made_by_quantize_serves(provider_server):
    features = np.random.default_rng(2).standard_normal((6, 16)).astype(np.float32)
    tensor = httpclient.InferInput("features", [6, 16], "FP32")
    tensor.set_data_from_numpy(features)
    client = httpclient.InferenceServerClient(provider_server.http_url)
    served = client.infer("mlp_classifier", [tensor]).as_numpy("probabilities")
    versions = {int(entry["version"]) for entry in model_states_all(provider_server)
                if entry["name"] == "mlp_classifier" and entry.get("state") == "READY"}
    assert versions == {2}
    int8_file = provider_server.repositories[0] / "mlp_classifier/2/model.onnx"
    int8 = ort.InferenceSession(str(int8_file), providers=["CPUExecutionProvider"]).run(None, {"features": features})[0]
    np.testing.assert_allclose(served, int8, rtol=1e-5, atol=1e-6)
    float_out = ort.InferenceSession(str(CLASSIFIER), providers=["CPUExecutionProvider"]).run(
        None, {"features": features})[0]
    assert np.abs(served - float_out).max() < 0.05
