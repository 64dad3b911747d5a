"""ModelSpec YAML <-> config.pbtxt through Triton's protobuf schema, and the version mapping."""
from __future__ import annotations

import pytest
from google.protobuf import text_format
from hypothesis import given
from hypothesis import strategies as st

from dspark.repository.modelspec import (
    DynamicBatching,
    EnsembleStep,
    InstanceGroup,
    ModelSpec,
    SpecError,
    TensorSpec,
    VersionRecord,
    parse_config_text,
    semver_key,
)


def classifier_spec() -> ModelSpec:
    return ModelSpec(
        name="classifier",
        framework="onnx",
        versions=[VersionRecord("1.0.0", 1), VersionRecord("1.2.0", 2)],
        max_batch_size=8,
        inputs=[TensorSpec("features", "FP32", [16])],
        outputs=[TensorSpec("probabilities", "FP32", [4])],
        instance_groups=[InstanceGroup("CPU", 2)],
        dynamic_batching=DynamicBatching(max_queue_delay_microseconds=100, priority_levels=3,
                                         default_priority_level=2),
        parameters={"intra_op_threads": "1"},
        serve_versions=["1.2.0"],
    )


def test_config_text_parses_back_with_tritons_schema():
    config = parse_config_text(classifier_spec().config_text())
    assert config.backend == "onnx" and config.max_batch_size == 8
    assert config.input[0].name == "features" and list(config.input[0].dims) == [16]
    assert config.instance_group[0].count == 2
    assert config.dynamic_batching.priority_levels == 3 and config.dynamic_batching.default_priority_level == 2
    assert config.parameters["intra_op_threads"].string_value == "1"
    assert list(config.version_policy.specific.versions) == [2]  # semver 1.2.0 lives in folder 2


def test_yaml_round_trip_keeps_every_field(tmp_path):
    spec = classifier_spec()
    spec.save(tmp_path / "modelspec.yaml")
    assert ModelSpec.load(tmp_path / "modelspec.yaml") == spec
    assert spec.version == "1.2.0"


def test_adopting_a_config_keeps_fields_the_spec_does_not_model():
    original = parse_config_text(
        'name: "m" backend: "onnx" max_batch_size: 4 '
        'input [{name: "x" data_type: TYPE_FP32 dims: [3]}] output [{name: "y" data_type: TYPE_FP32 dims: [3]}] '
        'sequence_batching { max_sequence_idle_microseconds: 5000 } version_policy { latest { num_versions: 2 } }')
    spec = ModelSpec.from_model_config(original, [VersionRecord("1.0.0", 1)])
    assert spec.to_model_config() == original


def test_ensemble_steps_become_ensemble_scheduling():
    spec = ModelSpec(name="e", framework="ensemble", versions=[VersionRecord("1.0.0", 1)],
                     ensemble=[EnsembleStep("a", {"x": "in"}, {"y": "out"})])
    config = spec.to_model_config()
    assert config.platform == "ensemble" and config.ensemble_scheduling.step[0].model_name == "a"


@pytest.mark.parametrize("data, field", [
    ({"name": "m", "framework": "onnx", "inputs": [{"name": "x", "dtype": "FLOAT32", "dims": [1]}]}, "inputs[0].dtype"),
    ({"name": "m", "framework": "onnx", "max_batch": 4}, "max_batch"),
    ({"name": "m", "framework": "onnx", "versions": [{"semver": "1.0", "folder": 1}]}, "versions[0].semver"),
    ({"name": "m", "framework": "caffe"}, "framework"),
    ({"name": "m", "framework": "onnx", "inputs": [{"name": "x", "dtype": "FP32", "dims": [-2]}]}, "inputs[0].dims[0]"),
])
def test_bad_spec_names_the_field(data, field):
    with pytest.raises(SpecError) as raised:
        ModelSpec.from_dict(data)
    assert raised.value.field == field


def test_config_parse_error_names_file_and_field(tmp_path):
    with pytest.raises(SpecError) as raised:
        parse_config_text('name: "m"\nmax_batch: 3\n', tmp_path / "config.pbtxt")
    assert "config.pbtxt" in str(raised.value) and "max_batch" in str(raised.value)


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30), st.integers(0, 30), st.booleans()),
                min_size=2, max_size=8))
def test_semver_order_is_numeric_and_prerelease_sorts_first(parts):
    versions = [f"{a}.{b}.{c}" + ("-rc.1" if pre else "") for a, b, c, pre in parts]
    ordered = sorted(versions, key=semver_key)
    for low, high in zip(ordered, ordered[1:]):
        (a1, b1, c1), (a2, b2, c2) = (tuple(int(x) for x in v.split("-")[0].split(".")) for v in (low, high))
        assert (a1, b1, c1) <= (a2, b2, c2)
        if (a1, b1, c1) == (a2, b2, c2) and low != high:
            assert "-" in low and "-" not in high


def test_generated_config_is_text_format_not_hand_written():
    text = classifier_spec().config_text()
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    assert text_format.MessageToString(parse_config_text(body)) == body + "\n"
