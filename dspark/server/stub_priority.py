"""New Python backend stubs start at a lower CPU priority and get the server's back once their
model is loaded.

On every load Triton reloads every version of a model: it starts a fresh stub process per
instance of each version (and one per version that completes its config), and each imports
Python, numpy and the model and runs its warm-up before Triton swaps it in. On a small machine
that start-up takes the cores from the stubs and the router that serve the traffic meanwhile
(2 cores: the p99 of a 10 ms model behind the router rose 2-5x while a version loaded). So the
stub is launched through a wrapper that execs it under ``nice``, and a thread of the process
that started the server reads Triton's log: once a model is loaded (or failed to load, its stubs
then exit), every stub above the server's nice value gets the server's value back.

Giving the priority back needs CAP_SYS_NICE (root) or an RLIMIT_NICE that allows the server's
value (``ulimit -e``); without either nothing could give it back, so stubs start at the normal
priority. ``DSPARK_STUB_START_NICE`` sets how much lower (default 10; 0: off).
"""
from __future__ import annotations

import os
import re
import resource
import shutil
import threading
from pathlib import Path
from typing import Optional

import psutil

from dspark.errors import ConfigError

START_NICE_ENV = "DSPARK_STUB_START_NICE"
DEFAULT_START_NICE = 10
CAP_SYS_NICE = 23
# Triton's line once a model's every version is ready (its new stubs swapped in), or failed
_LOADED = re.compile(rb"successfully loaded '|failed to load '")


def start_nice() -> int:
    """How much lower new stubs start (0: they start at the server's priority)."""
    text = os.environ.get(START_NICE_ENV, str(DEFAULT_START_NICE))
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(START_NICE_ENV, f"{text!r} is not a whole number (0 turns it off)") from None
    if value <= 0 or shutil.which("nice") is None or not can_restore(os.getpriority(os.PRIO_PROCESS, 0)):
        return 0
    return min(value, 19)


def can_restore(base: int) -> bool:
    """Whether this process (and so the server it starts) may set a stub's nice value back to ``base``."""
    try:
        status = Path("/proc/self/status").read_text()
        effective = int(next(line.split()[1] for line in status.splitlines() if line.startswith("CapEff:")), 16)
        if effective >> CAP_SYS_NICE & 1:
            return True
    except (OSError, StopIteration, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - soft <= base


def wrap_stub(stub: Path, nice: int) -> None:
    """Make ``stub`` a script that execs the real binary ``nice`` lower. The binary keeps its
    name (in a ``real/`` folder beside it), so the running stub looks as it did to ps, psutil
    and the tools that find stubs by name."""
    real = stub.parent / "real" / stub.name
    real.parent.mkdir(exist_ok=True)
    stub.rename(real)
    stub.write_text(f'#!/bin/sh\nexec nice -n {nice} "{real}" "$@"\n')
    stub.chmod(0o755)


class PriorityKeeper:
    """A thread that follows the server's log and gives stubs the server's priority back
    whenever a model finished loading."""

    def __init__(self, pid: int, log_path: Path, poll_s: float = 0.05):
        self.pid, self.log_path, self.poll_s = pid, Path(log_path), poll_s
        self.restored = 0  # stubs given their priority back (tests, diagnosis)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "PriorityKeeper":
        self._thread = threading.Thread(target=self._run, name="stub-priority", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        with open(self.log_path, "rb") as log:
            pending = b""
            while not self._stop.wait(self.poll_s):
                chunk = log.read()
                if not chunk:
                    continue
                complete, _, pending = (pending + chunk).rpartition(b"\n")
                if _LOADED.search(complete):
                    self.restore()

    def restore(self) -> None:
        """Every child of the server niced above it gets the server's nice value."""
        try:
            server = psutil.Process(self.pid)
            base, children = server.nice(), server.children()
        except psutil.Error:  # the server is gone
            return
        for child in children:
            try:
                if child.nice() > base:
                    child.nice(base)
                    self.restored += 1
            except psutil.Error:  # exited meanwhile, or not ours to change
                continue
