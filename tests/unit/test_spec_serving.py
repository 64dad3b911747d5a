"""Serving pieces of the speculative backend without Triton: config parameters, the bounded
request pool, the streaming detokenizer."""
import threading
import time

import pytest

from dspark.decoding.serving import RequestPool, ServingConfig
from dspark.decoding.text import Detokenizer
from dspark.errors import ConfigError, UnavailableError


@pytest.mark.parametrize("params,field", [
    ({"max_concurrent_requests": "0"}, "parameters.max_concurrent_requests"),
    ({"max_concurrent_requests": "many"}, "parameters.max_concurrent_requests"),
    ({"draft_runtime": "gpu"}, "parameters.draft_runtime"),
    ({"batch_verification": "sometimes"}, "parameters.batch_verification"),
    ({"tree_widht": "2"}, "parameters.tree_widht"),
])
def test_bad_config_parameters_name_the_parameter(params, field):
    with pytest.raises(ConfigError) as info:
        ServingConfig.from_parameters(params, "config.pbtxt")
    assert info.value.field == field and "config.pbtxt" in str(info.value)


def test_config_parameters_are_converted_from_strings():
    config = ServingConfig.from_parameters({"max_concurrent_requests": "2", "batch_verification": "true",
                                            "tree_width": ""})
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

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


class _ExactBytes(_Bytes):
    def decode_bytes(self, ids):
        return bytes(ids)


@pytest.mark.parametrize("tokenizer", [_Bytes(), _ExactBytes()])
def test_streamed_text_never_splits_a_character(tokenizer):
    text = "naïve café → 東京 🚀 done"
    detok = Detokenizer(tokenizer)
    pieces = [detok.add([b]) for b in text.encode()] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_the_servers_http_endpoint_is_read_from_its_command_line():
    from dspark.triton.adapter import server_http_url

    assert server_http_url(["tritonserver", "--http-port=8123", "--grpc-port=1"]) == "127.0.0.1:8123"
    assert server_http_url(["tritonserver", "--http-address", "10.0.0.5", "--http-port", "9"]) == "10.0.0.5:9"
    assert server_http_url(["tritonserver"]) == "127.0.0.1:8000"
    assert server_http_url(["tritonserver", "--allow-http=false"]) is None
