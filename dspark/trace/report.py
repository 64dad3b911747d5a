"""The report of a `dspark trace` run, made from bpftrace's output: the event lines the shipped
program prints ("E <probe> <tid> <ns> <args...>", "D <name> <tid> <ns> <us> ...") and the maps it
prints at exit ("@name: value", "@name[key]: value")."""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

_MAP = re.compile(r"^@(\w+)(?:\[(.*)\])?: (\d+)$")


@dataclass
class Trace:
    seconds: float = 0.0
    events: dict[str, list[list[str]]] = field(default_factory=lambda: defaultdict(list))
    durations: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    maps: dict[str, int] = field(default_factory=dict)
    keyed: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))

    def count(self, probe: str) -> int:
        return len(self.events.get(probe, ()))

    def column(self, probe: str, index: int) -> list[int]:
        """Integer argument ``index`` (after the tid and time) of every ``probe`` event."""
        return [int(event[index]) for event in self.events.get(probe, ())]


def parse(output: str, seconds: float = 0.0) -> Trace:
    trace = Trace(seconds=seconds)
    for line in output.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0] == "E":
            trace.events[parts[1]].append(parts[4:])
        elif len(parts) >= 5 and parts[0] == "D":
            trace.durations[parts[1]].append(int(parts[4]))
        else:
            found = _MAP.match(line.strip())
            if found:
                name, key, value = found.group(1), found.group(2), int(found.group(3))
                if key is None:
                    trace.maps[name] = value
                else:
                    trace.keyed[name][key] = value
    # a round's acceptance (sampling) time is the last field of its spec_round line
    trace.durations["accept"] = [int(e[3]) for e in trace.events.get("spec_round", ()) if len(e) > 3]
    trace.durations["verify_pass"] = trace.column("verify_batch", 2)
    trace.durations["queue_wait"] = trace.column("queue_wait", 1)
    return trace


def percentile(values: list[int], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))])


@dataclass(frozen=True)
class Summary:
    requests: int
    requests_started: int
    rounds: int
    output_tokens: int
    per_token_us: dict[str, float]  # draft, verify, sampling, streaming, waiting
    histograms: dict[str, tuple[int, float, float, float]]  # name -> (n, p50, p90, p99) in us
    offcpu_ms: dict[str, float]
    runq_mean_us: float
    per_request: dict[str, float]  # page faults, syscalls, futex calls


def summarize(trace: Trace) -> Summary:
    ends = trace.events.get("request_end", [])
    tokens = sum(int(e[2]) for e in ends)
    per = (lambda total: total / tokens) if tokens else (lambda total: 0.0)
    per_token = {
        "draft": per(sum(int(e[4]) for e in ends)),
        "verify": per(sum(int(e[5]) for e in ends)),
        "sampling": per(sum(trace.durations.get("accept", []))),
        "streaming": per(sum(trace.durations.get("stream_send", []))),
        "waiting": per(sum(trace.durations.get("queue_wait", []))),
    }
    histograms = {name: (len(values), percentile(values, 50), percentile(values, 90), percentile(values, 99))
                  for name, values in sorted(trace.durations.items()) if values}
    n = len(ends)
    per_request = {name: (trace.maps.get(name, 0) / n if n else 0.0)
                   for name in ("page_faults", "syscalls", "futex_calls")}
    runq_n = trace.maps.get("runq_n", 0)
    return Summary(requests=n, requests_started=trace.count("request_start"), rounds=trace.count("spec_round"),
                   output_tokens=tokens, per_token_us=per_token, histograms=histograms,
                   offcpu_ms={comm: us / 1e3 for comm, us in sorted(trace.keyed.get("offcpu_us", {}).items(),
                                                                   key=lambda kv: -kv[1])},
                   runq_mean_us=trace.maps.get("runq_total_us", 0) / runq_n if runq_n else 0.0,
                   per_request=per_request)


def format_report(summary: Summary, seconds: float) -> str:
    lines = [f"dspark trace: {seconds:.1f} s, {summary.requests} requests ended ({summary.requests_started} started), "
             f"{summary.rounds} speculative rounds, {summary.output_tokens} output tokens"]
    if summary.output_tokens:
        total = sum(summary.per_token_us.values())
        lines.append("per token (us): " + ", ".join(f"{name} {us:.0f}" for name, us in summary.per_token_us.items())
                     + f" (sum {total:.0f})")
    if summary.histograms:
        lines.append(f"{'durations (us)':<16} {'n':>7} {'p50':>9} {'p90':>9} {'p99':>9}")
        for name, (n, p50, p90, p99) in summary.histograms.items():
            lines.append(f"{name:<16} {n:>7} {p50:>9.0f} {p90:>9.0f} {p99:>9.0f}")
    if summary.offcpu_ms:
        lines.append("off-CPU (ms) by thread name: " + ", ".join(f"{comm} {ms:.0f}" for comm, ms in
                                                              list(summary.offcpu_ms.items())[:6]))
        lines.append(f"run-queue latency: mean {summary.runq_mean_us:.0f} us (runnable until on a CPU)")
    if summary.requests:
        lines.append("per request: " + ", ".join(f"{name.replace('_', ' ')} {value:.0f}"
                                                 for name, value in summary.per_request.items())
                     + " (futex calls: lock waits)")
    return "\n".join(lines)
