"""Finding and starting tritonserver: clear one-line failures, non-zero exits."""
from __future__ import annotations

import os
import stat
import sys

import pytest
from click.testing import CliRunner

from dspark._ext import cpu_features
from dspark.cli.main import cli
from dspark.triton.server import ServerError, TritonServer, build_backend_directory, find_server


def fake_server(tmp_path, script: str, with_python_backend: bool = True):
    """A tritonserver laid out like NVIDIA's container, whose binary is a shell script."""
    binary = tmp_path / "bin/tritonserver"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n" + script)
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    if with_python_backend:
        python = tmp_path / "backends/python"
        python.mkdir(parents=True)
        for name in ("libtriton_python.so", "triton_python_backend_utils.py", "triton_python_backend_stub"):
            (python / name).write_text("")
    return binary


def test_missing_server_path_is_a_clear_error(tmp_path):
    with pytest.raises(ServerError, match="no Triton server at .*pip install nvidia-pytriton"):
        find_server(str(tmp_path / "nope/tritonserver"))


def test_server_without_python_backend_is_named(tmp_path):
    binary = fake_server(tmp_path, "exit 0", with_python_backend=False)
    with pytest.raises(ServerError, match="Python backend is incomplete"):
        find_server(str(binary))


def test_server_that_dies_at_start_reports_its_error_line(tmp_path):
    binary = fake_server(tmp_path, 'echo "CUDA driver version is insufficient"; echo "error: creating server: boom"; exit 3')
    server = TritonServer(repositories=[tmp_path], server_path=str(binary))
    with pytest.raises(ServerError) as raised:
        server.start(timeout_s=20)
    assert "exited with code 3" in str(raised.value) and "boom" in str(raised.value)
    assert not server.running


@pytest.mark.parametrize("server_arg, words", [
    ("/nonexistent/tritonserver", ["no Triton server at /nonexistent/tritonserver"]),
    ("BROKEN", ["exited with code 3", "boom"]),
])
def test_serve_exits_non_zero_with_one_line(tmp_path, server_arg, words):
    if server_arg == "BROKEN":
        server_arg = str(fake_server(tmp_path, 'echo "error: creating server: boom"; exit 3'))
    result = CliRunner().invoke(cli, ["serve", "--server", server_arg, "-r", str(tmp_path)])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dspark: ")
    for word in words:
        assert word in lines[0]


def test_backend_directory_has_the_stub_for_this_python_and_every_backend(tmp_path):
    install = find_server()
    names = build_backend_directory(install, tmp_path / "backends", sources=_project_backends())
    assert "onnx" in names
    assert (tmp_path / "backends/python/triton_python_backend_stub").is_file()
    assert (tmp_path / "backends/onnx/model.py").is_file()
    assert install.stub_for_running_python().parent.name == f"{sys.version_info.major}.{sys.version_info.minor}"


def _project_backends():
    from dspark.paths import backends_dir
    return backends_dir()


def test_server_environment_puts_this_interpreter_first(tmp_path):
    server = TritonServer(repositories=[tmp_path])
    env = server.environment(find_server())
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    assert "nvidia_pytriton.libs" in env["LD_LIBRARY_PATH"]


def test_cpu_features_agree_with_the_kernel_report():
    flags = set(open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split())
    features = cpu_features.runtime_features()
    assert features["avx2"] == ("avx2" in flags)
    assert features["avx512f"] == ("avx512f" in flags)
    assert features["amx_bf16"] == ("amx_bf16" in flags)
    assert cpu_features.usable_isas()[-1] == "scalar"
    assert ("avx512" in cpu_features.usable_isas()) == ("avx512f" in flags)
    assert ("avx2" in cpu_features.usable_isas()) == ("avx2" in flags and "fma" in flags)


def test_info_reports_isas_and_the_server():
    result = CliRunner().invoke(cli, ["info"])
    assert result.exit_code == 0, result.output
    assert "usable ISAs" in result.output and "scalar" in result.output and "tritonserver" in result.output
