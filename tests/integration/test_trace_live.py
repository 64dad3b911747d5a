"""`dspark trace` on a real server under requests: it attaches to tritonserver and its Python
backend stubs (the fast spec_toy fixture, and the demo repository's spec_lm: SmolLM2-135M on
dspark's kernels), and its report's counts agree with the requests sent and the server's own
metrics: request probes = requests, round probes = the dspark_speculative_target_passes_total
delta over the same window. Root and bpftrace needed."""
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
from tests.conftest import dump_log_on_failure, serving as serve_repositories
from dspark.paths import demo_repositories

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("bpftrace") is None or not serving.BUILT,
                                reason="dspark trace needs root, bpftrace and a build with the probes")
PASSES = "dspark_speculative_target_passes_total"


OTHER = """
import time
from dspark._ext import probes
while True:
    probes.request_start("other", "none", 1)
    probes.request_end("other", "none", 1, 1, 0.0, 0.0)
    time.sleep(0.005)
"""


# model -> (its name, the methods of the requests sent): the toy fixture, and SmolLM2 with a few short requests
SERVED = {"spec_toy": (MODEL, ("draft", "ngram", "hybrid")), "spec_lm": ("spec_lm", ("none", "suffix"))}


@pytest.fixture(scope="module", params=list(SERVED))
def served(request):
    model, methods = SERVED[request.param]
    if model == MODEL:
        server = toy_server(request)
        yield server, model, methods
        dump_log_on_failure(request, server, server.failed_before)
        server.stop()
    else:
        with serve_repositories(request, demo_repositories(), model_control="explicit", load_models=[model]) as server:
            yield server, model, methods


def test_the_report_counts_the_requests_and_the_rounds(served, tmp_path):
    server, model, methods = served
    assert completion_ok(server, model)  # the stubs have imported the probes before the trace starts
    dspark = Path(sys.executable).with_name("dspark")
    raw = tmp_path / "bpftrace.out"
    # another process firing the same probes: the report counts the server's alone
    other = subprocess.Popen([sys.executable, "-c", OTHER])
    png = tmp_path / "trace.png"
    tracer = subprocess.Popen([str(dspark), "trace", "--pid", str(server._process.pid), "--duration", "60",
                               "--raw", str(raw), "--png", str(png)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = tracer.stderr.readline()
            assert line, "dspark trace ended before it attached"
            if line.strip() == "attached":
                break
        passes = metric(server, model, PASSES)
        sent = 0
        for method in methods:
            reply = generate(server, model, PROMPT, max_tokens=16, speculative={"method": method})
            assert reply.status_code == 200, reply.text
            sent += 1
        result = stream_once(server, model, PROMPT, {"max_tokens": 16, "speculative": {"method": methods[0]}})
        assert result.error is None
        sent += 1
        rounds = metric(server, model, PASSES) - passes
        tracer.send_signal(2)  # Ctrl-C: the report of what was traced so far
        out, err = tracer.communicate(timeout=60)
    finally:
        other.kill()
        other.wait()
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
    # the picture: a PNG of the split on top and one histogram per duration the report lists
    histograms = len(re.findall(r"^\w+ +\d+ +\d+ +\d+ +\d+$", out, re.M))
    assert histograms >= 4, out
    width, height = png_size(png)
    assert (width, height) == (800, int(round(2.2 * (1 + (histograms + 1) // 2) * 100)))


def png_size(path: Path) -> tuple[int, int]:
    """A PNG's width and height from its IHDR chunk (fails on anything that is not a PNG)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def completion_ok(server, model: str = MODEL) -> bool:
    return generate(server, model, PROMPT, max_tokens=4).status_code == 200


KERNEL_CHILD = """
import sys
import numpy as np
from dspark._ext.pool import RawPool
pool = RawPool(arena_bytes=1 << 20)
print("ready", flush=True)
sys.stdin.readline()
blocks = [pool.empty((256, 256), np.float32) for _ in range(8)]  # 8 x 256 KiB: the pool grows
del blocks
print("done", flush=True)
sys.stdin.readline()
"""


def test_a_kernel_probe_fires_with_its_arguments(tmp_path):
    """The BFC pool's probes, traced in a process that allocates: one pool_alloc and one
    pool_free per block, with the requested size, and at least one pool_grow."""
    from dspark.trace import probes
    child = subprocess.Popen([sys.executable, "-c", KERNEL_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    tracer = None
    try:
        assert child.stdout.readline().strip() == "ready"
        pool = probes.module_file("pool")
        program = ('BEGIN { printf("TRACING\\n"); } '
                   f'usdt:{pool}:dspark:pool_alloc {{ @alloc = count(); @requested[arg0] = count(); }} '
                   f'usdt:{pool}:dspark:pool_free {{ @free = count(); }} '
                   f'usdt:{pool}:dspark:pool_grow {{ @grow = count(); }}')
        tracer = subprocess.Popen(["bpftrace", "-p", str(child.pid), "-e", program], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)
        assert tracer.stdout.readline().startswith("Attaching")
        assert tracer.stdout.readline().startswith("TRACING")
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        child.stdin.write("\n")  # it exits, and so does bpftrace -p, printing its maps
        child.stdin.flush()
        child.wait(timeout=30)
        out, _ = tracer.communicate(timeout=60)
    finally:
        if tracer is not None and tracer.poll() is None:
            tracer.kill()
            tracer.wait()
        child.kill()
        child.wait()
    assert "@alloc: 8" in out and "@free: 8" in out, out
    assert f"@requested[{256 * 256 * 4}]: 8" in out, out
    assert re.search(r"@grow: [1-9]", out), out
