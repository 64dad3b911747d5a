"""The speculative backend's serving behaviour on the real server, on the fast 5 M-parameter
test fixture `spec_toy` (tests/spec_toy_repository): every method against plain decoding, bad
inputs, cancellation, the bounded request pool, and unload / reload / stop with requests in
flight. The real model's own tests are in test_spec_backend.py."""
from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from dspark.bench.spec_served import reload_model
from dspark.paths import project_root
from dspark.server.launcher import TritonServer
from tests.conftest import TEST_EXIT_TIMEOUT_S, dump_log_on_failure
from tests.integration.spec_client import (Stream, completion, generate, metric, metric_lines,
                                           model_state, shm_regions, stream_once, stub_processes,
                                           wait_for)

MODEL = "spec_toy"
ONE = "spec_toy_one"  # the same with max_concurrent_requests 1, max_queued_requests 0
REPOSITORY = project_root() / "tests" / "spec_toy_repository"
PROMPT = "def read_config(path):\n    \"\"\"Read the configuration file"
LONG = {"max_tokens": 900, "speculative": {"method": "none"}}  # several seconds on the toy pair


def toy_server(request, models=(MODEL,), exit_timeout_s: int = 30) -> TritonServer:
    # the log in pytest's temp folder: the server removes its own folder when it stops
    log = request.getfixturevalue("tmp_path_factory").mktemp("spec-serving") / "tritonserver.log"
    server = TritonServer(repositories=[REPOSITORY], model_control="explicit", load_models=models,
                          exit_timeout_s=exit_timeout_s, log_path=log)
    server.failed_before = request.session.testsfailed
    server.start()
    return server


@pytest.fixture(scope="module")
def server(request):
    # Triton 2.51 keeps a model whose reload failed (a test below) "live" until its exit timeout
    # at stop, whatever the backend (the onnx backend's too); that wait says nothing about ours
    server = toy_server(request, (MODEL, ONE), exit_timeout_s=TEST_EXIT_TIMEOUT_S)
    yield server
    dump_log_on_failure(request, server, server.failed_before)
    server.stop()


def test_greedy_text_is_identical_for_every_method(server):
    plain = completion(server, MODEL, PROMPT, max_tokens=40, speculative={"method": "none"})
    assert len(plain) > 20
    for method in ("draft", "ngram", "suffix", "hybrid", "tree"):
        accepted = metric(server, MODEL, "dspark_speculative_accepted_total")
        assert completion(server, MODEL, PROMPT, max_tokens=40, speculative={"method": method}) == plain, method
        if method in ("draft", "tree"):  # the GGUF draft model guessed some of it
            assert metric(server, MODEL, "dspark_speculative_accepted_total") > accepted, method


BAD_PARAMETERS = [
    ("{not json", "sampling_parameters"),
    (json.dumps({"temperature": -1}), "temperature"),
    ('{"temperature": NaN}', "sampling_parameters"),
    (json.dumps({"temperature": 5e-324}), "temperature"),  # subnormal
    (json.dumps({"top_p": 0}), "top_p"),
    (json.dumps({"top_p": 1.5}), "top_p"),
    (json.dumps({"max_tokens": 0}), "max_tokens"),
    (json.dumps({"speculative": {"method": "beam"}}), "speculative.method"),
    (json.dumps({"speculative": {"tree_width": 99}}), "speculative.tree_width"),
    (json.dumps({"temperatur": 0.5}), "temperatur"),
]


