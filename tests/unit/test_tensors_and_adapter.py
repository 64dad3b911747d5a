"""Request checks and config parameters shared by the backends' model.py adapters."""
from __future__ import annotations

import numpy as np
import pytest

from dspark.engines.onnx_session import batch_groups
from dspark.triton.adapter import ConfigError, parameter_bool, parameter_int, parameter_list
from dspark.triton.tensors import RequestError, TensorSpec, check_inputs

FEATURES = TensorSpec("features", "TYPE_FP32", (16,))


def test_a_good_batch_passes():
    check_inputs([FEATURES], {"features": np.zeros((3, 16), np.float32)}, batched=True)


@pytest.mark.parametrize("arrays, words", [
    ({"features": np.zeros((3, 16), np.int64)}, ["'features'", "INT64", "expected FP32"]),
    ({"features": np.zeros((3, 15), np.float32)}, ["'features'", "[3, 15]", "[-1, 16]"]),
    ({"features": np.zeros((16,), np.float32)}, ["'features'", "[16]"]),
    ({}, ["input tensor 'features': missing", "FP32"]),
    ({"features": np.zeros((1, 16), np.float32), "extra": np.zeros(1)}, ["input tensor 'extra': unknown"]),
])
def test_bad_requests_name_the_tensor_and_what_was_expected(arrays, words):
    with pytest.raises(RequestError) as raised:
        check_inputs([FEATURES], arrays, batched=True)
    for word in words:
        assert word in str(raised.value)


def test_parameters_parse_or_name_the_parameter():
    params = {"threads": "4", "spin": "off", "providers": "CUDAExecutionProvider, CPUExecutionProvider"}
    assert parameter_int(params, "threads", 1) == 4
    assert parameter_int(params, "absent", 7) == 7
    assert parameter_bool(params, "spin", True) is False
    assert parameter_list(params, "providers") == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    with pytest.raises(ConfigError, match="'threads'"):
        parameter_int({"threads": "many"}, "threads", 1)
    with pytest.raises(ConfigError, match="'spin'"):
        parameter_bool({"spin": "maybe"}, "spin", False)


def test_requests_batch_only_with_matching_shapes():
    feeds = [{"x": np.zeros((1, 4), np.float32)}, {"x": np.zeros((2, 4), np.float32)},
             {"x": np.zeros((1, 5), np.float32)}, {"x": np.zeros((1, 4), np.float64)}]
    assert sorted(batch_groups(feeds)) == [[0, 1], [2], [3]]
