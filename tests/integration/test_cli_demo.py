"""The README's main job: `dspark demo` serves the demo repository and prints real answers."""
from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tritonclient.http as httpclient

from dspark.server.launcher import ServerPorts

pytestmark = pytest.mark.integration


def test_demo_serves_and_prints_inference_results():
    """The demo's answers from both LLMs, and the curl it prints answers while it keeps serving."""
    ports, openai_port = ServerPorts.free(), ServerPorts.free().http
    dspark = Path(sys.executable).parent / "dspark"
    process = subprocess.Popen(
        [str(dspark), "demo", f"--http-port={ports.http}", f"--grpc-port={ports.grpc}",
         f"--metrics-port={ports.metrics}", f"--openai-port={openai_port}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if "still serving" in line:
                break
        stdout = "".join(lines)
        assert "still serving" in stdout, stdout
        curl = re.search(r"try: (curl .+)", stdout).group(1)
        reply = subprocess.run(shlex.split(curl), capture_output=True, text=True, timeout=60)
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stdout
    assert f"http://127.0.0.1:{ports.http}" in stdout
    rows = re.findall(r"probabilities=\[([^\]]+)\]", stdout)
    assert len(rows) == 4  # two rows over HTTP, the same two through the ensemble over gRPC
    values = [[float(v) for v in row.split(",")] for row in rows]
    assert all(abs(sum(row) - 1) < 1e-3 for row in values)
    assert values[:2] == values[2:]  # the ensemble standardizes raw input into the same features
    spec = re.findall(r"(spec_lm|gemma_lm) \([^)]+\) (chat|code completion) over HTTP /generate.*"
                      r"plain \d+ ms, speculative \d+ ms, identical text: True\n  (.+)", stdout)
    assert [s[:2] for s in spec] == [("spec_lm", "chat"), ("gemma_lm", "chat"), ("spec_lm", "code completion")], stdout
    for model, kind, answer in spec[:2]:  # each chat answer is on topic
        assert any(word in answer for word in ("Rayleigh", "scatter", "sun", "light")), (model, answer)
    assert "def fibonacci(n):" in stdout and "return" in stdout
    assert f"OpenAI   http://127.0.0.1:{openai_port}/v1" in stdout
    for model in ("spec_lm", "gemma_lm"):
        answer = re.search(model + r" chat over the OpenAI API .*\n  (.+)", stdout)
        assert answer and any(w in answer.group(1) for w in ("Rayleigh", "scatter", "sun", "light")), stdout
    assert f"127.0.0.1:{openai_port}/v1/chat/completions" in curl and '"model": "gemma_lm"' in curl
    assert reply.returncode == 0, reply.stderr
    body = json.loads(reply.stdout)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"].strip(), body


def serve_one_model(ports: ServerPorts, *options: str) -> subprocess.Popen:
    """`dspark serve` on the demo repository with one model loaded (the demo test above serves
    them all), once it says it is ready."""
    dspark = Path(sys.executable).parent / "dspark"
    process = subprocess.Popen(
        [str(dspark), "serve", f"--http-port={ports.http}", f"--grpc-port={ports.grpc}",
         f"--metrics-port={ports.metrics}", "--model-control=explicit", "--load-model=mlp_classifier", *options],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "ready" in line:
            return process
    process.wait()
    pytest.fail("".join(lines))


def test_serve_forwards_sigterm_as_a_clean_shutdown():
    ports = ServerPorts.free()
    process = serve_one_model(ports)
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{ports.http}")
        assert client.is_model_ready("mlp_classifier")
        client.close()
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=60)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert "SIGTERM: stopping the server" in output
    with pytest.raises(Exception):
        httpclient.InferenceServerClient(f"127.0.0.1:{ports.http}").is_server_ready()


def test_exit_timeout_bounds_a_stop_that_a_client_connection_holds():
    """Triton serves open HTTP connections (idle keep-alive ones too) until its exit timeout."""
    ports = ServerPorts.free()
    process = serve_one_model(ports, "--exit-timeout=1")
    client = httpclient.InferenceServerClient(f"127.0.0.1:{ports.http}")
    try:
        assert client.is_server_ready()  # and keeps its connection open
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=60)[0]
        stopped_s = time.monotonic() - started
    finally:
        client.close()
        if process.poll() is None:
            process.kill()
    assert stopped_s < 10, f"the stop took {stopped_s:.1f} s with --exit-timeout=1 (the default waits 30 s)"
    assert process.returncode == 1 and "Exit timeout expired" in output, output
