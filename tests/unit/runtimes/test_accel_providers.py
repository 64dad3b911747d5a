"""The execution-provider registry: names, option checks, probes, the choice and its fallback policy."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dspark.runtimes.accel import devices, providers
from dspark.runtimes.accel.providers import CPU, REGISTRY, ProviderRequest, choose, lookup, probe, verify_session
from dspark.runtimes.onnx_session import OnnxRunner
from dspark.errors import ConfigError
from dspark.paths import project_root
from dspark.repository.modelspec import ExecutionProvider, ModelSpec, SpecError, parse_config_text

CLASSIFIER = project_root() / "model_repository/mlp_classifier/1/model.onnx"
GPU_BUILD = ["TensorrtExecutionProvider", "CUDAExecutionProvider", CPU]


def machine(available, present=(), libraries=True):
    """A probe for an imagined machine: `available` in the ORT build, devices of kinds `present`,
    the providers' extra libraries (TensorRT's) loadable or not."""
    fake = {kind: (lambda kind=kind: devices.DeviceProbe(1 if kind in present else 0,
                                                         f"{kind} {'here' if kind in present else 'absent'}"))
            for kind in devices.PROBES}
    return lambda info: probe(info, available=available, device_probes=fake, version=(1, 32),
                              library_found=lambda names: libraries)


def test_every_common_provider_is_registered_with_a_vendor():
    for name in ("CPU", "CUDA", "TensorRT", "MIGraphX", "CANN", "OpenVINO", "DirectML", "QNN", "CoreML", "ROCm"):
        info = lookup(name)
        assert info.vendor and info.family in ("cpu", "gpu", "npu", "any") and info.device in devices.PROBES
    assert len({info.name for info in REGISTRY}) == len(REGISTRY)
    assert lookup("cudaexecutionprovider") is lookup("CUDA") is lookup("CUDAExecutionProvider")
    assert lookup("trt").name == "TensorrtExecutionProvider" and lookup("dml").name == "DmlExecutionProvider"


def test_an_unknown_provider_name_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown execution provider 'CUDE' \(did you mean CUDA\?\).*MIGraphX"):
        ProviderRequest(providers=("CUDE", "CPU")).validate()


def test_a_misspelled_option_is_rejected_naming_the_known_ones():
    request = ProviderRequest(providers=("CUDA", "CPU"), options={"CUDA": {"devce_id": 0}})
    with pytest.raises(ConfigError) as caught:
        request.validate()
    assert caught.value.field == "execution_provider_options.CUDA.devce_id"
    assert "did you mean device_id?" in str(caught.value) and "gpu_mem_limit" in str(caught.value)
    with pytest.raises(ConfigError, match="takes no options"):
        ProviderRequest(options={"CPU": {"threads": 2}}).validate()
    with pytest.raises(ConfigError, match="not in execution_providers"):
        ProviderRequest(providers=("CPU",), options={"TensorRT": {"trt_fp16_enable": True}}).validate()


def test_options_reach_ort_as_strings():
    request = ProviderRequest(providers=("TensorRT", "CUDA", "CPU"),
                              options={"TensorRT": {"trt_fp16_enable": True, "trt_max_workspace_size": 1 << 30}})
    choice = choose(request, machine(GPU_BUILD, present=("nvidia", "cpu")))
    assert choice.providers[0] == ("TensorrtExecutionProvider",
                                   {"trt_fp16_enable": "1", "trt_max_workspace_size": str(1 << 30)})
    without_trt = choose(request, machine(GPU_BUILD, present=("nvidia", "cpu"), libraries=False))
    assert without_trt.chosen == "CUDAExecutionProvider"
    assert "libnvinfer.so.10" in without_trt.skipped["TensorrtExecutionProvider"]


def test_cuda_then_cpu_falls_back_to_cpu_with_the_reason():
    choice = choose(ProviderRequest(providers=("CUDA", "CPU")), machine([CPU, "AzureExecutionProvider"]))
    assert choice.names == [CPU] and choice.fell_back
    assert "not in this onnxruntime build" in choice.skipped["CUDAExecutionProvider"]
    assert "onnxruntime-gpu" in choice.reason and choice.describe().startswith(CPU)


def test_a_gpu_build_without_a_gpu_is_not_usable():
    choice = choose(ProviderRequest(providers=("CUDA",)), machine(GPU_BUILD, present=("cpu",)))
    assert choice.names == [CPU]
    assert choice.skipped["CUDAExecutionProvider"] == "no device: nvidia absent"
    usable = choose(ProviderRequest(providers=("CUDA",)), machine(GPU_BUILD, present=("nvidia", "cpu")))
    assert usable.names == ["CUDAExecutionProvider", CPU] and not usable.fell_back


def test_rocm_is_gone_from_ort_1_23():
    info = lookup("ROCm")
    gone = probe(info, available=["ROCMExecutionProvider", CPU], version=(1, 23))
    assert not gone.usable and "removed from ONNX Runtime in 1.23" in gone.reason
    assert probe(info, available=["ROCMExecutionProvider", CPU], version=(1, 22),
                 device_probes={"amd": lambda: devices.DeviceProbe(1, "gfx942")}).usable


def test_fallback_forbidden_fails_naming_the_missing_provider():
    request = ProviderRequest(providers=("CUDA", "CPU"), disable_cpu_ep_fallback=True)
    with pytest.raises(ConfigError, match="CUDAExecutionProvider is not usable here: not in this onnxruntime build"):
        choose(request, machine([CPU]))


def test_strict_choice_leaves_cpu_out_and_ort_dropping_a_provider_is_caught():
    strict = choose(ProviderRequest(providers=("CUDA",), disable_cpu_ep_fallback=True),
                    machine(GPU_BUILD, present=("nvidia",)))
    assert strict.names == ["CUDAExecutionProvider"]
    with pytest.raises(ConfigError, match="ONNX Runtime could not start it"):
        verify_session(strict, [CPU])
    lenient = choose(ProviderRequest(providers=("CUDA", "CPU")), machine(GPU_BUILD, present=("nvidia",)))
    after = verify_session(lenient, [CPU])
    assert after.names == [CPU] and "could not start" in after.skipped["CUDAExecutionProvider"]


def test_config_parameters_round_trip_and_bad_json_names_the_parameter():
    request = ProviderRequest(providers=("TensorRT", "CPU"), options={"TensorRT": {"trt_fp16_enable": "1"}},
                              disable_cpu_ep_fallback=True)
    again = ProviderRequest.from_parameters(request.to_parameters())
    assert again == request
    with pytest.raises(ConfigError, match="parameter 'execution_provider_options': Invalid JSON"):
        ProviderRequest.from_parameters({"execution_providers": "CPU", "execution_provider_options": "{cuda"})
    with pytest.raises(ConfigError, match="parameter 'disable_cpu_ep_fallback': Input should be a valid boolean"):
        ProviderRequest.from_parameters({"disable_cpu_ep_fallback": "sometimes"})


def test_a_missing_plugin_library_is_a_skip_with_its_path(tmp_path):
    library = tmp_path / "libonnxruntime_musa_ep.so"
    request = ProviderRequest(providers=("MUSAExecutionProvider", "CPU"),
                              options={"MUSAExecutionProvider": {"device_id": 0}},
                              plugin_libraries={"MUSAExecutionProvider": str(library)})
    choice = choose(request)
    assert choice.names == [CPU]
    assert choice.skipped["MUSAExecutionProvider"] == f"plugin library {library} does not exist"
    library.write_bytes(b"not a shared library")
    assert "did not register" in choose(request).skipped["MUSAExecutionProvider"]


def test_this_machine_runs_the_cpu_provider_and_reports_each_other_one():
    report = dict((info.short, result) for info, result in providers.probe_all())
    assert report["CPU"].usable
    assert all(result.reason for result in report.values())


def test_the_onnx_runner_serves_on_cpu_after_falling_back():
    runner = OnnxRunner(CLASSIFIER, providers=ProviderRequest(providers=("CUDA", "CPU")))
    assert runner.choice.chosen == CPU and "CUDAExecutionProvider" in runner.choice.skipped
    assert runner.session.get_providers() == [CPU]
    out = runner.run({"features": np.zeros((2, 16), np.float32)})["probabilities"]
    np.testing.assert_allclose(out.sum(axis=1), 1.0, rtol=1e-5)


def test_modelspec_carries_the_preference_into_config_parameters_and_back():
    spec = ModelSpec(name="m", framework="onnx",
                     execution_providers=[ExecutionProvider("CUDA", {"device_id": 0}), ExecutionProvider("CPU")],
                     disable_cpu_ep_fallback=True)
    config = parse_config_text(spec.config_text())
    assert config.parameters["execution_providers"].string_value == "CUDA,CPU"
    assert json.loads(config.parameters["execution_provider_options"].string_value) == {"CUDA": {"device_id": 0}}
    assert config.parameters["disable_cpu_ep_fallback"].string_value == "true"
    adopted = ModelSpec.from_model_config(config, [])
    assert adopted.execution_providers == spec.execution_providers and adopted.parameters == {}
    with pytest.raises(SpecError, match="execution_provider_options.CUDA.device"):
        ModelSpec.from_dict({"name": "m", "framework": "onnx",
                             "execution_providers": [{"name": "CUDA", "options": {"device": 0}}]})


def test_tensorrt_engine_falls_back_to_onnx_runtime_or_fails_when_strict(tmp_path):
    from dspark.runtimes.accel import tensorrt_engine as trt_engine

    def ort_runner():
        return OnnxRunner(CLASSIFIER, providers=ProviderRequest(providers=("CUDA", "CPU")))

    probe_result = trt_engine.probe()
    if probe_result.usable:
        pytest.skip("TensorRT runs here: the GPU check covers it")
    runner = trt_engine.open_model_runner({"engine": "tensorrt"}, "m", "1", CLASSIFIER, ort_runner)
    assert runner.choice.chosen == CPU
    assert list(runner.choice.skipped) == ["TensorRT engine", "CUDAExecutionProvider"]
    assert runner.choice.skipped["TensorRT engine"] == probe_result.reason
    with pytest.raises(ConfigError, match="engine.*tensorrt is not usable here.*disable_cpu_ep_fallback is set"):
        trt_engine.open_model_runner({"engine": "tensorrt", "disable_cpu_ep_fallback": "true"}, "m", "1",
                                     CLASSIFIER, ort_runner)
    with pytest.raises(ConfigError, match=r"parameter 'engine': Input should be 'onnxruntime' or 'tensorrt' \(got 'trt'\)"):
        trt_engine.open_model_runner({"engine": "trt"}, "m", "1", CLASSIFIER, ort_runner)


def test_tensorrt_engine_cache_is_keyed_by_model_version_gpu_trt_and_settings(tmp_path):
    from dspark.runtimes.accel.tensorrt_engine import BuildSettings, engine_path

    def path(**changes):
        args = dict(cache_dir=tmp_path, model="m", version="1", onnx_path=CLASSIFIER, settings=BuildSettings(),
                    gpu="NVIDIA H200 sm90", trt_version="10.13.0")
        args.update(changes)
        return engine_path(**args)

    base = path()
    assert base == path() and base.parent == tmp_path / "m" / "1"
    assert base.name.startswith("NVIDIA-H200-sm90_trt10.13.0_")
    assert len({base, path(model="n"), path(version="2"), path(gpu="NVIDIA A100 sm80"), path(trt_version="10.14.1"),
                path(settings=BuildSettings(fp16=True))}) == 6


def test_dspark_info_reports_providers_each_models_choice_and_the_shim():
    from click.testing import CliRunner

    from dspark.cli.main import cli

    output = CliRunner().invoke(cli, ["info"]).output
    assert "CPU       usable ONNX Runtime (MLAS)" in output
    assert "ROCm      no     AMD: " + ("removed from ONNX Runtime in 1.23" if providers.ort_version() >= (1, 23)
                                        else "not in this onnxruntime build") in output
    assert "model mlp_classifier: CPUExecutionProvider (first preference)" in output
    assert "GemmEx shim   libhcblas.so: paths built convert" in output


def test_the_gpu_check_skips_with_one_line_without_a_gpu():
    import subprocess
    import sys

    if devices.nvidia_gpus().present:
        pytest.skip("a GPU is here: tools/gpu_check.py runs its checks instead")
    run = subprocess.run([sys.executable, str(project_root() / "tools/gpu_check.py")], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0 and run.stderr == ""
    assert run.stdout.count("\n") == 1 and run.stdout.startswith("gpu_check: skipped, no NVIDIA GPU here (")


def test_the_gpu_check_counts_a_skip_as_a_skip_and_strict_fails_on_it():
    from dspark.runtimes.accel import gpu_check as tool

    results = [{"status": "ok"}] * 4 + [{"status": "skip"}] * 3  # the H200 run: no CUDA/TensorRT provider, no TensorRT
    assert tool.summary(results, strict=False) == ("gpu_check: 4 of 7 checks passed, 3 skipped, 0 failed", 0)
    assert tool.summary(results, strict=True) == (
        "gpu_check: 4 of 7 checks passed, 3 skipped (failures with --strict), 0 failed", 1)
    assert tool.summary([{"status": "ok"}, {"status": "FAIL"}], strict=False)[1] == 1
    assert tool.summary([{"status": "ok"}] * 7, strict=True) == ("gpu_check: 7 of 7 checks passed, 0 skipped, 0 failed", 0)


def test_the_strict_gpu_check_fails_without_a_gpu():
    import subprocess
    import sys

    if devices.nvidia_gpus().present:
        pytest.skip("a GPU is here: tools/gpu_check.py runs its checks instead")
    run = subprocess.run([sys.executable, str(project_root() / "tools/gpu_check.py"), "--strict"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and run.stdout.startswith("gpu_check: FAIL (--strict), no NVIDIA GPU here (")


def test_info_names_each_models_choice_with_its_tensorrt_engine_and_config_errors(tmp_path):
    from dspark.cli.accel import model_provider_choices

    for name, parameters in (("with_engine", {"engine": "tensorrt", "execution_providers": "CUDA,CPU"}),
                             ("misspelled", {"execution_provider_options": '{"CPU": {"threads": 1}}'})):
        spec = ModelSpec(name=name, framework="onnx", parameters=parameters)
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.pbtxt").write_text(spec.config_text())
    rows = dict(model_provider_choices([tmp_path]))
    assert rows["with_engine"].startswith("CPUExecutionProvider (fallback (CUDAExecutionProvider not usable")
    assert "TensorRT engine not usable: " in rows["with_engine"]
    assert rows["misspelled"].startswith("fails to load: execution_provider_options.CPU.threads")
