"""The one demo target, as the router's demo reads it (config parameters) and as a rollout
artifact sets it (a ``behaviour``), run against a stand-in for triton_python_backend_utils."""
from __future__ import annotations

import importlib.util
import json
import sys
import types

import numpy as np
import pytest

from dspark.paths import project_root
from dspark.rollout import demo
from dspark.triton.demo_target import Behaviour


class Tensor:
    def __init__(self, name, array):
        self.name, self.array = name, array

    def as_numpy(self):
        return self.array


class Response:
    def __init__(self, tensors=None, error=None):
        self.tensors, self.error = {t.name: t.array for t in tensors or []}, error


@pytest.fixture
def pb_utils(monkeypatch):
    fake = types.SimpleNamespace(
        Tensor=Tensor, InferenceResponse=Response, TritonError=str,
        Logger=types.SimpleNamespace(log_info=lambda message: None),
        get_input_tensor_by_name=lambda request, name: request[name])
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    return fake


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TritonPythonModel()


def args(name, version, parameters=None):
    config = {"name": name, "parameters": {k: {"string_value": v} for k, v in (parameters or {}).items()}}
    return {"model_config": json.dumps(config), "model_version": str(version)}


def ask(model, x):
    return model.execute([{"x": Tensor("x", np.array([x], np.float32))}])[0]


def test_router_demo_target_reads_its_behaviour_from_parameters(pb_utils):
    path = project_root() / "backends" / "router_demo_target" / "model.py"
    plain, offset, failing = (load(path, f"demo_target_{v}") for v in (1, 2, 3))
    parameters = {"service_time_ms": "0", "version_2": "offset=0.5", "version_3": "error"}
    for version, model in enumerate((plain, offset, failing), 1):
        model.initialize(args("router_demo_target", version, parameters))
    answer = ask(plain, 3.0)
    assert answer.tensors["y"][0] == 6.0 and answer.tensors["version"][0] == 1
    assert ask(offset, 3.0).tensors["y"][0] == 6.5
    assert ask(failing, 3.0).error == "router_demo_target version 3 is configured to fail"
    assert Behaviour.from_parameters({"version_4": "sleep_ms=7"}, 4).service_ms == 7.0


def test_a_rollout_artifact_is_the_same_target_with_its_behaviour_written_in(pb_utils, tmp_path, monkeypatch):
    path = demo.model_artifact(tmp_path / "model.py", "1.2.0", service_ms=0, fail_after=1, scale=3.0,
                               broken_where="DSPARK_TEST_BROKEN")
    model = load(path, "rollout_artifact")
    model.initialize(args("rollout_demo", 5))
    assert ask(model, 2.0).tensors["y"][0] == 6.0
    assert ask(model, 2.0).error == "rollout_demo version 5 is configured to fail"
    monkeypatch.setenv("DSPARK_TEST_BROKEN", "1")
    with pytest.raises(RuntimeError, match="rollout_demo cannot load on this server"):
        load(path, "rollout_artifact_broken").initialize(args("rollout_demo", 6))