@pytest.mark.parametrize("sampling,field", BAD_PARAMETERS)
def test_bad_parameters_get_invalid_arg_naming_the_field(server, sampling, field):
    body = {"text_input": PROMPT, "sampling_parameters": sampling}
    reply = requests.post(f"http://{server.http_url}/v2/models/{MODEL}/generate", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"].startswith(field + ":")


def test_temperature_zero_is_greedy(server):
    assert completion(server, MODEL, PROMPT, max_tokens=12, temperature=0) == \
        completion(server, MODEL, PROMPT, max_tokens=12)


@pytest.mark.parametrize("prompt,expected", [
    ("", "text_input: is empty"),
    ("x = 1\n" * 2000, "text_input: prompt is"),  # over the 1024-token context
    ("x" * 2_000_000, "text_input: prompt is 2000000 bytes"),  # refused by its size alone
])
def test_bad_prompts_get_invalid_arg(server, prompt, expected):
    passes = metric(server, MODEL, "dspark_speculative_target_passes_total")
    started = time.perf_counter()
    reply = generate(server, MODEL, prompt, max_tokens=4)
    assert reply.status_code == 400 and reply.json()["error"].startswith(expected), reply.text
    assert time.perf_counter() - started < 5
    assert metric(server, MODEL, "dspark_speculative_target_passes_total") == passes  # no model work


def test_grpc_stream_errors_end_the_request_and_the_stream_serves_on(server):
    stream = Stream(server)
    try:
        bad = stream.request(MODEL, b"def f():\n\xff\xfe", {"max_tokens": 8})
        assert bad.error and "text_input: is not valid UTF-8 (byte 0xff at offset 9)" in bad.error
        bad = stream.request(MODEL, PROMPT, {"max_tokens": 8, "top_p": -0.5})
        assert bad.error and "top_p:" in bad.error
        good = stream.request(MODEL, PROMPT, {"max_tokens": 8})
        assert good.final and good.error is None and good.text
    finally:
        stream.close()


@pytest.mark.parametrize("method", ["hybrid", "tree"])
def test_grpc_streaming_matches_http(server, method):
    streamed = stream_once(server, MODEL, PROMPT, {"max_tokens": 40, "speculative": {"method": method}})
    assert streamed.final and len(streamed.pieces) > 1
    assert streamed.text == completion(server, MODEL, PROMPT, max_tokens=40, speculative={"method": "none"})


def test_cancelled_stream_stops_generating_at_once(server):
    """The generated-token counter moves with each streamed response, so the tokens made after
    the cancel are those counted between the cancel and the request's end: at most what the
    model makes in 0.1 s (the cancel is asked every 20 ms), measured here, and at least 30."""
    started = time.perf_counter()
    completion(server, MODEL, PROMPT, max_tokens=200, speculative={"method": "none"})  # never ends early
    bound = max(30, 0.1 * 200 / (time.perf_counter() - started))
    before = metric(server, MODEL, "dspark_speculative_generated_total")
    cancelled = stream_once(server, MODEL, PROMPT, LONG, cancel_after=2)
    at_cancel = metric(server, MODEL, "dspark_speculative_generated_total")
    assert len(cancelled.pieces) == 2
    wait_for(lambda: metric(server, MODEL, "dspark_speculative_requests_running") == 0, 2.0)
    after = metric(server, MODEL, "dspark_speculative_generated_total")
    assert after - at_cancel < bound, f"{after - at_cancel} tokens generated after the cancel (bound {bound:.0f})"
    assert after - before < LONG["max_tokens"] / 2
    assert completion(server, MODEL, PROMPT, max_tokens=8)


def test_concurrent_requests_each_get_their_own_text(server):
    prompts = [PROMPT, "class Stack:\n    def push(self, item):", "The import statement",
               "for key, value in sorted(mapping.items()):"]
    expected = [completion(server, MODEL, p, max_tokens=24) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: completion(server, MODEL, p, max_tokens=24), prompts * 2))
    assert got == expected * 2


def test_statistics_reach_metrics(server):
    passes = metric(server, MODEL, "dspark_speculative_target_passes_total")
    accepted = metric(server, MODEL, "dspark_speculative_accepted_total")
    text = completion(server, MODEL, PROMPT, max_tokens=32, speculative={"method": "draft"})
    assert text
    assert metric(server, MODEL, "dspark_speculative_target_passes_total") - passes < 32
    assert metric(server, MODEL, "dspark_speculative_accepted_total") > accepted
    assert metric(server, MODEL, "dspark_speculative_mean_accepted_length") > 1.0


def repository(server, action: str, model: str) -> None:
    reply = requests.post(f"http://{server.http_url}/v2/repository/models/{model}/{action}", json={},
                          headers=server.repository_headers, timeout=120)
    assert reply.status_code == 200, reply.text


def load(server, model: str = MODEL):
    repository(server, "load", model)


def unload(server, model: str = MODEL):
    repository(server, "unload", model)


def test_beyond_the_pool_and_its_queue_a_request_gets_unavailable(server):
    """spec_toy_one: one worker, no queue."""
    stop_first = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(stream_once, server, ONE, PROMPT, LONG, cancel=stop_first)
        wait_for(lambda: metric(server, ONE, "dspark_speculative_requests_running") == 1, 10)
        second = stream_once(server, ONE, PROMPT, {"max_tokens": 8})
        stop_first.set()
        assert second.error and "busy: 1 requests running and 0 waiting" in second.error
        assert first.result().pieces
    wait_for(lambda: metric(server, ONE, "dspark_speculative_requests_running") == 0, 5)
    assert stream_once(server, ONE, PROMPT, {"max_tokens": 8}).final


def test_unload_and_reload_with_requests_in_flight(server):
    wait_for(lambda: len(stub_processes(server, MODEL)) == 1, 5)  # a reload's old stub has exited
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream_once, server, MODEL, PROMPT, LONG) for _ in range(3)]
        plain = pool.submit(generate, server, MODEL, PROMPT, **LONG)
        wait_for(lambda: metric(server, MODEL, "dspark_speculative_requests_running") == 4, 10)
        unload(server)
        wait_for(lambda: model_state(server, MODEL) == "UNAVAILABLE", 10)  # stops its requests, no hang
        results = [s.result(timeout=30) for s in streams]
        reply = plain.result(timeout=30)
    for result in results:  # every request answered: text, then an error that says why
        assert result.pieces and result.error and "spec_toy is unloading" in result.error
    assert reply.status_code != 200 and "spec_toy is unloading" in reply.text
    wait_for(lambda: not stub_processes(server, MODEL), 5)
    assert not [line for line in metric_lines(server, MODEL) if line.startswith("dspark_")]  # none left
    load(server)
    assert completion(server, MODEL, PROMPT, max_tokens=8)
    families = requests.get(server.metrics_url, timeout=10).text.count("# TYPE dspark_speculative_generated_total")
    assert families == 1
    wait_for(lambda: len(stub_processes(server, MODEL)) == 1, 5)


