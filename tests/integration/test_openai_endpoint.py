"""The OpenAI-compatible API in front of the real server's spec_lm (SmolLM2), called with the real
`openai` Python SDK: listing, chat and completions streamed and not, usage, stop sequences, a
client that leaves mid-stream, and OpenAI-shaped errors."""
from __future__ import annotations

import json
import time

import openai
import pytest
import requests

from tests.integration.conftest import serve_openai
from tests.integration.spec_client import completion, metric, wait_for

MODEL = "spec_lm"
QUESTION = "Why is the sky blue? Answer in two sentences."
KEY = "openai-test-key-0123456789"


def _generate_chat(triton_server, question: str, max_tokens: int) -> str:
    body = {"text_input": question, "sampling_parameters": json.dumps({"max_tokens": max_tokens, "chat": True})}
    reply = requests.post(f"http://{triton_server.http_url}/v2/models/{MODEL}/generate", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["text_output"]


def test_models_lists_the_served_llms_only(client):
    ids = [m.id for m in client.models.list()]
    assert MODEL in ids
    assert "mlp_classifier" not in ids  # an ONNX classifier is no LLM


def test_chat_greedy_equals_triton_generate_and_counts_usage(client, triton_server):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=48, temperature=0)
    assert reply.object == "chat.completion"
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == _generate_chat(triton_server, QUESTION, 48)
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 10  # the chat template's tokens and the question's
    assert 0 < reply.usage.completion_tokens <= 48
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    if choice.finish_reason == "length":
        assert reply.usage.completion_tokens == 48


def test_streamed_chat_is_the_same_text_in_chunks(client):
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=48, temperature=0).choices[0].message.content
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=48, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([t for t in texts if t]) > 1  # really streamed
    assert "".join(texts) == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert len({c.id for c in chunks}) == 1


def test_completion_equals_triton_generate_streamed_or_not(client, triton_server):
    prompt = "def fibonacci(n):\n"
    want = completion(triton_server, MODEL, prompt, max_tokens=32)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0)
    assert reply.object == "text_completion" and reply.choices[0].text == want
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + want


def test_stop_sequence_ends_the_text(client):
    prompt = "def fibonacci(n):\n"
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0).choices[0].text
    stop = free.strip().split()[1]  # a word the free text has, after its first
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stop=[stop])
    assert stop not in reply.choices[0].text
    assert free.startswith(reply.choices[0].text) and len(reply.choices[0].text) < len(free)
    assert reply.choices[0].finish_reason == "stop"


def test_speculative_method_as_extension_field(client):
    messages = [{"role": "user", "content": QUESTION}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0,
                                           extra_body={"speculative": {"method": "none"}})
    suffix = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0,
                                            extra_body={"speculative": {"method": "suffix"}})
    assert plain.choices[0].message.content == suffix.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                       extra_body={"speculative": {"method": "nope"}})
    assert "speculative.method" in bad.value.message


def test_a_client_that_leaves_mid_stream_stops_generation(client, triton_server):
    """What a user sees on Triton's /metrics: the model's generated-token counter stops growing
    once the client has gone, and no request is left running."""
    args = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
            "temperature": 0, "extra_body": {"speculative": {"method": "none"}}}
    # the same greedy request, left alone, runs past the bound asserted below
    assert client.chat.completions.create(max_tokens=300, **args).choices[0].finish_reason == "length"
    before = metric(triton_server, MODEL, "dspark_speculative_generated_total")
    stream = client.chat.completions.create(max_tokens=1500, stream=True, **args)
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    stream.close()
    wait_for(lambda: metric(triton_server, MODEL, "dspark_speculative_requests_running") == 0, 10.0)
    made = metric(triton_server, MODEL, "dspark_speculative_generated_total") - before
    assert made < 300, f"{made} tokens generated for a client that left after 4 chunks"
    time.sleep(0.5)
    assert metric(triton_server, MODEL, "dspark_speculative_generated_total") - before == made
    after = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)  # still serving
    assert after.usage.completion_tokens > 0 and after.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("kwargs, param, fragment", [
    ({"temperature": 3}, "temperature", "less than or equal to 2"),
    ({"n": 2}, "n", "1"),
    ({"messages": []}, "messages", "at least 1"),
    ({"presence_penalty": 0.5}, "presence_penalty", "0"),
    ({"extra_body": {"best_of": 3}}, "best_of", "not supported"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
])
def test_bad_requests_are_openai_shaped_400s(client, kwargs, param, fragment):
    args = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(**args)
    assert bad.value.status_code == 400
    assert bad.value.body["type"] == "invalid_request_error"
    assert bad.value.body["param"] == param and fragment in bad.value.message
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).choices  # still serving


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no_such_model", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.status_code == 404 and missing.value.body["code"] == "model_not_found"
    assert missing.value.body["param"] == "model" and "no_such_model" in missing.value.message
    with pytest.raises(openai.NotFoundError):  # a served model that is not an LLM
        client.completions.create(model="mlp_classifier", prompt="hi")


def test_a_body_that_is_not_json_or_an_unknown_path_is_openai_shaped(api):
    reply = requests.post(f"{api.url}/chat/completions", data=b"{not json", timeout=10,
                          headers={"Content-Type": "application/json"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and "not JSON" in error["message"]
    for method, path, status in (("POST", "/embeddings", 404), ("GET", "/chat/completions", 405)):
        reply = requests.request(method, f"{api.url}{path}", json={}, timeout=10)
        assert reply.status_code == status
        assert "POST /v1/chat/completions" in reply.json()["error"]["message"]


def test_a_keyed_endpoint_needs_the_bearer_key(triton_server):
    server = serve_openai(triton_server, api_key=KEY)
    try:
        with pytest.raises(openai.AuthenticationError) as denied:
            openai.OpenAI(base_url=server.url, api_key="wrong-key", max_retries=0).models.list()
        assert denied.value.status_code == 401 and denied.value.body["code"] == "invalid_api_key"
        bare = requests.post(f"{server.url}/chat/completions", timeout=10,
                             json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert bare.status_code == 401 and bare.json()["error"]["type"] == "authentication_error"
        good = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
        assert MODEL in [m.id for m in good.models.list()]
    finally:
        server.stop()


def test_a_seed_reproduces_a_sampled_reply_whatever_the_method(client):
    def ask(**extra):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                              max_tokens=32, temperature=0.8, seed=11, **extra).choices[0].message.content

    first = ask()  # the default method, whose suffix tree learns from each reply
    assert ask() == first == ask(extra_body={"speculative": {"method": "none"}}) == \
        ask(extra_body={"speculative": {"method": "ngram"}})
