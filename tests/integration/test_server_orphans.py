"""A real tritonserver whose launcher dies without a word (SIGKILL: no handler, no finalizer)
does not run on alone: the guard library's PR_SET_PDEATHSIG SIGTERMs it, it unloads its models,
and its stubs and their shared-memory regions go with it."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dspark.paths import project_root

pytestmark = pytest.mark.integration

# Starts a server, prints its pid, its stubs' pids and their regions, waits.
LAUNCHER = """
import json, sys
import psutil
from dspark.server.launcher import TritonServer, shared_memory_regions
server = TritonServer(repositories=[sys.argv[1]], model_control="explicit", load_models=["mlp_classifier"],
                      exit_timeout_s=5)
server.start()
pid = server._process.pid
print(json.dumps({"server": pid, "stubs": [p.pid for p in psutil.Process(pid).children(recursive=True)],
                  "regions": sorted(map(str, shared_memory_regions(pid)))}), flush=True)
server.wait()
"""


def _kill(pids) -> None:
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


def test_a_server_whose_launcher_is_killed_exits_with_its_stubs_and_regions():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(project_root() / "model_repository")],
                                stdout=subprocess.PIPE, text=True)
    try:
        started = json.loads(launcher.stdout.readline())
    finally:
        launcher.kill()
        launcher.wait()
    processes = [started["server"], *started["stubs"]]
    try:
        assert started["stubs"] and started["regions"]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(psutil.pid_exists(pid) for pid in processes):
            time.sleep(0.2)
        assert [pid for pid in processes if psutil.pid_exists(pid)] == [], "the server or a stub outlived its launcher"
        assert [region for region in started["regions"] if Path(region).exists()] == []
    finally:
        _kill(processes)
