"""The probes' own cost, for `dspark trace --overhead`: the serving probes' calls timed against
an empty Python function of the same arguments, detached and (as root, with bpftrace) attached,
interleaved in rounds so that a busy machine moves both alike. What it prints is per call; a
decode round makes about five of them (accept_begin, spec_round, verify_batch, stream_begin/end)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Optional

from dspark._ext import probes as serving


def _empty(proposed: int, accepted: int, rows: int) -> None:
    return None


def _time(call, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        call(4, 2, 5)
    return (time.perf_counter() - started) / calls * 1e9


def measure(calls: int = 200_000, rounds: int = 5) -> dict[str, float]:
    """Median ns per call: the empty function, the detached probe, and their difference."""
    empty, probe = [], []
    for _ in range(rounds):
        empty.append(_time(_empty, calls))
        probe.append(_time(serving.spec_round, calls))
    empty.sort(), probe.sort()
    e, p = empty[len(empty) // 2], probe[len(probe) // 2]
    return {"empty_call_ns": e, "probe_call_ns": p, "probe_extra_ns": p - e}


def attached(calls: int, rounds: int, timeout_s: float = 120) -> Optional[dict[str, float]]:
    """The same with bpftrace counting spec_round in this process (None: bpftrace could not attach)."""
    path = serving.__file__
    program = f'BEGIN {{ printf("TRACING\\n"); }} usdt:{path}:dspark:spec_round {{ @rounds = count(); }}'
    tracer = subprocess.Popen(["bpftrace", "-p", str(os.getpid()), "-e", program], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = tracer.stdout.readline()
            if not line or line.startswith("TRACING"):
                break
        if tracer.poll() is not None:
            return None
        return measure(calls, rounds)
    finally:
        tracer.terminate()
        tracer.wait(timeout=30)


def main(calls: int, rounds: int, with_tracer: bool) -> str:
    lines = [f"serving probes built: {serving.BUILT} ({serving.__file__})"]
    detached = measure(calls, rounds)
    lines.append("detached: " + ", ".join(f"{k} {v:.1f}" for k, v in detached.items()))
    if with_tracer:
        result = attached(calls, rounds)
        lines.append("attached: " + (", ".join(f"{k} {v:.1f}" for k, v in result.items()) if result
                                     else "bpftrace did not attach (root and bpftrace needed)"))
    lines.append("decode tokens/s and router throughput built without probes, detached and attached: "
                 "`dspark bench trace` (docs/trace.md)")
    return "\n".join(lines)


if __name__ == "__main__":
    print(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200_000, 5, True))
