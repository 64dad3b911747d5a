"""`dspark trace` on a real server under requests: it attaches to tritonserver and its Python
backend stubs (the fast spec_toy fixture), and its report's counts agree with the requests sent
and the server's own metrics: request probes = requests, round probes = the
dspark_speculative_target_passes_total delta over the same window. Root and bpftrace needed."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark._ext import probes as serving
from tests.integration.spec_client import generate, metric, stream_once
from tests.integration.test_spec_serving import MODEL, PROMPT, toy_server
from tests.conftest import dump_log_on_failure

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("bpftrace") is None or not serving.BUILT,
                                reason="dspark trace needs root, bpftrace and a build with the probes")
PASSES = "dspark_speculative_target_passes_total"


@pytest.fixture(scope="module")
def server(request):
    server = toy_server(request)
    yield server
    dump_log_on_failure(request, server, server.failed_before)
    server.stop()


def test_the_report_counts_the_requests_and_the_rounds(server, tmp_path):
    assert completion_ok(server)  # the stubs have imported the probes before the trace starts
    dspark = Path(sys.executable).with_name("dspark")
    raw = tmp_path / "bpftrace.out"
    tracer = subprocess.Popen([str(dspark), "trace", "--pid", str(server._process.pid), "--duration", "60",
                               "--raw", str(raw)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = tracer.stderr.readline()
            assert line, "dspark trace ended before it attached"
            if line.strip() == "attached":
                break
        passes = metric(server, MODEL, PASSES)
        sent = 0
        for method in ("draft", "ngram", "hybrid"):
            reply = generate(server, MODEL, PROMPT, max_tokens=16, speculative={"method": method})
            assert reply.status_code == 200, reply.text
            sent += 1
        result = stream_once(server, MODEL, PROMPT, {"max_tokens": 16, "speculative": {"method": "draft"}})
        assert result.error is None
        sent += 1
        rounds = metric(server, MODEL, PASSES) - passes
        tracer.send_signal(2)  # Ctrl-C: the report of what was traced so far
        out, err = tracer.communicate(timeout=60)
    finally:
        if tracer.poll() is None:
            tracer.kill()
            tracer.wait()
    print(out)  # the report, for pytest -s
    assert tracer.returncode == 0, err
    found = re.search(r"(\d+) requests ended \((\d+) started\), (\d+) speculative rounds, (\d+) output tokens", out)
    assert found, out
    ended, started, traced_rounds, tokens = map(int, found.groups())
    assert (ended, started) == (sent, sent), out
    assert traced_rounds == rounds > 0, out
    assert tokens > 0 and "per token (us): draft" in out and "off-CPU (ms)" in out
    assert raw.read_text().count("E spec_round ") == rounds


def completion_ok(server) -> bool:
    return generate(server, MODEL, PROMPT, max_tokens=4).status_code == 200
