"""Finding and starting tritonserver: clear one-line failures, non-zero exits."""
from __future__ import annotations

import os
import secrets
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import psutil
import pytest
import re2
from click.testing import CliRunner

from dspark._ext import cpu_features
from dspark.cli import serve as serve_cli
from dspark.cli.main import cli
from dspark.paths import project_root
from dspark.server.launcher import ServerPorts, TritonServer
from dspark.server.access import API_KEY_HEADER, DEFAULT_HEADER_PATTERN, GRPC_API_KEY_HEADER, ServerError, KEY_FD_ENV, KEY_MARKER, SERVER_UMASK, header_forward_args
from dspark.server.install import build_backend_directory, find_server

# A stand-in for tritonserver: listens where --http-address/--http-port say, answers the
# readiness check, refuses GET /v2/logging without the key its --http-restricted-api names (as
# the preloaded guard library filled it in), exits 0 on SIGTERM. FAKE_EXIT_AFTER_S=<s> makes it
# exit 3 after that long without listening (a server that dies at start); FAKE_READY_AFTER_S=<s>
# makes it listen after that long; FAKE_OLD_ERROR=<text> logs an error line at start.
FAKE_TRITON = f"""#!{sys.executable}
import os, signal, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
print("fake tritonserver", " ".join(sys.argv[1:]), flush=True)
if os.environ.get("FAKE_EXIT_AFTER_S"):
    time.sleep(float(os.environ["FAKE_EXIT_AFTER_S"]))
    print("error: creating server: fake failure", flush=True)
    sys.exit(3)
if os.environ.get("FAKE_OLD_ERROR"):  # an error it logs at start and serves on after
    print("error: " + os.environ["FAKE_OLD_ERROR"], flush=True)
time.sleep(float(os.environ.get("FAKE_READY_AFTER_S", "0")))  # a slow start
region = os.environ.get("FAKE_SHM_REGION")  # mapped by the server and a stub, as the Python backend's
if region:
    import mmap, subprocess
    mapped = []
    for name in (region, os.environ.get("FAKE_CLIENT_REGION")):  # a client's: mapped by the server alone
        if name:
            fd = os.open("/dev/shm/" + name, os.O_CREAT | os.O_RDWR, 0o600)
            os.ftruncate(fd, 4096)
            mapped.append(mmap.mmap(fd, 4096))
    stub = subprocess.Popen([sys.executable, "-c", "import mmap, os, sys, time; "
                             "m = mmap.mmap(os.open(sys.argv[1], os.O_RDWR), 4096); print('stub', flush=True); "
                             "time.sleep(600)", "/dev/shm/" + region], stdout=subprocess.PIPE)
    stub.stdout.readline()
def stop(*_):
    if region and os.environ.get("FAKE_SHM_CLEAN"):
        os.unlink("/dev/shm/" + region)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
key = args["http-restricted-api"].split("dspark-api-key=", 1)[1]
class Ready(BaseHTTPRequestHandler):
    def do_GET(self):
        allowed = self.path != "/v2/logging" or self.headers.get("dspark-api-key") == key
        self.send_response(200 if allowed else 403)
        self.end_headers()
    def log_message(self, *a):
        pass
HTTPServer((args["http-address"], int(args["http-port"])), Ready).serve_forever()
"""


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