def test_another_models_unload_and_load_do_not_stop_running_requests(server):
    """With Triton's default strict readiness the server reads 'not ready' while any model loads;
    a model that took that for its own unload stopped its requests."""
    wait_for(lambda: len(stub_processes(server, ONE)) == 1, 5)
    unload(server, ONE)
    wait_for(lambda: not stub_processes(server, ONE), 10)
    loaded = threading.Event()

    def generate_until_loaded() -> list:  # back to back: one request or another runs all along
        results = []
        while not loaded.is_set():
            results.append(stream_once(server, MODEL, PROMPT, LONG))
        return results

    with ThreadPoolExecutor(1) as pool:
        generating = pool.submit(generate_until_loaded)
        wait_for(lambda: metric(server, MODEL, "dspark_speculative_requests_running") == 1, 10)
        load(server, ONE)
        loaded.set()
        results = generating.result(timeout=60)
    assert results and all(r.final and not r.error and len(r.pieces) > 10 for r in results), \
        [r.error for r in results]


def test_the_benchmarks_reload_starts_a_fresh_stub_where_a_load_alone_does_not(server):
    """`bench spec` measures each served pass on a fresh stub: one that kept SuffixDecoding's
    outputs of the previous pass would predict every prompt from its own earlier answer."""
    wait_for(lambda: len(stub_processes(server, MODEL)) == 1, 5)
    [(old, _)] = stub_processes(server, MODEL)
    load(server)  # Triton 2.51 keeps an unchanged, loaded model and its stub
    assert [pid for pid, _ in stub_processes(server, MODEL)] == [old]
    reload_model(server, 15, MODEL)
    [(new, _)] = stub_processes(server, MODEL)
    assert new != old
    assert completion(server, MODEL, PROMPT, max_tokens=8)


def test_a_hung_stop_can_be_diagnosed_from_the_servers_native_stacks(server, tmp_path):
    stacks = tmp_path / "stacks.txt"
    assert server.write_native_stacks(stacks)
    text = stacks.read_text()
    assert text.count("\nThread ") > 10 and "libtriton_python.so" in text  # the Python backend's threads


def test_a_config_that_cannot_serve_its_default_method_fails_the_load(server):
    url = f"http://{server.http_url}/v2/repository/models/{ONE}/load"
    original = requests.get(f"http://{server.http_url}/v2/models/{ONE}/config", timeout=10).json()
    config = json.loads(json.dumps(original))
    config["parameters"].update({"draft_llm": {"string_value": ""}, "default_method": {"string_value": "draft"}})
    reply = requests.post(url, json={"parameters": {"config": json.dumps(config)}}, headers=server.repository_headers, timeout=120)
    assert reply.status_code == 400
    assert "parameter 'default_method': 'draft' is not one of this model's methods" in reply.text
    reply = requests.post(url, json={"parameters": {"config": json.dumps(original)}}, headers=server.repository_headers, timeout=120)
    assert reply.status_code == 200 and stream_once(server, ONE, PROMPT, {"max_tokens": 4}).final


def test_server_stop_with_requests_in_flight_unloads_at_once(request):
    server = toy_server(request)
    try:
        regions = shm_regions(stub_processes(server, MODEL))
        assert regions
        with ThreadPoolExecutor(3) as pool:
            streams = [pool.submit(stream_once, server, MODEL, PROMPT, LONG) for _ in range(3)]
            wait_for(lambda: metric(server, MODEL, "dspark_speculative_requests_running") == 3, 10)
            started = time.perf_counter()
            server.stop()
            stopped = time.perf_counter() - started
            results = [s.result(timeout=30) for s in streams]
    finally:
        dump_log_on_failure(request, server, server.failed_before)
        server.stop()
    log = server.log_text()
    assert stopped < 6.0, f"the server took {stopped:.1f} s to stop:\n" + "\n".join(
        line for line in log.splitlines() if "model.py" in line or "Timeout" in line)
    assert "speculative backend: finalized" in log and "Exit timeout expired" not in log
    for result in results:  # each ended (the server may close a stream before its last reply)
        assert result.error or result.final
    assert server.left_shm_regions == [], "the server left its shared memory behind (stop removed it)"
    assert not [r for r in regions if os.path.exists(f"/dev/shm/{r}")]
