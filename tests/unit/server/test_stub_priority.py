"""New Python backend stubs start at a lower CPU priority and get the server's back once Triton
logs that their model loaded (dspark/server/stub_priority.py)."""
import os
import subprocess
import sys
import time

import psutil
import pytest

from dspark.errors import ConfigError
from dspark.server import stub_priority


def test_the_start_offset_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(stub_priority.START_NICE_ENV, "lots")
    with pytest.raises(ConfigError, match="DSPARK_STUB_START_NICE.*'lots' is not a whole number"):
        stub_priority.start_nice()
    monkeypatch.setenv(stub_priority.START_NICE_ENV, "0")
    assert stub_priority.start_nice() == 0
    monkeypatch.setenv(stub_priority.START_NICE_ENV, "40")
    restorable = stub_priority.can_restore(os.getpriority(os.PRIO_PROCESS, 0))
    # lowered only where the priority can be given back, and never past nice's range
    assert stub_priority.start_nice() == (19 if restorable else 0)


def test_a_wrapped_stub_runs_the_real_binary_lower_with_its_arguments(tmp_path):
    stub = tmp_path / "triton_python_backend_stub"
    stub.write_text('#!/bin/sh\ncut -d" " -f19 /proc/self/stat\nprintf "%s|" "$@"\n')
    stub.chmod(0o755)
    stub_priority.wrap_stub(stub, 7)
    assert (tmp_path / "real" / "triton_python_backend_stub").is_file()  # the binary keeps its name
    nice, args = subprocess.run([str(stub), "a", "b c"], capture_output=True, text=True,
                                check=True).stdout.split("\n", 1)
    assert int(nice) == os.getpriority(os.PRIO_PROCESS, 0) + 7
    assert args == "a|b c|"


def test_children_get_the_server_priority_back_once_a_model_loaded(tmp_path):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if not stub_priority.can_restore(base):  # nothing could give it back: stubs are not lowered
        os.environ.pop(stub_priority.START_NICE_ENV, None)
        assert stub_priority.start_nice() == 0
        return
    log = tmp_path / "server.log"
    log.write_bytes(b"I1203 loading: model:1\n")
    child = subprocess.Popen(["nice", "-n", "8", sys.executable, "-c", "import time; time.sleep(30)"])
    keeper = stub_priority.PriorityKeeper(os.getpid(), log, poll_s=0.01).start()
    try:
        deadline = time.monotonic() + 5
        while psutil.Process(child.pid).nice() != base + 8 and time.monotonic() < deadline:
            time.sleep(0.01)  # nice has exec'd python
        time.sleep(0.1)
        assert psutil.Process(child.pid).nice() == base + 8  # still loading: stays low
        with open(log, "ab") as out:
            out.write(b"I1203 model_lifecycle.cc:839] successfully loaded 'model'\n")
        while psutil.Process(child.pid).nice() != base and time.monotonic() < deadline:
            time.sleep(0.01)
        assert psutil.Process(child.pid).nice() == base and keeper.restored == 1
    finally:
        keeper.stop()
        child.kill()
        child.wait()
