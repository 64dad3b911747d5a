"""Client helpers for the speculative backend's integration tests: /generate, gRPC streams,
/metrics, the stub processes of a model."""
from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import requests
import tritonclient.grpc as grpcclient

from dspark.bench.resources import stub_processes as server_stubs


def generate(server, model: str, prompt="def f(x):\n", timeout: float = 120, **sampling):
    body = {"text_input": prompt, "sampling_parameters": json.dumps(sampling)}
    return requests.post(f"http://{server.http_url}/v2/models/{model}/generate", json=body,
                         timeout=timeout)


def completion(server, model: str, prompt="def f(x):\n", **sampling) -> str:
    """The generated text (the reply holds prompt + completion, as Triton's LLM backends do)."""
    reply = generate(server, model, prompt, **sampling)
    assert reply.status_code == 200, reply.text
    text = reply.json()["text_output"]
    assert text.startswith(prompt)
    return text[len(prompt):]


@dataclass
class StreamResult:
    pieces: list[str] = field(default_factory=list)
    error: Optional[str] = None
    final: bool = False
    seconds: float = 0.0

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def grpc_inputs(prompt, sampling: dict, stream: bool = True, messages=None):
    """Inputs of a generate request; ``prompt`` may be bytes (sent as they are)."""
    inputs = []
    values = [("sampling_parameters", json.dumps(sampling).encode(), "BYTES"), ("stream", stream, "BOOL")]
    if prompt is not None:
        values.append(("text_input", prompt if isinstance(prompt, bytes) else prompt.encode(), "BYTES"))
    if messages is not None:
        values.append(("messages", json.dumps(messages).encode(), "BYTES"))
    for name, value, dtype in values:
        tensor = grpcclient.InferInput(name, [1], dtype)
        tensor.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else np.bool_))
        inputs.append(tensor)
    return inputs


class Stream:
    """One gRPC bidirectional stream; requests on it are answered in turn."""

    def __init__(self, server):
        self.results: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))

    def request(self, model: str, prompt, sampling: dict, cancel_after: Optional[int] = None,
                messages=None, timeout: float = 120, cancel: Optional[threading.Event] = None,
                ) -> StreamResult:
        """Send one request and read its responses up to the final one (or the first error);
        ``cancel_after``: cancel the stream after that many text responses; ``cancel``: when
        that event is set."""
        out = StreamResult()
        started = time.perf_counter()
        self.client.async_stream_infer(model, grpc_inputs(prompt, sampling, messages=messages),
                                       enable_empty_final_response=True)
        deadline = started + timeout
        while True:
            try:
                result, error = self.results.get(timeout=0.05)
            except queue.Empty:
                if time.perf_counter() > deadline:
                    raise
                if cancel is not None and cancel.is_set():
                    self.client.stop_stream(cancel_requests=True)
                    break
                continue
            if error is not None:
                out.error = str(error)
                break
            response = result.get_response()
            if response.outputs:
                out.pieces.append(result.as_numpy("text_output")[0].decode())
                if cancel_after is not None and len(out.pieces) >= cancel_after:
                    self.client.stop_stream(cancel_requests=True)
                    break
            if response.parameters["triton_final_response"].bool_param:
                out.final = True
                break
        out.seconds = time.perf_counter() - started
        return out

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def stream_once(server, model: str, prompt, sampling: dict, **options) -> StreamResult:
    stream = Stream(server)
    try:
        return stream.request(model, prompt, sampling, **options)
    finally:
        stream.close()


def metric_lines(server, model: str) -> list[str]:
    text = requests.get(server.metrics_url, timeout=10).text
    return [line for line in text.splitlines() if f'model="{model}"' in line]


def metric(server, model: str, name: str) -> float:
    for line in metric_lines(server, model):
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} of {model} not in /metrics")


def wait_for(condition, timeout_s: float, interval_s: float = 0.05) -> float:
    """Seconds until ``condition()`` held; AssertionError after ``timeout_s``."""
    started = time.perf_counter()
    while not condition():
        if time.perf_counter() - started > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        time.sleep(interval_s)
    return time.perf_counter() - started


def model_state(server, model: str) -> str:
    index = requests.post(f"http://{server.http_url}/v2/repository/index", json={},
                          headers=server.repository_headers, timeout=10).json()
    states = [m.get("state", "") for m in index if m["name"] == model]
    return states[0] if states else ""


def stub_processes(server, model: str) -> list[tuple[int, list[str]]]:
    """(pid, argv) of ``server``'s Python backend stubs serving ``model``."""
    return server_stubs(server._process.pid, model)


def shm_regions(stubs: list[tuple[int, list[str]]]) -> set[str]:
    """The shared-memory regions the stubs were started with (argv[2], without its slash)."""
    return {argv[2].lstrip("/") for _, argv in stubs if len(argv) > 2}
