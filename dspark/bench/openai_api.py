"""`bench openai`: what the OpenAI-compatible API adds over Triton's own generate endpoint.

One `dspark serve --openai-port` process serves the model; the same greedy request is sent in
interleaved pairs (so the machine's drift hits both) over keep-alive HTTP: Triton's
``/v2/models/M/generate`` against ``/v1/completions``, then streamed, ``generate_stream`` against
``/v1/completions`` with ``stream: true``, both read to the end. Reported: the medians, the median
of the pairs' differences per request at one token, and per streamed token at ``stream_tokens``
(the per-request difference taken off first), and the CPU the API's process spent on each, which
the machine's noise does not move as much as latency.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from dspark.bench.results import BenchResult, Metric
from dspark.bench.table import Column
from dspark.errors import UnavailableError

def _prompt() -> str:
    """Held-out text the models continue for longer than the streamed case asks (an instruction
    as a bare completion prompt gets EOS at once from an instruct model)."""
    from dspark.llm.evaluate import heldout_text

    return heldout_text(("for",))[:600]


@dataclass
class OpenAIBenchSettings:
    model: str = "spec_lm"
    pairs: int = 100           # interleaved pairs per case
    stream_tokens: int = 64    # tokens of the streamed case
    warmup: int = 5


def _serve(model: str) -> tuple[subprocess.Popen, str, str]:
    from dspark.server.launcher import ServerPorts

    ports, api = ServerPorts.free(), ServerPorts.free().http
    process = subprocess.Popen(
        [str(Path(sys.executable).with_name("dspark")), "serve", "--model-control", "explicit", "--load-model", model,
         f"--http-port={ports.http}", f"--grpc-port={ports.grpc}", f"--metrics-port={ports.metrics}",
         f"--openai-port={api}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "ready" in line:
            return process, f"http://127.0.0.1:{ports.http}", f"http://127.0.0.1:{api}/v1"
    raise UnavailableError("dspark serve did not become ready: " + "".join(lines[-5:]))


def _timed(call: Callable[[], int], api_process) -> tuple[float, int, float]:
    """Seconds, tokens, and the CPU seconds of the process that runs the API (user + system)."""
    cpu_before, start = sum(api_process.cpu_times()[:2]), time.perf_counter()
    tokens = call()
    return time.perf_counter() - start, tokens, sum(api_process.cpu_times()[:2]) - cpu_before


def run_openai_bench(settings: OpenAIBenchSettings, log: Callable[[str], None] = lambda _: None) -> BenchResult:
    import psutil
    import requests

    prompt = _prompt()
    process, triton, api = _serve(settings.model)
    api_process = psutil.Process(process.pid)  # `dspark serve`: the API's thread; Triton is its child
    http = requests.Session()
    model = settings.model

    def triton_call(tokens: int, stream: bool) -> int:
        body = {"text_input": prompt, "exclude_input_in_output": True, "stream": stream, "sampling_parameters":
                json.dumps({"max_tokens": tokens, "temperature": 0, "speculative": {"method": "none"}})}
        if not stream:
            reply = http.post(f"{triton}/v2/models/{model}/generate", json=body, timeout=120)
            reply.raise_for_status()
            return json.loads(reply.json()["usage"])["completion_tokens"]
        usage = 0
        with http.post(f"{triton}/v2/models/{model}/generate_stream", json=body, stream=True, timeout=120) as reply:
            reply.raise_for_status()
            for line in reply.iter_lines():
                if line.startswith(b"data: ") and b'"usage"' in line:
                    usage = json.loads(json.loads(line[6:])["usage"])["completion_tokens"]
        return usage

    def openai_call(tokens: int, stream: bool) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                "speculative": {"method": "none"}, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        with http.post(f"{api}/completions", json=body, stream=stream, timeout=120) as reply:
            reply.raise_for_status()
            if not stream:
                return reply.json()["usage"]["completion_tokens"]
            usage = 0
            for line in reply.iter_lines():
                if line.startswith(b"data: {") and b'"usage":{' in line.replace(b" ", b""):
                    usage = json.loads(line[6:])["usage"]["completion_tokens"]
        return usage

    rows = []
    try:
        per_request = per_request_cpu = 0.0
        for label, tokens, stream in (("per request, 1 token", 1, False),
                                      (f"streamed, {settings.stream_tokens} tokens", settings.stream_tokens, True)):
            for _ in range(settings.warmup):
                triton_call(tokens, stream), openai_call(tokens, stream)
            pairs = []
            for i in range(settings.pairs):
                calls = [("triton", triton_call), ("openai", openai_call)]
                if i % 2:
                    calls.reverse()
                timed = {name: _timed(lambda: call(tokens, stream), api_process) for name, call in calls}
                if timed["triton"][1] != timed["openai"][1]:
                    raise UnavailableError(f"the two endpoints generated {timed['triton'][1]} and "
                                           f"{timed['openai'][1]} tokens for the same greedy request")
                if timed["triton"][1] < tokens:
                    raise UnavailableError(f"the model stopped after {timed['triton'][1]} of {tokens} tokens; "
                                           "the comparison needs the full count")
                pairs.append((timed["triton"][0], timed["openai"][0], timed["triton"][1],
                              timed["openai"][2] - timed["triton"][2]))
            triton_s = statistics.median(p[0] for p in pairs)
            openai_s = statistics.median(p[1] for p in pairs)
            delta_ms = statistics.median(p[1] - p[0] for p in pairs) * 1e3
            cpu_ms = statistics.mean(p[3] for p in pairs) * 1e3  # CPU clock ticks: a mean, not a median
            row = {"case": label, "tokens": pairs[0][2], "triton_ms": triton_s * 1e3, "openai_ms": openai_s * 1e3,
                   "added_ms": delta_ms, "api_cpu_ms": cpu_ms}
            if stream:
                row["added_ms_per_token"] = (delta_ms - per_request) / max(1, pairs[0][2])
                row["api_cpu_ms_per_token"] = (cpu_ms - per_request_cpu) / max(1, pairs[0][2])
            else:
                per_request, per_request_cpu = delta_ms, cpu_ms
            rows.append(row)
            log(f"{label}: Triton {row['triton_ms']:.2f} ms, OpenAI {row['openai_ms']:.2f} ms, added {delta_ms:.2f} ms")
    finally:
        process.terminate()
        process.wait(timeout=60)
    columns = [Column("case"), Column("tokens", "tokens", "d"), Column("triton_ms", "Triton generate ms p50", ".2f"),
               Column("openai_ms", "OpenAI API ms p50", ".2f"), Column("added_ms", "added ms (p50 of pairs)", ".2f"),
               Column("added_ms_per_token", "added ms per token", ".3f"),
               Column("api_cpu_ms", "API CPU ms", ".2f"), Column("api_cpu_ms_per_token", "API CPU ms per token", ".3f")]
    return BenchResult("openai", asdict(settings), rows, columns, key_fields=["case"],
                       metrics=[Metric("added_ms", "lower"), Metric("added_ms_per_token", "lower"), Metric("api_cpu_ms", "lower")],
                       notes=[f"{model}, greedy, method none, {settings.pairs} interleaved pairs per case over "
                              "keep-alive HTTP (requests); streamed cases read every event to the end; per token: "
                              "(added ms - the per-request figure) / tokens; API CPU: the `dspark serve` process's "
                              "CPU per OpenAI request minus per Triton request (mean)"])
