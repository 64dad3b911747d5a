"""Serving pieces of the speculative backend without Triton: config parameters, the bounded
request pool, the streaming detokenizer, the adapter's report of an unload that hangs."""
import contextlib
import threading
import time

import pytest

from dspark.params import parse_parameters
from dspark.triton import unload_watch
from dspark.triton.params import SpeculativeParameters
from dspark.triton.request_pool import RequestPool
from dspark.decoding.text import Detokenizer
from dspark.errors import ConfigError, UnavailableError
from dspark.triton.response_sender import GuardedSender, StreamLedger


@pytest.mark.parametrize("params,field,words", [
    ({"max_concurrent_requests": "0"}, "max_concurrent_requests", "greater than or equal to 1"),
    ({"max_concurrent_requests": "many"}, "max_concurrent_requests", "valid integer"),
    ({"llm_model": ""}, "llm_model", "Field required"),  # an empty parameter is an absent one
    # the retired parameters of the LM-graph pair and of the one-valued runtime choice
    ({"target_model": "spec_target"}, "target_model", "is not a parameter of this backend"),
    ({"llm_runtime": "kernel"}, "llm_runtime", "is not a parameter of this backend"),
    ({"batch_verification": "sometimes"}, "batch_verification", "valid boolean"),
    ({"tree_widht": "2"}, "tree_widht", "did you mean 'tree_width'?"),
])
def test_bad_config_parameters_name_the_parameter(params, field, words):
    with pytest.raises(ConfigError) as info:
        parse_parameters(SpeculativeParameters, {"llm_model": "model", **params}, path="config.pbtxt")
    assert info.value.field == f"parameter '{field}'" and "config.pbtxt" in str(info.value)
    assert words in str(info.value)


def test_config_parameters_are_converted_from_strings():
    config = parse_parameters(SpeculativeParameters, {"llm_model": "model", "max_concurrent_requests": "2",
                                                      "batch_verification": "true", "tree_width": ""})
    assert config.max_concurrent_requests == 2 and config.batch_verification is True
    assert config.tree_width == 4  # an empty parameter keeps the default


def test_the_pool_runs_at_most_its_workers_queues_a_bound_and_rejects_the_rest():
    pool = RequestPool(workers=2, max_queued=1, max_wait_s=10)
    release = threading.Event()
    running, rejected, done = [], [], []

    def job(i):
        running.append(i)
        release.wait(5)
        done.append(i)

    for i in range(5):
        pool.submit(lambda i=i: job(i), rejected.append)
    time.sleep(0.2)
    assert sorted(running) == [0, 1] and pool.load == (2, 1)
    assert len(rejected) == 2 and all(isinstance(e, UnavailableError) and e.reason == "busy" for e in rejected)
    release.set()
    time.sleep(0.2)
    assert sorted(done) == [0, 1, 2]
    assert pool.close(1.0)


def test_a_request_that_waited_too_long_is_rejected_and_close_rejects_the_queue():
    pool = RequestPool(workers=1, max_queued=4, max_wait_s=0.05)
    release = threading.Event()
    rejected, ran = [], []
    pool.submit(lambda: release.wait(5), rejected.append)
    pool.submit(lambda: ran.append(1), rejected.append)
    time.sleep(0.2)
    release.set()
    time.sleep(0.1)
    assert not ran and rejected[0].reason == "queue_timeout"

    release.clear()
    pool.max_wait_s = 10
    pool.submit(lambda: release.wait(0.3), rejected.append)
    pool.submit(lambda: ran.append(2), rejected.append)
    time.sleep(0.05)
    assert pool.close(2.0)  # the running job ends; the waiting one is rejected
    assert not ran and rejected[-1].reason == "shutdown"
    pool.submit(lambda: ran.append(3), rejected.append)
    assert rejected[-1].reason == "shutdown"


class _Bytes:
    """A byte-level tokenizer: each id is one byte."""

    def encode(self, text):
        return list(text.encode())

    def decode_bytes(self, ids):
        return bytes(ids)


