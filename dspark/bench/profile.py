"""`bench profile`: attach the profilers that work without special kernels to a running server
for a set time, and keep their output beside the benchmark results.

- py-spy (from PyPI) samples the Python backend stubs (C++ processes embedding Python; py-spy
  finds their interpreter): a flame graph (SVG) per stub and a stack dump at the end. Attaching
  to another process needs ptrace rights (root, or kernel.yama.ptrace_scope 0 for your own).
- `perf stat` counts software events (task-clock, context switches, migrations, page faults) for
  the server and its stubs, and tries the hardware ones (cycles, instructions, cache misses); an
  event the kernel or the VM does not offer is reported as "not supported" by name.
Missing tools are reported, not fatal: the run keeps what it could measure.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dspark.bench.resources import serves, stub_instance

SOFTWARE_EVENTS = ("task-clock", "context-switches", "cpu-migrations", "page-faults")
HARDWARE_EVENTS = ("cycles", "instructions", "cache-misses", "branch-misses")


@dataclass
class ProfiledProcess:
    pid: int
    role: str   # "server" or "stub"
    name: str   # model instance name for a stub


@dataclass
class ProfileReport:
    duration_s: float
    processes: list[ProfiledProcess]
    files: list[str] = field(default_factory=list)
    perf_counters: list[dict] = field(default_factory=list)
    not_supported: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def find_processes(server: int, model: str | None = None) -> list[ProfiledProcess]:
    import psutil

    found = [ProfiledProcess(server, "server", psutil.Process(server).name())]
    stubs = []
    for child in psutil.Process(server).children(recursive=True):
        try:
            stubs.append(ProfiledProcess(child.pid, "stub", stub_instance(child.cmdline())))
        except psutil.Error:
            continue
    mine = [s for s in stubs if model and serves(s.name, model)]
    return found + (mine or stubs)


def tool(name: str) -> str | None:
    """A tool on PATH or next to this interpreter (pip puts py-spy in the virtualenv's bin/)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else shutil.which(name)


def parse_perf_csv(text: str) -> tuple[list[dict], list[str]]:
    """`perf stat -x,` output -> counters, and the events reported as not supported/counted."""
    counters, unsupported = [], []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split(",")
        if len(parts) < 3:
            continue
        value, unit, event = parts[0], parts[1], parts[2]
        if value.startswith("<not"):
            unsupported.append(f"{event} ({value.strip('<>')})")
            continue
        try:
            counters.append({"event": event, "value": float(value), "unit": unit})
        except ValueError:
            continue
    return counters, unsupported


def profile(server: int, duration_s: float, out_dir: Path, model: str | None = None, rate: int = 100) -> ProfileReport:
    out_dir.mkdir(parents=True, exist_ok=True)
    processes = find_processes(server, model)
    report = ProfileReport(duration_s, processes)
    running: list[tuple[str, subprocess.Popen, Path]] = []
    py_spy = tool("py-spy")
    if py_spy is None:
        report.problems.append("py-spy not found (pip install py-spy): no Python stacks")
    else:
        for proc in processes:
            if proc.role != "stub":
                continue
            svg = out_dir / f"pyspy_{proc.name}_{proc.pid}.svg"
            log = out_dir / f"pyspy_{proc.name}_{proc.pid}.log"
            running.append((f"py-spy {proc.name}", subprocess.Popen(
                [py_spy, "record", "--pid", str(proc.pid), "--duration", str(int(max(1, duration_s))),
                 "--rate", str(rate), "--format", "flamegraph", "--output", str(svg), "--nonblocking"],
                stdout=log.open("w"), stderr=subprocess.STDOUT), svg))
    perf = tool("perf")
    perf_out = out_dir / "perf_stat.csv"
    if perf is None:
        report.problems.append("perf not found (Debian: linux-perf): no counters")
    else:
        pids = ",".join(str(p.pid) for p in processes)
        events = ",".join(SOFTWARE_EVENTS + HARDWARE_EVENTS)
        running.append(("perf stat", subprocess.Popen(
            [perf, "stat", "-x,", "-e", events, "-p", pids, "-o", str(perf_out), "--", "sleep", str(duration_s)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), perf_out))
    deadline = time.monotonic() + duration_s + 30
    for what, process, output in running:
        try:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            report.problems.append(f"{what} did not finish in time")
            continue
        if output.is_file() and output.stat().st_size:
            report.files.append(output.name)
        else:
            detail = process.stderr.read().decode(errors="replace").strip() if process.stderr else ""
            log = output.with_suffix(".log")
            if not detail and log.is_file():
                detail = log.read_text(errors="replace").strip()
            report.problems.append(f"{what} wrote nothing (exit {process.returncode}): {detail[-300:]}")
    if py_spy is not None:
        for proc in processes:
            if proc.role == "stub":
                dump = subprocess.run([py_spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=60)
                path = out_dir / f"pyspy_dump_{proc.name}_{proc.pid}.txt"
                path.write_text(dump.stdout + dump.stderr)
                report.files.append(path.name)
    if perf_out.is_file():
        report.perf_counters, report.not_supported = parse_perf_csv(perf_out.read_text())
    (out_dir / "profile.json").write_text(json.dumps(report.to_json(), indent=1) + "\n")
    return report