class _AlwaysReady(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def other_server():
    """Another process's HTTP server on a free loopback port that says it is ready."""
    httpd = HTTPServer(("127.0.0.1", 0), _AlwaysReady)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(autouse=True)
def private_tmpdir(tmp_path, monkeypatch):
    """tempfile's folder redirected, so a test sees exactly what a server start leaves behind
    (and the log a failed start keeps stays out of the real temporary folder)."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


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
    ports = ServerPorts.free()  # `make demo` may hold the default ones
    result = CliRunner().invoke(cli, ["serve", "--server", server_arg, "-r", str(tmp_path), f"--http-port={ports.http}",
                                      f"--grpc-port={ports.grpc}", f"--metrics-port={ports.metrics}"])
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


def _ports_with_http(port: int) -> ServerPorts:
    free = ServerPorts.free()
    return ServerPorts(http=port, grpc=free.grpc, metrics=free.metrics)


def test_serve_refuses_a_taken_port_in_one_line_naming_it_and_the_option(tmp_path, other_server):
    binary = fake_server(tmp_path, "")
    binary.write_text(FAKE_TRITON)
    ports = _ports_with_http(other_server)
    result = CliRunner().invoke(cli, ["serve", "--server", str(binary), "-r", str(tmp_path),
                                      f"--http-port={ports.http}", f"--grpc-port={ports.grpc}",
                                      f"--metrics-port={ports.metrics}"])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [f"dspark: port {other_server} (HTTP) on 127.0.0.1 is already in use by another process: "
                     "stop it, or pass --http-port with a free port"]


def test_the_same_port_twice_is_refused(tmp_path):
    binary = fake_server(tmp_path, "")
    server = TritonServer(repositories=[tmp_path], server_path=str(binary), ports=ServerPorts(9100, 9100, 9102))
    with pytest.raises(ServerError, match="port 9100 is given for both HTTP and gRPC: pass --grpc-port"):
        server.start()


def test_readiness_from_another_server_on_the_port_is_not_ours(tmp_path, other_server, monkeypatch):
    """The child dies at start while another server answers /v2/health/ready on its port (the
    port check is skipped here to stand for a port taken between the check and the bind)."""
    binary = fake_server(tmp_path, "")
    binary.write_text(FAKE_TRITON)
    monkeypatch.setenv("FAKE_EXIT_AFTER_S", "1.5")
    monkeypatch.setattr(ServerPorts, "check_free", lambda self, host: None)
    server = TritonServer(repositories=[tmp_path], server_path=str(binary), ports=_ports_with_http(other_server))
    with pytest.raises(ServerError, match="exited with code 3 before it was ready: error: creating server: fake failure"):
        server.start(timeout_s=20)
    assert not server.running


@pytest.mark.parametrize("taken_at", ["the port check", "the bind"])
def test_ports_it_chose_itself_are_chosen_again_when_one_is_taken(tmp_path, private_tmpdir, monkeypatch, taken_at):
    import socket

    binary = fake_server(tmp_path, "")
    binary.write_text(FAKE_TRITON)
    if taken_at == "the bind":  # taken between the check and the server's bind
        monkeypatch.setattr(ServerPorts, "check_free", lambda self, host: None)
    server = TritonServer(repositories=[tmp_path], server_path=str(binary))
    first = server.ports
    with socket.socket() as taker:  # another process takes a port after the choice
        taker.bind(("127.0.0.1", first.grpc if taken_at == "the port check" else first.http))
        taker.listen()
        server.start(timeout_s=20)
        try:
            assert server.running and server.ports != first and server.ports.grpc == server.ports.http + 1
        finally:
            server.stop()
    assert list(private_tmpdir.iterdir()) == [], "the failed try left nothing behind"


def test_a_clean_stop_leaves_no_temporary_folder(tmp_path, private_tmpdir):
    binary = fake_server(tmp_path, "")
    binary.write_text(FAKE_TRITON)
    with TritonServer(repositories=[tmp_path], server_path=str(binary)) as server:
        assert server.running and "fake tritonserver" in server.log_text()
    assert list(private_tmpdir.iterdir()) == []


@pytest.mark.parametrize("ending", ["clean exit", "exit leaving it", "killed", "terminated, waited"])
def test_stop_removes_the_shared_memory_a_server_left_behind(tmp_path, monkeypatch, ending):
    binary = fake_server(tmp_path, "")
    binary.write_text(FAKE_TRITON)
    region = Path(f"/dev/shm/dspark_test_{os.getpid()}_{secrets.token_hex(4)}")
    client_region = Path(f"{region}_client")
    monkeypatch.setenv("FAKE_SHM_REGION", region.name)
    monkeypatch.setenv("FAKE_CLIENT_REGION", client_region.name)
    if ending == "clean exit":
        monkeypatch.setenv("FAKE_SHM_CLEAN", "1")
    server = TritonServer(repositories=[tmp_path], server_path=str(binary))
    try:
        server.start(timeout_s=20)
        assert region.exists()
        if ending == "killed":
            server.kill()
        elif ending == "terminated, waited":  # as `dspark serve` stops on a signal
            server.terminate()
            server.wait()
    finally:
        server.stop()
        left, client_kept = region.exists(), client_region.exists()
        region.unlink(missing_ok=True)
        client_region.unlink(missing_ok=True)
    assert not left and client_kept  # a region the server maps alone is a client's: never removed
    assert server.left_shm_regions == ([] if ending == "clean exit" else [region.name])


@pytest.mark.parametrize("existing", [False, True])
def test_the_log_stays_where_log_file_says_owner_only(tmp_path, private_tmpdir, existing):
    binary = fake_server(tmp_path, "")
    binary.write_text(FAKE_TRITON)
    log = tmp_path / "logs/server.log"
    log.parent.mkdir()
    if existing:
        log.write_text("old")
        log.chmod(0o644)
    old_umask = os.umask(0o022)
    try:
        with TritonServer(repositories=[tmp_path], server_path=str(binary), log_path=log):
            pass
    finally:
        os.umask(old_umask)
    assert "fake tritonserver" in log.read_text()
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert list(private_tmpdir.iterdir()) == []


def test_a_failed_start_keeps_only_its_log_and_names_it(tmp_path, private_tmpdir, monkeypatch):
    binary = fake_server(tmp_path, "")
    binary.write_text(FAKE_TRITON)
    monkeypatch.setenv("FAKE_EXIT_AFTER_S", "0")
    server = TritonServer(repositories=[tmp_path], server_path=str(binary))
    with pytest.raises(ServerError) as raised:
        server.start(timeout_s=20)
    [folder] = private_tmpdir.iterdir()
    assert [p.name for p in folder.iterdir()] == ["tritonserver.log"]
    assert str(folder / "tritonserver.log") in str(raised.value)


@pytest.mark.parametrize("control", ["none", "explicit", "poll"])
def test_binds_loopback_and_restricts_the_same_apis_in_every_control_mode_with_the_key_off_the_command_line(
        tmp_path, control):
    install = find_server()
    server = TritonServer(repositories=[tmp_path], model_control=control)
    args = server.command(install, tmp_path)
    assert {"--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"} <= set(args)
    public = TritonServer(repositories=[tmp_path], model_control=control, host="0.0.0.0").command(install, tmp_path)
    assert {"--http-address=0.0.0.0", "--metrics-address=127.0.0.1"} <= set(public)
    key = server.api_key
    assert len(key) >= 32 and key != TritonServer(repositories=[tmp_path], model_control=control).api_key
    apis = "model-repository,shared-memory,logging,trace,statistics"
    assert f"--http-restricted-api={apis}:{API_KEY_HEADER}={KEY_MARKER}" in args
    assert f"--grpc-restricted-protocol={apis}:{API_KEY_HEADER}={KEY_MARKER}" in args
    assert not any(key in arg for arg in args)
    assert server.repository_headers == {API_KEY_HEADER: key, GRPC_API_KEY_HEADER: key}


def test_the_key_stays_out_of_the_server_environment_and_the_guard_library_is_preloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_API_KEY", "k" * 20)
    monkeypatch.setenv("LD_PRELOAD", "/some/other.so")
    env = TritonServer(repositories=[tmp_path]).environment(find_server())
    assert "DSPARK_API_KEY" not in env and not any("k" * 20 in value for value in env.values())
    guard, other = env["LD_PRELOAD"].split(" ")
    assert guard.endswith("/libserverguard.so") and Path(guard).is_file() and other == "/some/other.so"


def test_a_server_that_does_not_hold_the_key_is_stopped(tmp_path, monkeypatch):
    """The fake ignores what the guard library filled in and wants the marker itself as its key:
    the check after readiness sees the key refused, and start() stops it with one line."""
    binary = fake_server(tmp_path, "")
    binary.write_text(FAKE_TRITON.replace('split("dspark-api-key=", 1)[1]', 'split("dspark-api-key=", 1)[1] and "'
                                          + KEY_MARKER + '"'))
    server = TritonServer(repositories=[tmp_path], server_path=str(binary))
    with pytest.raises(ServerError, match="with 403 without the API key and 403 with it .* not serving"):
        server.start(timeout_s=20)
    assert not server.running


@pytest.mark.parametrize("key", ["short", "has space in it......", "x" * 257, "comma,equals=aaaaaaaaaaa"])
def test_a_weak_or_unusable_api_key_is_refused(tmp_path, key):
    with pytest.raises(ServerError, match="--api-key / DSPARK_API_KEY: must be 16 to 256 characters"):
        TritonServer(repositories=[tmp_path], model_control="explicit", api_key=key)


def test_serve_prints_where_the_generated_key_is_never_the_key_and_warns_about_a_public_host(tmp_path, monkeypatch):
    """A captured stdout (a 0644 log read by another user) must not hold the key: it goes to a
    0600 file in the server's 0700 folder, and only that file's path is printed."""
    binary = fake_server(tmp_path, "")
    binary.write_text(FAKE_TRITON)
    monkeypatch.delenv("DSPARK_API_KEY", raising=False)
    seen = {}

    def stop_at_once(server, _api=None, _ready=""):
        seen["server"], seen["log"] = server, server.log_text()
        seen["key file"] = server.key_path.read_text(), stat.S_IMODE(server.key_path.stat().st_mode)
        seen["folder mode"] = stat.S_IMODE(server.key_path.parent.stat().st_mode)
        server.stop()

    monkeypatch.setattr("dspark.cli.serve.serve_until_signal", stop_at_once)
    ports = ServerPorts.free()
    result = CliRunner().invoke(cli, ["serve", "--server", str(binary), "-r", str(tmp_path), "--host", "0.0.0.0",
                                      "--model-control", "explicit", f"--http-port={ports.http}",
                                      f"--grpc-port={ports.grpc}", f"--metrics-port={ports.metrics}"])
    assert result.exit_code == 0, result.output
    server = seen["server"]
    assert "--http-address=0.0.0.0" in seen["log"]
    assert server.api_key not in result.output
    assert f"API key  in {server.key_path} (readable by you alone) (send it as the dspark-api-key header" in result.output
    assert seen["key file"] == (server.api_key + "\n", 0o600) and seen["folder mode"] == 0o700
    assert not server.key_path.exists()
    assert (f"warning: --host 0.0.0.0 makes the server reachable from other machines (HTTP port {ports.http}, "
            f"gRPC port {ports.grpc})") in result.output
    assert f"HTTP     http://127.0.0.1:{ports.http}" in result.output
    # the metrics port (no key, every model's name) stays on loopback though --host is public
    assert "--metrics-address=127.0.0.1" in seen["log"] and "--metrics-host" not in result.output
    assert f"metrics  http://127.0.0.1:{ports.metrics}/metrics" in result.output


def test_metrics_host_opts_the_metrics_port_out_of_loopback_with_a_warning(tmp_path, monkeypatch):
    binary = fake_server(tmp_path, "")
    binary.write_text(FAKE_TRITON)
    seen = {}

    def stop_at_once(server, _api=None, _ready=""):
        seen["log"] = server.log_text()
        server.stop()

    monkeypatch.setattr("dspark.cli.serve.serve_until_signal", stop_at_once)
    ports = ServerPorts.free()
    result = CliRunner().invoke(cli, ["serve", "--server", str(binary), "-r", str(tmp_path), "--metrics-host", "0.0.0.0",
                                      f"--http-port={ports.http}", f"--grpc-port={ports.grpc}",
                                      f"--metrics-port={ports.metrics}"])
    assert result.exit_code == 0, result.output
    assert "--metrics-address=0.0.0.0" in seen["log"] and "--http-address=127.0.0.1" in seen["log"]
    assert (f"warning: --metrics-host 0.0.0.0 makes metrics port {ports.metrics} reachable from other machines, "
            "without a key") in result.output
    assert "--host" not in result.output
    with pytest.raises(ServerError, match="--metrics-host 'example.com': expected an IP address"):
        TritonServer(repositories=[tmp_path], metrics_host="example.com")


def test_serve_takes_the_key_from_the_environment_and_does_not_print_it(tmp_path, monkeypatch):
    binary = fake_server(tmp_path, "")
    binary.write_text(FAKE_TRITON)
    key = "k" * 20
    monkeypatch.setenv("DSPARK_API_KEY", key)
    monkeypatch.setattr("dspark.cli.serve.serve_until_signal", lambda server, _api=None, _ready="": server.stop())
    ports = ServerPorts.free()
    result = CliRunner().invoke(cli, ["serve", "--server", str(binary), "-r", str(tmp_path),
                                      "--model-control", "explicit", f"--http-port={ports.http}",
                                      f"--grpc-port={ports.grpc}", f"--metrics-port={ports.metrics}"])
    assert result.exit_code == 0, result.output
    assert "API key  from --api-key / DSPARK_API_KEY" in result.output and key not in result.output


def test_a_host_that_is_not_an_address_is_refused(tmp_path):
    with pytest.raises(ServerError, match="--host 'example.com': expected an IP address"):
        TritonServer(repositories=[tmp_path], host="example.com")


def serve_refusal(tmp_path, pattern: str) -> str:
    """The one line `dspark serve --forward-headers pattern` fails with."""
    ports = ServerPorts.free()
    result = CliRunner().invoke(cli, ["serve", "-r", str(tmp_path), "--forward-headers", pattern,
                                      f"--http-port={ports.http}", f"--grpc-port={ports.grpc}",
                                      f"--metrics-port={ports.metrics}"])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    return lines[0]


@pytest.mark.parametrize("pattern", ["dspark-.*", "api-key", "(?i)DSPARK-API", "protocol-dspark",
                                     "^dspark-[[:lower:]-]+$", r"^dspark-\pL+-\pL+$", "^Dspark-Api-Key$"])
def test_a_header_pattern_that_would_forward_the_api_key_is_refused(tmp_path, pattern):
    assert "would hand every model the API key" in serve_refusal(tmp_path, pattern)


@pytest.mark.parametrize("pattern", ["^dspark-(?=tier)", r"^dspark-(tier)\1$", "[a-"])
def test_a_header_pattern_triton_cannot_compile_is_refused_in_one_line(tmp_path, pattern):
    assert "not a regular expression Triton (RE2) accepts" in serve_refusal(tmp_path, pattern)


def test_the_default_header_pattern_forwards_the_router_headers_and_not_the_key():
    http_flag = header_forward_args(DEFAULT_HEADER_PATTERN)[0]
    pattern = http_flag.split("=", 1)[1]
    assert [name for name in ("dspark-tier", "dspark-user-id", "dspark-tierx", API_KEY_HEADER, GRPC_API_KEY_HEADER)
            if re2.search(pattern, name)] == ["dspark-tier", "dspark-user-id"]


# Run under the guard library: prints the argument it got, the same argument as the process list
# shows it, and whether $DSPARK_KEY_FD is still set.
GUARD_PROBE = ("import os, sys; print(sys.argv[1]); print(open('/proc/self/cmdline').read().split(chr(0))[3]); "
               "print(os.environ.get('DSPARK_KEY_FD'))")


def _under_guard(environment: dict, key_fd=None, umask: int = 0o022, code: str = GUARD_PROBE):
    return subprocess.run([sys.executable, "-c", code, f"--http-restricted-api=logging:dspark-api-key={KEY_MARKER}"],
                          env=environment, pass_fds=() if key_fd is None else (key_fd,), umask=umask,
                          capture_output=True, text=True, timeout=60)


def test_the_guard_library_hands_the_key_to_the_program_but_not_to_the_process_list(tmp_path):
    server = TritonServer(repositories=[tmp_path], api_key="k" * 24)
    environment, key_fd = server.launch_environment(find_server())
    try:
        run = _under_guard(environment, key_fd)
    finally:
        os.close(key_fd)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["--http-restricted-api=logging:dspark-api-key=" + "k" * 24,
                                       f"--http-restricted-api=logging:dspark-api-key={KEY_MARKER}", "None"]


@pytest.mark.parametrize("case", ["no pipe", "short key"])
def test_the_guard_library_stops_a_program_whose_key_did_not_come(tmp_path, case):
    """Else the server would take the marker, which anyone reads in the process list, for its key."""
    environment = TritonServer(repositories=[tmp_path]).environment(find_server())
    key_fd = None
    if case == "short key":
        key_fd, key_write = os.pipe()
        os.write(key_write, b"short")
        os.close(key_write)
        environment[KEY_FD_ENV] = str(key_fd)
    try:
        run = _under_guard(environment, key_fd)
    finally:
        if key_fd is not None:
            os.close(key_fd)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.startswith("error: dspark server guard: ")
    assert ("names no pipe with the key" if case == "no pipe" else "is not 16 to 256 characters") in run.stderr


def test_the_guard_library_keeps_the_umask_on_shared_memory_that_boost_would_open_to_all(tmp_path):
    """Boost.Interprocess creates a region, then fchmod()s it to 0644: under the guard and umask 077
    the region stays 0600, while fchmod of a file elsewhere is left alone."""
    region = Path(f"/dev/shm/dspark_test_{os.getpid()}_{secrets.token_hex(4)}")
    other = tmp_path / "other"
    code = ("import os, sys\nfor path in sys.argv[2:]:\n"
            "    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)\n    os.fchmod(fd, 0o644)\n")
    environment = TritonServer(repositories=[tmp_path]).environment(find_server())
    try:
        run = subprocess.run([sys.executable, "-c", code, "-", str(region), str(other)], env=environment,
                             umask=SERVER_UMASK, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        assert stat.S_IMODE(region.stat().st_mode) == 0o600
        assert stat.S_IMODE(other.stat().st_mode) == 0o644
    finally:
        region.unlink(missing_ok=True)


def test_the_kubernetes_entrypoint_hands_the_key_through_the_pipe(tmp_path):
    """deploy/k8s/entrypoint.py execs the server itself: the fake gets DSPARK_API_KEY's key in its
    arguments (it prints them, then waits without listening), its command line holds only the marker."""
    binary = fake_server(tmp_path, "")
    binary.write_text(FAKE_TRITON)
    key = secrets.token_urlsafe(32)
    environment = {**os.environ, "TRITONSERVER": str(binary), "DSPARK_API_KEY": key, "FAKE_EXIT_AFTER_S": "30",
                   "LOCAL_REPOSITORY": str(tmp_path), "MODEL_REPOSITORY": str(tmp_path)}
    entrypoint = subprocess.Popen([sys.executable, str(project_root() / "deploy/k8s/entrypoint.py")],
                                  env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        arguments = entrypoint.stdout.readline()
        assert f"--http-restricted-api=model-repository,shared-memory,logging,trace,statistics:" \
               f"{API_KEY_HEADER}={key}" in arguments, arguments
        command_line = Path(f"/proc/{entrypoint.pid}/cmdline").read_bytes()
        assert KEY_MARKER.encode() in command_line and key.encode() not in command_line
    finally:
        entrypoint.kill()
        entrypoint.wait(timeout=30)


@pytest.mark.parametrize("where", ["repository", "model", "version"])
@pytest.mark.parametrize("control", ["none", "explicit", "poll"])
def test_a_repository_others_can_write_is_refused_unless_allowed_with_a_warning(tmp_path, monkeypatch, where,
                                                                                 control):
    """In poll mode Triton loads a model.py another user drops into a 1777 folder, and runs it as
    the server's user: refused in one line naming the folder; --allow-shared-repository serves it
    with a warning naming it."""
    binary = fake_server(tmp_path / "triton", "")
    binary.write_text(FAKE_TRITON)
    repository = tmp_path / "repo"
    folder = {"repository": repository, "model": repository / "m", "version": repository / "m/1"}[where]
    (repository / "m/1").mkdir(parents=True)
    folder.chmod(0o1777)
    ports = ServerPorts.free()
    args = ["serve", "--server", str(binary), "-r", str(repository), "--model-control", control,
            f"--http-port={ports.http}", f"--grpc-port={ports.grpc}", f"--metrics-port={ports.metrics}"]
    refused = CliRunner().invoke(cli, args)
    assert refused.exit_code == 1
    assert refused.output.strip() == (f"dspark: model folder {folder} is writable by others (mode 1777): whoever can "
                                      "write there can have the server run their code as you; chmod go-w it, or "
                                      "pass --allow-shared-repository")
    monkeypatch.setattr("dspark.cli.serve.serve_until_signal", lambda server, _api=None, _ready="": server.stop())
    allowed = CliRunner().invoke(cli, [*args, "--allow-shared-repository"])
    assert allowed.exit_code == 0, allowed.output
    assert f"dspark: warning: model folder {folder} is writable by others (mode 1777)" in allowed.output
    folder.chmod(0o775)
    with pytest.raises(ServerError, match=f"model folder {folder} is writable by its group"):
        TritonServer(repositories=[repository], model_control=control)


def _wait_for(condition, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def _fake_pids(binary: Path) -> list[int]:
    """Processes running the fake tritonserver script ``binary``."""
    return [p.pid for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[1:2] == [str(binary)]]


def test_a_signal_while_the_server_starts_stops_it_instead_of_leaving_it_alone(tmp_path, private_tmpdir,
                                                                              monkeypatch):
    """SIGTERM to `dspark serve` before the server is ready: the handlers are in place before
    tritonserver starts, so serve stops it (and its folder goes) rather than dying and leaving
    it running on its ports, in its own session, with a key nobody was shown."""
    binary = fake_server(tmp_path, "")
    binary.write_text(FAKE_TRITON)
    monkeypatch.setenv("FAKE_READY_AFTER_S", "600")
    monkeypatch.setenv("TMPDIR", str(private_tmpdir))
    ports = ServerPorts.free()
    serve = subprocess.Popen([str(Path(sys.executable).parent / "dspark"), "serve", "--server", str(binary),
                              "-r", str(tmp_path), f"--http-port={ports.http}", f"--grpc-port={ports.grpc}",
                              f"--metrics-port={ports.metrics}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        assert _wait_for(lambda: _fake_pids(binary)), "the fake server never started"
        [server_pid] = _fake_pids(binary)
        serve.send_signal(signal.SIGTERM)
        output, _ = serve.communicate(timeout=60)
    finally:
        serve.kill()
    assert serve.returncode == 128 + signal.SIGTERM, output
    assert "dspark: SIGTERM while the server was starting; stopped it" in output
    assert not psutil.pid_exists(server_pid) or psutil.Process(server_pid).status() == psutil.STATUS_ZOMBIE
    assert list(private_tmpdir.iterdir()) == []


@pytest.mark.parametrize("when", ["starting", "ready"])
def test_the_server_dies_with_the_process_that_started_it(tmp_path, monkeypatch, when):
    """The launcher killed (SIGKILL: no handler runs): the guard library's PR_SET_PDEATHSIG has
    the kernel send tritonserver SIGTERM, and it drains and exits instead of running alone."""
    binary = fake_server(tmp_path, "")
    binary.write_text(FAKE_TRITON)
    if when == "starting":
        monkeypatch.setenv("FAKE_READY_AFTER_S", "600")
    code = ("import sys; from pathlib import Path; from dspark.server.launcher import TritonServer; "
            "s = TritonServer(repositories=[Path(sys.argv[1])], server_path=sys.argv[2]); s.start(); "
            "print('ready', flush=True); s.wait()")
    launcher = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(binary)], stdout=subprocess.PIPE,
                                text=True)
    try:
        if when == "ready":
            assert launcher.stdout.readline() == "ready\n"
        assert _wait_for(lambda: _fake_pids(binary)), "the fake server never started"
        [server_pid] = _fake_pids(binary)
        launcher.kill()
        launcher.wait()
        gone = _wait_for(lambda: not psutil.pid_exists(server_pid), timeout_s=20)
    finally:
        for pid in _fake_pids(binary):
            os.kill(pid, signal.SIGKILL)
    assert gone, "tritonserver outlived the process that started it"


def test_a_server_killed_from_outside_is_reported_with_its_own_reason_and_its_regions_removed(
        tmp_path, monkeypatch, capsys):
    """SIGKILL to tritonserver while `dspark serve` waits: the message says it was killed, not
    an error line from its start it had served on after, and its stubs' regions are gone."""
    binary = fake_server(tmp_path, "")
    binary.write_text(FAKE_TRITON)
    region = Path(f"/dev/shm/dspark_test_{os.getpid()}_{secrets.token_hex(4)}")
    monkeypatch.setenv("FAKE_SHM_REGION", region.name)
    monkeypatch.setenv("FAKE_OLD_ERROR", "an old failure it served on after")
    server = TritonServer(repositories=[tmp_path], server_path=str(binary))
    server.start(timeout_s=20)
    try:
        assert region.exists()
        killer = threading.Timer(0.5, os.kill, (server._process.pid, signal.SIGKILL))
        killer.start()
        with pytest.raises(SystemExit) as exited:
            serve_cli.serve_until_signal(server)
    finally:
        server.stop()
        left = region.exists()
        region.unlink(missing_ok=True)
    assert exited.value.code == 1 and not left
    error = capsys.readouterr().err
    assert f"dspark: tritonserver exited with code -9: killed by SIGKILL (log: {server.log_path})" in error
    assert "old failure" not in error
    assert "dspark: removed the 1 shared-memory regions its model stubs left" in error


def test_key_inference_restricts_inference_too(tmp_path):
    """A region is named in an inference request, which Triton resolves before any backend sees
    it: --key-inference puts inference behind the key (tests/integration/test_shared_memory_names.py
    shows a keyless caller refused, region or not, and the OpenAI API sending the key)."""
    install = find_server()
    args = TritonServer(repositories=[tmp_path], key_inference=True).command(install, tmp_path)
    apis = "model-repository,shared-memory,logging,trace,statistics,inference"
    assert f"--http-restricted-api={apis}:{API_KEY_HEADER}={KEY_MARKER}" in args
    assert f"--grpc-restricted-protocol={apis}:{API_KEY_HEADER}={KEY_MARKER}" in args
