"""`dspark trace`'s report from bpftrace output, its checks (one line each, with the fix), the
program filled in for a server's processes, and the PMU line where the machine has no counters."""
from __future__ import annotations

from pathlib import Path

from dspark.trace import attach, report

OUTPUT = """Attaching 17 probes...
TRACING
E request_start 11 1000 spec_toy draft 12
E queue_wait 11 1100 spec_toy 250
E verify_batch 11 2000 1 5 800
E spec_round 11 2100 4 2 5 40
D stream_send 11 2200 30
E verify_batch 11 3000 1 5 1000
E spec_round 11 3100 4 3 5 60
D stream_send 11 3200 50
E request_end 11 4000 spec_toy draft 7 2 300 1800
D request 11 4000 3000
E request_start 12 5000 spec_toy draft 12


@offcpu_us[triton_python_b]: 5000
@offcpu_us[tritonserver]: 12000
@page_faults: 40
@syscalls: 300
@futex_calls: 20
@runq_n: 4
@runq_total_us: 200
@runq_us:
[0, 1]                 1 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@|
"""


def test_the_counts_and_the_per_token_times():
    summary = report.summarize(report.parse(OUTPUT, 2.0))
    assert (summary.requests, summary.requests_started, summary.rounds, summary.output_tokens) == (1, 2, 2, 7)
    assert summary.per_token_us == {"draft": 300 / 7, "verify": 1800 / 7, "sampling": 100 / 7,
                                    "streaming": 80 / 7, "waiting": 250 / 7}
    assert summary.histograms["verify_pass"] == (2, 800.0, 1000.0, 1000.0)
    assert summary.histograms["request"][0] == 1
    assert summary.offcpu_ms == {"tritonserver": 12.0, "triton_python_b": 5.0}
    assert summary.runq_mean_us == 50.0
    assert summary.per_request == {"page_faults": 40.0, "syscalls": 300.0, "futex_calls": 20.0}


def test_the_report_names_what_it_counted():
    text = report.format_report(report.summarize(report.parse(OUTPUT, 2.0)), 2.0)
    assert "1 requests ended (2 started), 2 speculative rounds, 7 output tokens" in text
    assert "per token (us): draft 43, verify 257" in text
    assert "off-CPU (ms) by thread name: tritonserver 12, triton_python_b 5" in text


def test_an_empty_trace_reports_zeroes():
    text = report.format_report(report.summarize(report.parse("TRACING\n", 1.0)), 1.0)
    assert "0 requests ended" in text and "per token" not in text


def test_percentiles():
    assert report.percentile([], 50) == 0.0
    assert report.percentile(list(range(1, 101)), 50) == 51.0
    assert report.percentile(list(range(1, 101)), 99) == 99.0


def _events(tmp_path: Path) -> Path:
    (tmp_path / "events").mkdir()
    return tmp_path


def test_nothing_missing(tmp_path):
    assert attach.check(lambda: True, lambda name: "/usr/bin/" + name, _events(tmp_path), probes_built=True) == []


def test_each_missing_thing_is_one_line_with_its_fix(tmp_path):
    missing = attach.check(lambda: False, lambda name: None, tmp_path, mount=lambda: True, probes_built=False)
    lines = [str(m) for m in missing]
    assert len(lines) == 4
    assert lines[0].startswith("not root: ") and "sudo" in lines[0]
    assert lines[1] == "bpftrace is not installed: `apt-get install bpftrace systemtap-sdt-dev` (or `make tracing`)"
    assert lines[2].startswith(f"tracefs is not mounted at {tmp_path}: `mount -t tracefs nodev {tmp_path}`")
    assert "without USDT probes" in lines[3] and "pip install" in lines[3]
    assert all("\n" not in line for line in lines)


def test_tracefs_is_mounted_when_root_may(tmp_path):
    mounted = []
    assert attach.check(lambda: True, lambda name: "/x", tmp_path, mount=lambda: mounted.append(1) or True,
                        probes_built=True) == []
    assert mounted == [1]
    failed = attach.check(lambda: True, lambda name: "/x", tmp_path, mount=lambda: False, probes_built=True)
    assert [m.what for m in failed] == [f"tracefs is not mounted at {tmp_path}"]


def test_the_program_is_filled_in_for_the_processes():
    text = attach.program([10, 20])
    assert "$PIDS" not in text and "$PROBES_SO" not in text and "$LLAMA_SO" not in text
    assert "/(pid == 10 || pid == 20)/" in text
    assert "probes.cpython" in text or "/missing/probes.so" in text


NOT_SUPPORTED = """<not supported>,,cycles,0,100.00,,
<not supported>,,instructions,0,100.00,,
<not supported>,,cache-references,0,100.00,,
<not supported>,,cache-misses,0,100.00,,
<not supported>,,branches,0,100.00,,
<not supported>,,branch-misses,0,100.00,,
"""


def test_perf_stat_output():
    assert set(attach.parse_perf_stat(NOT_SUPPORTED).values()) == {None}
    counted = attach.parse_perf_stat("1200,,cycles:u,100,100.00,,\n3600,,instructions:u,100,100.00,3.00,insn per cycle\n")
    assert counted == {"cycles": 1200.0, "instructions": 3600.0}


def test_the_pmu_says_once_where_it_is_not_supported(monkeypatch):
    class Done:
        stderr = NOT_SUPPORTED
    monkeypatch.setattr(attach.shutil, "which", lambda name: "/usr/bin/perf")
    monkeypatch.setattr(attach.subprocess, "run", lambda *a, **k: Done())
    values, line = attach.pmu(None, 0.1)
    assert line.startswith("hardware counters (PMU) are not supported on this machine")
    assert "\n" not in line


def test_the_pmu_without_perf(monkeypatch):
    monkeypatch.setattr(attach.shutil, "which", lambda name: None)
    assert attach.pmu(None, 0.1) == ({}, "perf is not installed: `apt-get install linux-perf`")


def test_the_png_holds_the_split_and_one_histogram_per_duration(tmp_path):
    from dspark.trace.plot import write_png

    trace = report.parse(OUTPUT, 2.0)
    summary = report.summarize(trace)
    path = tmp_path / "trace.png"
    titles = write_png(trace, summary, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    # the split on top, then the histograms two a row: accept, queue_wait, request, stream_send, verify_pass
    assert (width, height) == (800, 880)  # 8 x 2.2 inches a row, 4 rows, at 100 dpi
    assert titles[0].startswith("per output token: 361 us (7 tokens, 1 requests)")
    assert [t.split(":")[0] for t in titles[1:]] == ["accept", "queue_wait", "request", "stream_send", "verify_pass"]
    assert titles[-1] == "verify_pass: n 2, p50 800 us, p99 1000 us"


def test_the_png_of_an_empty_trace_says_so(tmp_path):
    from dspark.trace.plot import write_png

    trace = report.parse("TRACING\n", 1.0)
    titles = write_png(trace, report.summarize(trace), tmp_path / "empty.png")
    assert titles == ["per output token: no request ended in the window"]
    assert (tmp_path / "empty.png").read_bytes()[:4] == b"\x89PNG"
