"""The README's main job: `dspark demo` serves the demo repository and prints real answers."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.triton.server import ServerPorts

pytestmark = pytest.mark.integration


def test_demo_serves_and_prints_inference_results():
    ports, openai_port = ServerPorts.free(), ServerPorts.free().http
    dspark = Path(sys.executable).parent / "dspark"
    result = subprocess.run(
        [str(dspark), "demo", "--exit", f"--http-port={ports.http}", f"--grpc-port={ports.grpc}",
         f"--metrics-port={ports.metrics}", f"--openai-port={openai_port}"],
        capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"http://127.0.0.1:{ports.http}" in result.stdout
    rows = re.findall(r"probabilities=\[([^\]]+)\]", result.stdout)
    assert len(rows) == 4  # two rows over HTTP, the same two through the ensemble over gRPC
    values = [[float(v) for v in row.split(",")] for row in rows]
    assert all(abs(sum(row) - 1) < 1e-3 for row in values)
    assert values[:2] == values[2:]  # the ensemble standardizes raw input into the same features
    spec = re.findall(r"spec_lm \(SmolLM2-135M-Instruct\) (chat|code completion) over HTTP /generate.*"
                      r"plain \d+ ms, speculative \d+ ms, identical text: True", result.stdout)
    assert spec == ["chat", "code completion"], result.stdout
    assert "Rayleigh" in result.stdout or "scatter" in result.stdout  # the chat answer is on topic
    assert "def fibonacci(n):" in result.stdout and "return" in result.stdout
    assert f"OpenAI   http://127.0.0.1:{openai_port}/v1" in result.stdout
    answer = re.search(r"spec_lm chat over the OpenAI API .*\n  (.+)", result.stdout)
    assert answer and ("scatter" in answer.group(1) or "Rayleigh" in answer.group(1)), result.stdout
    curl = re.search(r"try: (curl .+)", result.stdout).group(1)
    assert f"127.0.0.1:{openai_port}/v1/chat/completions" in curl and '"model": "spec_lm"' in curl


def test_serve_forwards_sigterm_as_a_clean_shutdown():
    ports = ServerPorts.free()
    dspark = Path(sys.executable).parent / "dspark"
    process = subprocess.Popen(
        [str(dspark), "serve", f"--http-port={ports.http}", f"--grpc-port={ports.grpc}",
         f"--metrics-port={ports.metrics}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if "ready" in line:
                break
        assert any("ready" in line for line in lines), "".join(lines)
        import tritonclient.http as httpclient
        assert httpclient.InferenceServerClient(f"127.0.0.1:{ports.http}").is_server_ready()
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=60)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert "SIGTERM: stopping the server" in output
    with pytest.raises(Exception):
        httpclient.InferenceServerClient(f"127.0.0.1:{ports.http}").is_server_ready()
