"""OpenAI request parsing, translation to the speculative backend's inputs, the response and
chunk shapes, SSE framing and the mapping of the backend's errors to HTTP statuses."""
import json

import pytest

from dspark.openai.protocol import (SSE_DONE, ChatCompletionRequest, CompletionRequest, OpenAIError,
                                    Reply, backend_error, parse, sse)


def test_chat_request_becomes_messages_and_sampling_parameters():
    req = parse(ChatCompletionRequest, {
        "model": "m", "messages": [{"role": "developer", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "hi "},
                                                                {"type": "text", "text": "there"}]}],
        "max_completion_tokens": 12, "temperature": 0, "seed": 3, "stop": "\n\n",
        "speculative": {"method": "suffix"}})
    inputs = req.backend_inputs()
    assert json.loads(inputs["messages"]) == [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": "hi there"}]
    assert json.loads(inputs["sampling_parameters"]) == {
        "max_tokens": 12, "temperature": 0.0, "top_p": 1.0, "stop": ["\n\n"], "seed": 3,
        "speculative": {"method": "suffix"}}


def test_completion_defaults_follow_openai():
    req = parse(CompletionRequest, {"model": "m", "prompt": ["once"]})
    params = json.loads(req.backend_inputs()["sampling_parameters"])
    assert params["temperature"] == 1.0 and params["max_tokens"] == 256  # documented defaults
    assert req.backend_inputs()["text_input"] == "once" and req.backend_inputs()["exclude_input_in_output"]


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m", "prompt": "a", "n": 3}, "n"),
    ({"model": "m", "prompt": "a", "stop": ["1", "2", "3", "4", "5"]}, "stop"),
    ({"model": "m", "prompt": "a", "logprobs": 6}, "logprobs"),
    ({"model": "m", "prompt": "a", "suffix": "x"}, "suffix"),
    ({"model": "", "prompt": "a"}, "model"),
    ({"prompt": "a"}, "model"),
])
def test_bad_fields_are_named(body, param):
    with pytest.raises(OpenAIError) as error:
        parse(CompletionRequest, body)
    assert error.value.status == 400 and error.value.param == param
    assert error.value.body()["error"]["type"] == "invalid_request_error"


def test_body_must_be_an_object():
    with pytest.raises(OpenAIError) as error:
        parse(ChatCompletionRequest, [1, 2])
    assert error.value.status == 400


@pytest.mark.parametrize("message, status, param", [
    ("busy: 4 requests running and 16 waiting; retry later", 429, None),
    ("the model is shutting down", 503, None),
    ("spec_lm is unloading; the request was stopped after 3 tokens", 503, None),
    ("generation failed: boom", 500, None),
    ("speculative.method: 'x' is not one of this model's methods ('none',)", 400, "speculative.method"),
    ("prompt of 5000 tokens does not fit", 400, None),
])
def test_backend_errors_map_to_statuses(message, status, param):
    error = backend_error(message)
    assert (error.status, error.param) == (status, param) and error.message == message


def test_chunks_and_sse_framing():
    reply = Reply(parse(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}]}))
    first, mid, last = reply.chunk("He", first=True), reply.chunk("llo"), reply.chunk(None, "stop")
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "He"}
    assert mid["choices"][0]["delta"] == {"content": "llo"} and last["choices"][0]["delta"] == {}
    assert last["choices"][0]["finish_reason"] == "stop"
    assert {first["id"], mid["id"], last["id"]} == {reply.id} and reply.id.startswith("chatcmpl-")
    event = sse(mid)
    assert event.startswith(b"data: {") and event.endswith(b"\n\n") and json.loads(event[6:]) == mid
    assert SSE_DONE == b"data: [DONE]\n\n"


LOGPROB_ENTRIES = [{"id": 7, "text": "He", "bytes": [72, 101], "logprob": -0.5,
                    "top_logprobs": [{"id": 7, "text": "He", "bytes": [72, 101], "logprob": -0.5},
                                     {"id": 9, "text": "I", "bytes": [73], "logprob": -1.5}]},
                   {"id": 8, "text": "llo", "bytes": [108, 108, 111], "logprob": -0.1, "top_logprobs": []}]


def test_logprobs_requests_become_sampling_parameters():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    params = lambda req: json.loads(req.backend_inputs()["sampling_parameters"])  # noqa: E731
    assert params(parse(ChatCompletionRequest, {**chat, "logprobs": True, "top_logprobs": 3}))["logprobs"] == 3
    assert params(parse(ChatCompletionRequest, {**chat, "logprobs": True}))["logprobs"] == 0
    assert "logprobs" not in params(parse(ChatCompletionRequest, {**chat, "logprobs": False}))
    assert params(parse(CompletionRequest, {"model": "m", "prompt": "a", "logprobs": 2}))["logprobs"] == 2
    for bad in ({**chat, "top_logprobs": 2}, {**chat, "logprobs": True, "top_logprobs": 21}):
        with pytest.raises(OpenAIError) as error:
            parse(ChatCompletionRequest, bad)
        assert error.value.status == 400 and error.value.param == "top_logprobs"


def test_logprobs_shapes_of_chat_and_legacy_completions():
    chat = Reply(parse(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
    content = chat.logprobs(LOGPROB_ENTRIES)["content"]
    assert content[0] == {"token": "He", "logprob": -0.5, "bytes": [72, 101],
                          "top_logprobs": [{"token": "He", "logprob": -0.5, "bytes": [72, 101]},
                                           {"token": "I", "logprob": -1.5, "bytes": [73]}]}
    assert chat.logprobs(None) is None
    legacy = Reply(parse(CompletionRequest, {"model": "m", "prompt": "Say"}))
    legacy.skip("Say")  # an echoed prompt
    first = legacy.logprobs(LOGPROB_ENTRIES[:1])
    second = legacy.logprobs(LOGPROB_ENTRIES[1:])  # the next streamed chunk goes on counting
    assert first == {"tokens": ["He"], "token_logprobs": [-0.5], "top_logprobs": [{"He": -0.5, "I": -1.5}],
                     "text_offset": [3]}
    assert second["text_offset"] == [5] and second["tokens"] == ["llo"]
