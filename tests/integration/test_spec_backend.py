"""The speculative backend on the real server: /generate, /generate_stream (SSE), gRPC
streaming, cancellation, concurrency, bad parameters and metrics."""
import json
import queue
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

MODEL = "spec_lm"
PROMPT = "def read_config(path):\n    \"\"\"Read the configuration file"


def generate(server, prompt=PROMPT, **sampling):
    body = {"text_input": prompt, "sampling_parameters": json.dumps(sampling)}
    return requests.post(f"http://{server.http_url}/v2/models/{MODEL}/generate", json=body, timeout=120)


def generated_text(server, prompt=PROMPT, **sampling) -> str:
    reply = generate(server, prompt, **sampling)
    assert reply.status_code == 200, reply.text
    text = reply.json()["text_output"]
    assert text.startswith(prompt)  # the whole text, as Triton's LLM backends send it
    return text[len(prompt):]


def stream_sse(server, prompt=PROMPT, **sampling) -> list[str]:
    body = {"text_input": prompt, "stream": True, "sampling_parameters": json.dumps(sampling)}
    reply = requests.post(f"http://{server.http_url}/v2/models/{MODEL}/generate_stream", json=body,
                          stream=True, timeout=120)
    assert reply.status_code == 200
    events = []
    for line in reply.iter_lines():
        if line.startswith(b"data: "):
            data = json.loads(line[6:])
            assert "error" not in data, data
            events.append(data["text_output"])
    return events


def metric(server, name: str) -> float:
    text = requests.get(server.metrics_url, timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") and f'model="{MODEL}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def server(triton_server):
    return triton_server


def test_greedy_generate_is_identical_for_every_method(server):
    plain = generated_text(server, max_tokens=40, speculative={"method": "none"})
    assert len(plain) > 20
    for method in ("draft", "ngram", "hybrid", "tree"):
        assert generated_text(server, max_tokens=40, speculative={"method": method}) == plain, method


def test_generate_stream_sends_deltas_that_add_up_to_the_text(server):
    whole = generated_text(server, max_tokens=48)
    events = stream_sse(server, max_tokens=48)
    assert len(events) > 1
    assert "".join(events) == whole


def test_stop_string_ends_the_text_before_it(server):
    whole = generated_text(server, max_tokens=48)
    stop = whole[10:14]
    text = generated_text(server, max_tokens=48, stop=[stop])
    assert text == whole[:whole.index(stop)]


def grpc_stream(server, sampling: dict, prompt=PROMPT, cancel_after: int | None = None):
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    inputs = []
    for name, value, dtype in (("text_input", prompt.encode(), np.object_),
                               ("sampling_parameters", json.dumps(sampling).encode(), np.object_),
                               ("stream", True, np.bool_)):
        tensor = grpcclient.InferInput(name, [1], "BYTES" if dtype is np.object_ else "BOOL")
        tensor.set_data_from_numpy(np.array([value], dtype=dtype))
        inputs.append(tensor)
    client.async_stream_infer(MODEL, inputs, enable_empty_final_response=True)
    pieces = []
    while True:
        result, error = results.get(timeout=120)
        assert error is None, error
        response = result.get_response()
        if response.outputs:
            pieces.append(result.as_numpy("text_output")[0].decode())
            if cancel_after is not None and len(pieces) >= cancel_after:
                client.stop_stream(cancel_requests=True)
                client.close()
                return pieces
        if response.parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    return pieces


def test_grpc_streaming_matches_http(server):
    assert "".join(grpc_stream(server, {"max_tokens": 40})) == generated_text(server, max_tokens=40)


def test_cancelled_stream_stops_generating_and_the_model_keeps_serving(server):
    before = metric(server, "dspark_speculative_generated_total")
    pieces = grpc_stream(server, {"max_tokens": 900, "speculative": {"method": "none"}},
                         cancel_after=2)
    assert len(pieces) == 2
    time.sleep(1.0)  # the worker notices the cancellation at its next pass
    generated = metric(server, "dspark_speculative_generated_total") - before
    assert generated < 400, f"cancelled request generated {generated} tokens"
    assert generated_text(server, max_tokens=8)


def test_concurrent_requests_each_get_their_own_text(server):
    prompts = [PROMPT, "class Stack:\n    def push(self, item):", "The import statement",
               "for key, value in sorted(mapping.items()):"]
    expected = [generated_text(server, p, max_tokens=24) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: generated_text(server, p, max_tokens=24), prompts * 2))
    assert got == expected * 2


@pytest.mark.parametrize("sampling,field", [
    ("{not json", "sampling_parameters"),
    (json.dumps({"temperature": -1}), "temperature"),
    (json.dumps({"max_tokens": 0}), "max_tokens"),
    (json.dumps({"top_p": 1.5}), "top_p"),
    (json.dumps({"speculative": {"method": "beam"}}), "speculative.method"),
    (json.dumps({"speculative": {"tree_width": 99}}), "speculative.tree_width"),
    (json.dumps({"temperatur": 0.5}), "temperatur"),
])
def test_bad_parameters_get_an_error_naming_the_field(server, sampling, field):
    body = {"text_input": PROMPT, "sampling_parameters": sampling}
    reply = requests.post(f"http://{server.http_url}/v2/models/{MODEL}/generate", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert field in reply.json()["error"]
    assert generated_text(server, max_tokens=4)  # still serving


def test_prompt_longer_than_the_context_is_an_invalid_argument(server):
    reply = generate(server, "x = 1\n" * 2000, max_tokens=4)
    assert reply.status_code == 400 and "context" in reply.json()["error"]


def test_statistics_reach_metrics(server):
    generated_text(server, max_tokens=32, speculative={"method": "draft"})
    assert metric(server, "dspark_speculative_proposed_total") > 0
    assert metric(server, "dspark_speculative_accepted_total") >= 0
    assert metric(server, "dspark_speculative_target_passes_total") > 0
    assert metric(server, "dspark_speculative_mean_accepted_length") >= 1.0
