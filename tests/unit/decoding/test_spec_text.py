"""Request parsing and the text layer (stop strings, streaming) of the speculative
backend."""
import json

import pytest

from dspark.decoding.request import parse_sampling_parameters
from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.decoding.text import send_coalesced
from dspark.errors import RequestError
from tests.fixtures.gguf_pair import pair_generator

METHODS = ("none", "draft", "ngram", "suffix", "hybrid", "tree")


@pytest.mark.parametrize("raw,field", [
    (b"{nope", "sampling_parameters"),
    (b"[1, 2]", "sampling_parameters"),
    (json.dumps({"max_tokens": -3}), "max_tokens"),
    (json.dumps({"max_tokens": "ten"}), "max_tokens"),
    (json.dumps({"temperature": 11}), "temperature"),
    (json.dumps({"top_k": -1}), "top_k"),
    (json.dumps({"top_p": 0}), "top_p"),
    (json.dumps({"seed": -1}), "seed"),
    (json.dumps({"stop": [""]}), "stop[0]"),
    (json.dumps({"temperature": 5e-324}), "temperature"),
    (json.dumps({"temperature": 1e-5}), "temperature"),
    (b'{"temperature": NaN}', "sampling_parameters"),
    (b'{"top_p": Infinity}', "sampling_parameters"),
    (json.dumps({"top_p": 1.0000001}), "top_p"),
    (json.dumps({"max_tokens": True}), "max_tokens"),
    (json.dumps({"max_tokens": "10"}), "max_tokens"),
    (json.dumps({"chat": "yes"}), "chat"),
    (b'{"stop": "\xff"}', "sampling_parameters"),
    (json.dumps({"beam": 2}), "beam"),
    (json.dumps({"speculative": {"method": "medusa"}}), "speculative.method"),
    (json.dumps({"speculative": {"num_speculative_tokens": 0}}), "speculative.num_speculative_tokens"),
    (json.dumps({"speculative": {"tree_width": 9}}), "speculative.tree_width"),
    (json.dumps({"speculative": {"k": 2}}), "speculative.k"),
    (json.dumps({"speculative": 3}), "speculative"),
])
def test_bad_sampling_parameters_name_the_field(raw, field):
    with pytest.raises(RequestError) as info:
        parse_sampling_parameters(raw, SpeculativeParams(), METHODS)
    assert info.value.field == field and field in str(info.value)


def test_sampling_parameters_fill_defaults_and_override_the_method():
    sampling, spec = parse_sampling_parameters(
        json.dumps({"max_tokens": 7, "temperature": 0.8, "stop": "\n\n",
                    "speculative": {"method": "ngram"}}), SpeculativeParams("tree", tree_width=3))
    assert (sampling.max_tokens, sampling.temperature, sampling.stop) == (7, 0.8, ["\n\n"])
    assert (spec.method, spec.tree_width) == ("ngram", 3)
    assert parse_sampling_parameters(None, SpeculativeParams())[0] == SamplingParams()


@pytest.fixture(scope="module")
def generator():
    return pair_generator()


def test_stream_pieces_join_to_the_complete_text(generator):
    sampling = SamplingParams(max_tokens=40)  # greedy: tree and plain agree token for token
    pieces = list(generator.stream("import os\n", sampling, SpeculativeParams("tree")))
    assert "".join(pieces) == generator.complete("import os\n", sampling, SpeculativeParams("none"))
    assert len(pieces) > 1


def test_stop_string_is_cut_with_everything_after_it(generator):
    sampling = SamplingParams(max_tokens=60, temperature=1.0, seed=5)
    whole = generator.complete("import os\n", sampling, SpeculativeParams("none"))
    stop = whole[20:23]
    cut = generator.complete("import os\n", SamplingParams(max_tokens=60, temperature=1.0, seed=5, stop=[stop]),
                             SpeculativeParams("none"))
    assert cut == whole[:whole.index(stop)]


def _slow_pieces(pieces, delay_s):
    import time
    for i, piece in enumerate(pieces):
        # a long pause after the first piece: it must have gone out alone by then, however
        # slowly the sending thread was scheduled
        time.sleep(0.1 if i == 1 else delay_s)
        yield piece


def test_streamed_pieces_are_coalesced_but_never_lost_or_reordered():
    import time
    pieces = [f"<{i}>" for i in range(40)]
    sent = []

    def slow_send(text):  # a transport slower than generation gets fewer, larger messages
        sent.append(text)
        time.sleep(0.01)

    rest = send_coalesced(_slow_pieces(pieces, 0.001), slow_send)  # the end: for the final message
    assert "".join(sent) + rest == "".join(pieces)
    assert sent[0] == "<0>" and len(sent) < len(pieces) / 2

    sent.clear()
    started = time.monotonic()
    rest = send_coalesced(_slow_pieces(pieces, 0.002), sent.append, min_interval_s=0.03)
    assert "".join(sent) + rest == "".join(pieces) and sent[0] == "<0>"
    assert len(sent) <= (time.monotonic() - started) / 0.03 + 2  # at most one per interval


def test_a_piece_goes_out_when_its_interval_ends_not_with_the_next_piece():
    import time

    def pieces():
        yield "a"
        time.sleep(0.005)
        yield "b"  # within the interval of "a": held
        time.sleep(0.3)
        yield "c"

    sent = []
    rest = send_coalesced(pieces(), lambda text: sent.append((text, time.monotonic())), min_interval_s=0.03)
    assert [text for text, _ in sent] == ["a", "b"] and rest == "c"  # the last, after the generator ended
    assert 0.02 < sent[1][1] - sent[0][1] < 0.2  # "b" when the interval ended, not 0.3 s later


def test_a_final_delta_is_returned_for_the_final_message_not_sent():
    """A reply's last text rides on the final response: a one-token reply is one message."""
    import time

    from dspark.decoding.text import Delta

    def pieces(final_after: float):
        yield "a"
        time.sleep(0.05)
        last = Delta("b")
        last.final = True
        yield last
        time.sleep(final_after)  # the generator's own end comes later still

    sent = []
    started = time.monotonic()
    assert send_coalesced(pieces(0.0), sent.append) == "b" and sent == ["a"]
    sent.clear()
    assert send_coalesced(pieces(0.3), sent.append) == "b" and sent == ["a"]
    assert time.monotonic() - started > 0.3  # the producer was waited for


def test_a_failure_while_streaming_is_raised_after_the_text_before_it():
    import time

    def failing():
        yield "a"
        yield "b"
        raise RuntimeError("model failed")

    sent = []
    with pytest.raises(RuntimeError, match="model failed"):
        send_coalesced(failing(), sent.append)
    assert "".join(sent) == "ab"

    produced = []

    def endless():
        for i in range(10_000):
            produced.append(i)
            time.sleep(0.001)
            yield str(i)

    def broken_send(text):
        raise ConnectionError("client gone")

    with pytest.raises(ConnectionError):
        send_coalesced(endless(), broken_send)
    time.sleep(0.05)
    stopped_at = len(produced)
    time.sleep(0.05)
    assert len(produced) == stopped_at < 10_000  # production stopped
