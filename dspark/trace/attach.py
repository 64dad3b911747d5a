"""What `dspark trace` needs and does: the checks (each failure one line with its fix), the
server's processes, the shipped bpftrace program filled in for them, running it for a while, and
the hardware counters through `perf stat`."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import psutil

from dspark.trace import probes

PROGRAMS = Path(__file__).resolve().parent / "programs"
TRACEFS = Path("/sys/kernel/tracing")
INSTALL = "apt-get install bpftrace systemtap-sdt-dev"
PMU_EVENTS = ("cycles", "instructions", "cache-references", "cache-misses", "branches", "branch-misses")


@dataclass(frozen=True)
class Missing:
    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}: {self.fix}"


def check(is_root: Callable[[], bool] = lambda: os.geteuid() == 0,
          which: Callable[[str], Optional[str]] = shutil.which,
          tracefs: Path = TRACEFS, mount: Optional[Callable[[], bool]] = None,
          probes_built: Optional[bool] = None) -> list[Missing]:
    """What stands between this machine and a trace; empty when nothing does. Mounts tracefs
    when it is not mounted and this process may."""
    missing = []
    root = is_root()
    if not root:
        missing.append(Missing("not root", "eBPF needs root (or CAP_BPF+CAP_PERFMON): run `sudo dspark trace ...`"))
    if which("bpftrace") is None:
        missing.append(Missing("bpftrace is not installed", f"`{INSTALL}` (or `make tracing`)"))
    if not (tracefs / "events").is_dir():
        mount = mount or (lambda: _mount_tracefs(tracefs))
        if not (root and mount()):
            missing.append(Missing(f"tracefs is not mounted at {tracefs}",
                                   f"`mount -t tracefs nodev {tracefs}` as root (the sched tracepoints need it)"))
    if probes_built is None:
        from dspark._ext import probes as serving
        probes_built = bool(serving.BUILT)
    if not probes_built:
        missing.append(Missing("dspark was built without USDT probes (<sys/sdt.h> was missing)",
                               f"`{INSTALL}`, then rebuild: `pip install --no-build-isolation --no-deps -e .`"))
    return missing


def _mount_tracefs(tracefs: Path) -> bool:
    result = subprocess.run(["mount", "-t", "tracefs", "nodev", str(tracefs)], capture_output=True)
    return result.returncode == 0 and (tracefs / "events").is_dir()


def server_on_port(port: int) -> Optional[int]:
    """The pid of the process listening on TCP ``port``."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            return conn.pid
    return None


def server_pids(pid: int) -> list[int]:
    """The server and its children (the Python backend stubs, where the serving probes fire)."""
    try:
        process = psutil.Process(pid)
        return [pid] + [child.pid for child in process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def program(pids: list[int], name: str = "serve.bt") -> str:
    """The shipped program with the modules' paths and the processes filled in."""
    text = (PROGRAMS / name).read_text()
    predicate = "(" + " || ".join(f"pid == {p}" for p in pids) + ")"
    for placeholder, module in (("$PROBES_SO", "probes"), ("$LLAMA_SO", "llama")):
        path = probes.module_file(module)
        text = text.replace(placeholder, str(path) if path else f"/missing/{module}.so")
    return text.replace("$PIDS", predicate)


def run_bpftrace(text: str, seconds: Optional[float], on_start: Callable[[], None] = lambda: None,
                 attach_timeout_s: float = 120) -> tuple[str, str, float]:
    """Run a program until it is attached (its BEGIN prints TRACING), then for ``seconds`` (None:
    until Ctrl-C); (stdout, stderr, seconds traced). ``on_start`` runs once it is attached."""
    process = subprocess.Popen(["bpftrace", "--usdt-file-activation", "-e", text], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    attached = threading.Event()

    def read() -> None:
        for line in process.stdout:
            if line.startswith("TRACING"):
                attached.set()
            lines.append(line)
        attached.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    traced = 0.0
    try:
        attached.wait(attach_timeout_s)
        if process.poll() is None:
            started = time.monotonic()
            on_start()
            try:
                process.wait(timeout=seconds)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                pass
            traced = time.monotonic() - started
    finally:
        for _ in range(6):  # bpftrace prints its maps and exits; a SIGINT is now and then not seen
            if process.poll() is not None:
                break
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if process.poll() is None:
            process.kill()
            process.wait()
        reader.join(10)
    return "".join(lines), process.stderr.read(), traced


def pmu(pid: Optional[int], seconds: float) -> tuple[dict[str, Optional[float]], str]:
    """The hardware counters of ``pid`` (or the whole machine) over ``seconds`` through `perf
    stat`: ({event: value or None where not supported}, one line to print)."""
    if shutil.which("perf") is None:
        return {}, "perf is not installed: `apt-get install linux-perf`"
    target = ["-p", str(pid)] if pid else ["-a"]
    result = subprocess.run(["perf", "stat", "-x,", "-e", ",".join(PMU_EVENTS), *target, "sleep", str(seconds)],
                            capture_output=True, text=True)
    values = parse_perf_stat(result.stderr)
    if not values or all(v is None for v in values.values()):
        return values, ("hardware counters (PMU) are not supported on this machine: perf stat reports "
                        + ", ".join(PMU_EVENTS) + " as <not supported> (a VM without a virtual PMU)")
    shown = ", ".join(f"{name} {value:.3g}" if value is not None else f"{name} n/a" for name, value in values.items())
    ipc = ""
    if values.get("cycles") and values.get("instructions"):
        ipc = f", IPC {values['instructions'] / values['cycles']:.2f}"
    return values, f"PMU over {seconds:g} s: {shown}{ipc}"


def parse_perf_stat(csv_text: str) -> dict[str, Optional[float]]:
    """`perf stat -x,` lines: value,unit,event,... ('<not supported>' or '<not counted>' as None)."""
    values: dict[str, Optional[float]] = {}
    for line in csv_text.splitlines():
        fields = line.split(",")
        if len(fields) < 3 or fields[2] not in PMU_EVENTS and fields[2].split(":")[0] not in PMU_EVENTS:
            continue
        event = fields[2].split(":")[0]
        try:
            values[event] = float(fields[0])
        except ValueError:
            values[event] = None
    return values