def test_streamed_text_never_splits_a_character():
    text = "naïve café → 東京 🚀 done"
    detok = Detokenizer(_Bytes())
    pieces = [detok.add([b]) for b in text.encode()] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_a_text_cut_inside_a_character_ends_before_it():
    detok = Detokenizer(_Bytes())
    data = "ok 東".encode()
    pieces = [detok.add([b]) for b in data[:-1]] + [detok.flush()]  # cut by the token limit
    assert "".join(pieces) == "ok "


def test_the_servers_http_endpoint_is_read_from_its_command_line():
    from dspark.triton.adapter import server_http_url

    assert server_http_url(["tritonserver", "--http-port=8123", "--grpc-port=1"]) == "127.0.0.1:8123"
    assert server_http_url(["tritonserver", "--http-address", "10.0.0.5", "--http-port", "9"]) == "10.0.0.5:9"
    assert server_http_url(["tritonserver"]) == "127.0.0.1:8000"
    assert server_http_url(["tritonserver", "--allow-http=false"]) is None


def _watch(logged: list, url: str, pool: RequestPool, streams: StreamLedger) -> unload_watch.UnloadWatch:
    """The unload watcher of model spec_x version 1, its log lines recorded."""
    return unload_watch.UnloadWatch("spec_x", "1", pool, streams, lambda m: logged.append(("info", m)),
                                    lambda m: logged.append(("warn", m)), base_url=url)


