"""`dspark quantize`: INT8 (dynamic, static) and INT4 versions of the demo ONNX models, added to a
repository as new versions, with their speed and accuracy printed against the float version."""
from __future__ import annotations

import shutil

import numpy as np
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from dspark.runtimes.accel.quantize import quantized_ops
from dspark.cli.main import cli
from dspark.paths import project_root
from dspark.repository.modelspec import ModelSpec, load_config

DEMO = project_root() / "model_repository"


@pytest.fixture()
def repository(tmp_path):
    for name in ("mlp_classifier", "fused_transformer_onnx", "fused_transformer"):
        shutil.copytree(DEMO / name, tmp_path / name)
    return tmp_path


def quantize(repository, *args):
    result = CliRunner().invoke(cli, ["quantize", *args, "--repository", str(repository), "--rounds", "2"])
    return result


def classifier_outputs(path, features):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"features": features})[0]


def test_int8_makes_a_working_new_version_and_reports_speed_and_accuracy(repository):
    result = quantize(repository, "mlp_classifier", "--int8")
    assert result.exit_code == 0, result.output
    assert "mlp_classifier 1.0.0 -> 1.1.0+int8-dynamic (folder 2)" in result.output
    assert "MatMulInteger x2" in result.output
    assert "speed     float" in result.output and "int8-dynamic" in result.output and "ms: x" in result.output
    assert "accuracy  max |delta|" in result.output and "top-1 agreement" in result.output

    spec = ModelSpec.load(repository / "mlp_classifier/modelspec.yaml")
    assert [(r.semver, r.folder) for r in spec.versions] == [("1.0.0", 1), ("1.1.0+int8-dynamic", 2)]
    assert spec.versions[-1].source == "dspark quantize --int8-dynamic of 1.0.0"
    assert load_config(repository / "mlp_classifier/config.pbtxt").name == "mlp_classifier"
    features = np.random.default_rng(5).standard_normal((64, 16)).astype(np.float32)
    float_out = classifier_outputs(repository / "mlp_classifier/1/model.onnx", features)
    int8_out = classifier_outputs(repository / "mlp_classifier/2/model.onnx", features)
    assert np.abs(int8_out - float_out).max() < 0.05
    assert np.mean(int8_out.argmax(1) == float_out.argmax(1)) > 0.9


def test_static_int8_with_user_calibration_then_int4_each_from_the_float_version(repository, tmp_path):
    calibration = tmp_path / "calibration.npz"
    np.savez(calibration, features=np.random.default_rng(0).standard_normal((20, 16)).astype(np.float32))
    result = quantize(repository, "mlp_classifier", "--int8", "--static", "--calibration", str(calibration))
    assert result.exit_code == 0, result.output
    assert "1.0.0 -> 1.1.0+int8-static (folder 2)" in result.output and "QuantizeLinear x" in result.output
    result = quantize(repository, "mlp_classifier", "--int4")
    assert result.exit_code == 0, result.output
    assert "1.0.0 -> 1.2.0+int4 (folder 3)" in result.output  # from the float version, not the int8 one
    assert quantized_ops(repository / "mlp_classifier/3/model.onnx") == {"MatMulNBits": 2}


def test_the_transformers_onnx_twin_gets_an_int8_version(repository):
    result = quantize(repository, "fused_transformer_onnx", "--int8", "--samples", "2")
    assert result.exit_code == 0, result.output
    assert "MatMulInteger x8" in result.output and "MiB ->" in result.output
    assert (repository / "fused_transformer_onnx/2/model.onnx").is_file()


def test_bad_requests_are_refused_with_the_reason(repository, tmp_path):
    assert "choose --int8 or --int4" in quantize(repository, "mlp_classifier").output
    assert "--static applies to --int8 only" in quantize(repository, "mlp_classifier", "--int4", "--static").output
    assert "is a python model; quantize takes ONNX models" in quantize(repository, "fused_transformer", "--int8").output
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, x=np.zeros((2, 16), np.float32))
    result = quantize(repository, "mlp_classifier", "--int8", "--inputs", str(wrong))
    assert result.exit_code != 0 and "has no array for input(s) features; it has x" in result.output
    assert not (repository / "mlp_classifier/2").exists()
