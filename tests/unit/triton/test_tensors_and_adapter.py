"""Request checks and config parameters shared by the backends' model.py adapters."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dspark.runtimes.onnx_session import GraphInput, batch_groups
from dspark.errors import ConfigError
from dspark.params import parse_parameters
from dspark.runtimes.accel.providers import ProviderParameters
from dspark.runtimes.accel.tensorrt_engine import TensorRTParameters
from dspark.triton.params import FusedTransformerParameters, OnnxParameters
from dspark.tensors import RequestError, TensorSpec, check_inputs

FEATURES = TensorSpec("features", "TYPE_FP32", (16,))


@pytest.mark.parametrize("shape, batched", [((1, 16), True), ((3, 16), True), ((16,), False)])
def test_a_good_request_passes_at_any_batch_size(shape, batched):
    """The check returns (None) instead of raising for the declared type and shape, with any
    batch size in front of it when the model batches."""
    assert check_inputs([FEATURES], {"features": np.zeros(shape, np.float32)}, batched=batched) is None


@pytest.mark.parametrize("arrays, words", [
    ({"features": np.zeros((3, 16), np.int64)}, ["'features'", "INT64", "expected FP32"]),
    ({"features": np.zeros((3, 15), np.float32)}, ["'features'", "[3, 15]", "[-1, 16]"]),
    ({"features": np.zeros((16,), np.float32)}, ["'features'", "[16]"]),
    ({}, ["input tensor 'features': missing", "FP32"]),
    ({"features": np.zeros((1, 16), np.float32), "extra": np.zeros(1)}, ["input tensor 'extra': unknown"]),
])
def test_bad_requests_name_the_tensor_and_what_was_expected(arrays, words):
    with pytest.raises(RequestError) as raised:
        check_inputs([FEATURES], arrays, batched=True)
    for word in words:
        assert word in str(raised.value)


def test_a_parameter_no_schema_knows_is_refused_with_the_name_it_was_likely_meant_as():
    with pytest.raises(ConfigError) as raised:
        parse_parameters(FusedTransformerParameters, _config(threads="2", numa_nod="0"), path="m/config.pbtxt")
    assert str(raised.value) == ("m/config.pbtxt: parameter 'numa_nod': is not a parameter of this backend; "
                                 "did you mean 'numa_node'?")
    with pytest.raises(ConfigError, match="parameter 'engine'"):  # TensorRT's, not the session's
        parse_parameters(OnnxParameters, _config(engine="tensorrt"), ProviderParameters)
    assert parse_parameters(OnnxParameters, _config(engine="tensorrt"), ProviderParameters,
                            TensorRTParameters) == OnnxParameters()


def test_requests_batch_only_with_matching_shapes():
    feeds = [{"x": np.zeros((1, 4), np.float32)}, {"x": np.zeros((2, 4), np.float32)},
             {"x": np.zeros((1, 5), np.float32)}, {"x": np.zeros((1, 4), np.float64)}]
    assert sorted(batch_groups(feeds)) == [[0, 1], [2], [3]]


def _config(**parameters) -> dict:
    return {"parameters": {key: {"string_value": value} for key, value in parameters.items()}}


def test_backend_parameters_parse_with_defaults_and_types():
    onnx = parse_parameters(OnnxParameters, _config(execution_providers="CUDAExecutionProvider, CPUExecutionProvider",
                                                    intra_op_threads="2", allow_spinning="on",
                                                    graph_optimization_level="", EXECUTION_ENV_PATH="x"),
                            ProviderParameters)
    assert onnx == OnnxParameters(intra_op_threads=2, inter_op_threads=1, allow_spinning=True,
                                  graph_optimization_level="all")
    fused = parse_parameters(FusedTransformerParameters, _config(numa_node="0", use_pool="false"))
    assert (fused.numa_node, fused.use_pool, fused.threads, fused.pool_bytes) == (0, False, 1, 64 << 20)
    assert parse_parameters(FusedTransformerParameters, {}).numa_node is None


@pytest.mark.parametrize("schema, parameters, words", [
    (OnnxParameters, {"graph_optimization_level": "fast"},
     ["parameter 'graph_optimization_level'", "'disable', 'basic', 'extended' or 'all'", "(got 'fast')"]),
    (OnnxParameters, {"intra_op_threads": "-1"}, ["parameter 'intra_op_threads'", "greater than or equal to 0"]),
    (OnnxParameters, {"allow_spinning": "maybe"}, ["parameter 'allow_spinning'", "valid boolean"]),
    (FusedTransformerParameters, {"numa_node": "x"}, ["parameter 'numa_node'", "valid integer", "(got 'x')"]),
    (FusedTransformerParameters, {"threads": "2.7"}, ["parameter 'threads'", "valid integer", "(got '2.7')"]),
    (FusedTransformerParameters, {"threads": "0"}, ["parameter 'threads'", "greater than or equal to 1"]),
])
def test_a_bad_backend_parameter_is_a_config_error_naming_it(schema, parameters, words):
    with pytest.raises(ConfigError) as raised:
        parse_parameters(schema, _config(**parameters))
    for word in words:
        assert word in str(raised.value)


def test_graph_check_names_a_fixed_dim_and_a_named_dim_two_inputs_disagree_on():
    runner_inputs = [GraphInput("ids", (1, "T")), GraphInput("mask", (1, "T", "S")), GraphInput("x", ("batch", 16))]
    sizes: dict = {}
    runner_inputs[0].check(np.zeros((1, 3), np.int64), sizes)
    with pytest.raises(RequestError, match=r"input tensors 'ids' and 'mask': disagree on dimension 'T' .* "
                                           r"ids has 3, mask has 4"):
        runner_inputs[1].check(np.zeros((1, 4, 5), bool), sizes)
    with pytest.raises(RequestError, match=r"input tensor 'x': has shape \[2, 7\], the ONNX graph expects \[batch, 16\]"):
        runner_inputs[2].check(np.zeros((2, 7), np.float32), {})


class FreedFactorySender:
    """A Triton response sender whose factory is gone once the final response is sent: asking
    it anything then (or while the final send happens) is what crashed tritonserver."""

    def __init__(self):
        self.final_sent = False
        self.violations = 0
        self.sent = []

    def is_cancelled(self):
        time.sleep(0.0005)  # the IPC round trip: the server reads the factory when it arrives
        if self.final_sent:
            self.violations += 1
        return False

    def send(self, response=None, flags=0):
        self.final_sent = self.final_sent or flags == 1  # the factory is freed as the final send lands
        time.sleep(0.0005)
        self.sent.append((response, flags))


def test_guarded_sender_never_asks_a_closed_stream_whether_it_was_cancelled():
    from dspark.triton.response_sender import GuardedSender

    raw = FreedFactorySender()
    sender = GuardedSender(raw, final_flag=1)
    stop = threading.Event()

    def poll():  # the round batcher, checking cancellation every round
        while not stop.is_set():
            sender.is_cancelled()

    pollers = [threading.Thread(target=poll) for _ in range(3)]
    for thread in pollers:
        thread.start()
    time.sleep(0.01)
    assert sender.send("piece")
    assert sender.send(None, final=True)
    time.sleep(0.01)
    stop.set()
    for thread in pollers:
        thread.join()
    assert raw.violations == 0
    assert sender.is_cancelled()  # a closed stream counts as cancelled: nothing more to do
    assert not sender.send("late")  # dropped, not sent on a freed factory
    assert raw.sent == [("piece", 0), (None, 1)]


def test_stream_ledger_says_which_streams_had_no_final_response_and_which_sends_raised():
    from dspark.triton.response_sender import GuardedSender, StreamLedger

    class Refusing(FreedFactorySender):
        def send(self, response=None, flags=0):
            raise RuntimeError("Unable to send response")

    ledger = StreamLedger()
    answered = GuardedSender(FreedFactorySender(), final_flag=1, ledger=ledger)
    assert answered.send("piece") and answered.send(None, final=True)
    GuardedSender(FreedFactorySender(), final_flag=1, ledger=ledger)  # still running
    refused = GuardedSender(Refusing(), final_flag=1, ledger=ledger)
    with pytest.raises(RuntimeError):
        refused.send(None, final=True)
    assert ledger.summary() == ("2 of 3 response streams without a final response, 1 sends raised "
                                "(last: RuntimeError('Unable to send response'))")


def test_guarded_sender_asks_at_most_once_per_recheck_interval_and_remembers_a_cancel():
    from dspark.triton.response_sender import GuardedSender

    class Counting:
        asked, cancelled = 0, False

        def is_cancelled(self):
            self.asked += 1
            return self.cancelled

    raw = Counting()
    sender = GuardedSender(raw, final_flag=1, recheck_s=0.05)
    assert not any(sender.is_cancelled() for _ in range(100)) and raw.asked == 1
    raw.cancelled = True
    time.sleep(0.06)
    assert sender.is_cancelled() and raw.asked == 2
    assert sender.is_cancelled() and raw.asked == 2  # known now; the server is not asked again


def test_guarded_sender_with_an_asking_thread_never_waits_for_the_server():
    """With ``ask_on`` the caller (the round batcher) gets the answer it has at once; the server is
    asked on the other thread, once per recheck interval, and a cancel is seen after that."""
    from concurrent.futures import ThreadPoolExecutor

    from dspark.triton.response_sender import GuardedSender

    class Slow:
        asked, cancelled, threads = 0, False, set()

        def is_cancelled(self):
            self.asked += 1
            self.threads.add(threading.get_ident())
            time.sleep(0.05)  # a slow round trip
            return self.cancelled

    raw = Slow()
    with ThreadPoolExecutor(1) as asker:
        sender = GuardedSender(raw, final_flag=1, recheck_s=0.01, ask_on=asker.submit)
        start = time.monotonic()
        assert not any(sender.is_cancelled() for _ in range(100))
        assert time.monotonic() - start < 0.02  # no caller waited for the round trip
        raw.cancelled = True
        deadline = time.monotonic() + 2
        while not sender.is_cancelled() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert sender.is_cancelled()
    assert threading.get_ident() not in raw.threads
    assert raw.asked <= 2 + 2.0 / 0.05  # one question in flight at a time
    late = GuardedSender(Slow(), final_flag=1, ask_on=asker.submit)  # its executor is shut down
    assert not late.is_cancelled()  # asked here instead


def test_guarded_sender_asks_on_the_sending_thread_when_told_to():
    """A streaming request's sending thread refreshes the answer itself (``ask_here``), at half
    the recheck age, so the decode loop's check finds it fresh and wakes no asking thread."""
    from concurrent.futures import ThreadPoolExecutor

    from dspark.triton.response_sender import GuardedSender

    class Counting:
        cancelled = False

        def __init__(self):
            self.threads = []

        def is_cancelled(self):
            self.threads.append(threading.get_ident())
            return self.cancelled

    raw = Counting()
    with ThreadPoolExecutor(1) as asker:
        sender = GuardedSender(raw, final_flag=1, recheck_s=0.4, ask_on=asker.submit)
        assert not sender.is_cancelled(ask_here=True) and raw.threads == [threading.get_ident()]
        time.sleep(0.25)  # past half the recheck age, within it
        assert not sender.is_cancelled()  # the decode loop: still fresh, nobody asked
        assert not sender.is_cancelled(ask_here=True) and len(raw.threads) == 2
        raw.cancelled = True
        time.sleep(0.25)
        assert sender.is_cancelled(ask_here=True) and sender.known_cancelled
    assert raw.threads == [threading.get_ident()] * 3