@pytest.mark.parametrize("finalized", [False, True])
def test_an_unload_that_finalize_does_not_follow_is_reported_with_the_thread_stacks(monkeypatch, capfd, finalized):
    logged = []
    monkeypatch.setattr(unload_watch, "UNLOAD_REPORT_S", 0.2)
    model = _watch(logged, "127.0.0.1:1", RequestPool(1, 0, 5.0, name="stuck-worker"), StreamLedger())
    GuardedSender(object(), final_flag=1, ledger=model.streams)  # one request, never answered
    release = threading.Event()
    model.pool.submit(lambda: release.wait(10), lambda error: None)  # a request that does not end
    try:
        deadline = time.monotonic() + 5
        while model.pool.load != (1, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        model.pool.closing.set()  # the unload began
        if finalized:
            model.finalizing.set()
        model.watch()
    finally:
        release.set()
        model.pool.close(2)
    warnings = [m for level, m in logged if level == "warn"]
    stacks = capfd.readouterr().err
    if finalized:
        assert warnings == [] and "_work" not in stacks
    else:
        assert warnings == ["speculative backend: spec_x: not finalized 0.2 s after the unload began "
                            "(1 requests running, 0 waiting; 1 of 1 response streams without a final "
                            "response, 0 sends raised); the stub's thread stacks follow on stderr"]
        assert "_work" in stacks and "test_spec_serving.py" in stacks  # the stuck request's frames


class _FakeHealth:
    """A loopback HTTP server answering Triton's health and model-readiness endpoints."""

    def __init__(self, status: dict):
        import http.server

        self.status = status  # path -> HTTP status
        self.asked: list = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.asked.append(self.path)
                self.send_response(outer.status.get(self.path, 404))
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()


LIVE, SERVER_READY, MODEL_READY = "/v2/health/live", "/v2/health/ready", "/v2/models/spec_x/versions/1/ready"


def _watched_model(monkeypatch, logged, health):
    monkeypatch.setattr(unload_watch, "UNLOAD_REPORT_S", 0.3)
    monkeypatch.setattr(unload_watch, "IDLE_POLL_S", 0.05)
    monkeypatch.setattr(unload_watch, "UNLOAD_POLL_S", 0.02)
    return _watch(logged, health.url, RequestPool(1, 0, 5.0, name="watched-worker"), StreamLedger())


def _asked(health, path: str, times: int) -> bool:
    """Wait up to 5 s until ``path`` was asked ``times`` times."""
    deadline = time.monotonic() + 5
    while health.asked.count(path) < times and time.monotonic() < deadline:
        time.sleep(0.01)
    return health.asked.count(path) >= times


@contextlib.contextmanager
def _watching(model, health, finalize: bool = True):
    """The model's unload watcher runs inside; finalize (unless not) and clean up after."""
    watcher = threading.Thread(target=model.watch, daemon=True)
    watcher.start()
    try:
        yield watcher
    finally:
        if finalize:
            model.finalizing.set()
        model.pool.close(2)  # the watcher stops asking once the pool closes
        watcher.join(5)
        health.close()


def test_another_models_load_does_not_stop_running_requests(monkeypatch):
    """With strict readiness (Triton's default) the server is 'not ready' while any model loads;
    the model itself stays ready and its requests go on."""
    logged = []
    health = _FakeHealth({LIVE: 200, SERVER_READY: 503, MODEL_READY: 200})
    model = _watched_model(monkeypatch, logged, health)
    release = threading.Event()
    model.pool.submit(lambda: release.wait(10), lambda error: None)
    with _watching(model, health):
        try:
            assert _asked(health, MODEL_READY, 5) and not model.pool.closing.is_set()
        finally:
            release.set()
    assert not [m for level, m in logged if level == "warn"]


def test_an_idle_models_unload_that_never_reaches_finalize_names_the_grpc_cause(monkeypatch):
    """Idle, every stream answered, the model no longer ready, no finalize: Triton holds it."""
    logged = []
    health = _FakeHealth({LIVE: 200, MODEL_READY: 200})
    model = _watched_model(monkeypatch, logged, health)
    GuardedSender(type("Sender", (), {"send": lambda self, response, flags: None})(), final_flag=1,
                  ledger=model.streams).send(final=True)  # one request, answered
    with _watching(model, health, finalize=False) as watcher:
        assert _asked(health, MODEL_READY, 1)
        health.status[MODEL_READY] = 400  # the unload began
        watcher.join(5)
        assert model.pool.closing.is_set() and not watcher.is_alive()
    warnings = [m for level, m in logged if level == "warn"]
    assert len(warnings) == 1 and "not finalized 0.3 s after the unload began (0 requests running" in warnings[0]
    assert "0 of 1 response streams without a final response" in warnings[0]
    assert "Triton itself holds the model" in warnings[0] and "gRPC" in warnings[0]


@pytest.mark.parametrize("model_ready, stops", [(400, True), (403, False)])
def test_a_stop_before_any_check_saw_the_model_ready_still_stops_its_running_requests(monkeypatch, model_ready,
                                                                                      stops):
    """The server stopped right after the model loaded: the first check already finds it not
    ready, but a request is running, so it was. An endpoint restricted by the server's API
    restrictions (403) says nothing, and the requests go on."""
    health = _FakeHealth({LIVE: 200, MODEL_READY: model_ready})
    model = _watched_model(monkeypatch, [], health)
    release = threading.Event()
    model.pool.submit(lambda: release.wait(10), lambda error: None)
    with _watching(model, health):
        try:
            assert _asked(health, MODEL_READY, 1 if stops else 3)
            assert model.pool.closing.wait(1.0) == stops
        finally:
            release.set()


def test_a_server_gone_before_any_check_saw_the_model_ready_still_stops_its_running_requests(monkeypatch):
    """Stopped right after the model loaded: the server already refuses connections at the first
    check, but a request is running, so it was up."""
    health = _FakeHealth({})
    health.close()
    health.server.server_close()  # nothing listens there any more: connections are refused
    model = _watched_model(monkeypatch, [], health)
    release = threading.Event()
    model.pool.submit(lambda: release.wait(10), lambda error: None)
    watcher = threading.Thread(target=model.watch, daemon=True)
    watcher.start()
    try:
        assert model.pool.closing.wait(2.0), "two refusals while busy: the server is gone"
    finally:
        release.set()
        model.finalizing.set()
        model.pool.close(2)
        watcher.join(5)


def test_an_idle_model_still_loading_is_not_taken_for_unloading(monkeypatch):
    """Triton marks the model ready only after initialize returns, when its watcher already runs."""
    health = _FakeHealth({LIVE: 200, MODEL_READY: 400})
    model = _watched_model(monkeypatch, [], health)
    with _watching(model, health):
        assert _asked(health, MODEL_READY, 3) and not model.pool.closing.is_set()
