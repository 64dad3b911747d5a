"""The OpenAI-compatible API's protocol edges against the real server's spec_lm (SmolLM2), with
the real `openai` SDK and plain `requests`: a client that times out stops its generation, errors
before a stream's first token are OpenAI-shaped with the right status, harmless defaults are
accepted and hostile bodies refused with 400, a reply cut inside a character ends before it, the
API process's limits (body, headers, concurrency), /health, /tokenize, /detokenize and CORS."""
from __future__ import annotations

import json
import select
import socket
import time

import openai
import pytest
import requests

from dspark.openai.limits import MIB, Limits
from tests.integration.conftest import serve_openai
from tests.integration.spec_client import metric, wait_for

MODEL = "spec_lm"
KEY = "openai-test-key-0123456789"
LONG = [{"role": "user", "content": "Write a very long story about a dragon."}]


def _root(api) -> str:
    return api.url.removesuffix("/v1")


def _rss_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_client_that_times_out_stops_its_generation(api, triton_server):
    """A non-streamed request whose client gives up after 0.5 s: on Triton's /metrics the
    model's generated-token counter stops growing soon after, far short of max_tokens."""
    before = metric(triton_server, MODEL, "dspark_speculative_generated_total")
    impatient = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model=MODEL, messages=LONG, max_tokens=1500, temperature=0,
                                          extra_body={"speculative": {"method": "none"}})
    wait_for(lambda: metric(triton_server, MODEL, "dspark_speculative_requests_running") == 0, 10.0)
    made = metric(triton_server, MODEL, "dspark_speculative_generated_total") - before
    assert made < 300, f"{made} tokens generated for a client that left after 0.5 s"
    time.sleep(0.5)
    assert metric(triton_server, MODEL, "dspark_speculative_generated_total") - before == made


def test_an_error_before_a_streams_first_token_is_an_openai_error(client):
    too_long = "word " * 5000  # more tokens than spec_lm's context of 2048
    with pytest.raises(openai.BadRequestError) as bad:
        list(client.completions.create(model=MODEL, prompt=too_long, max_tokens=4, stream=True))
    assert bad.value.status_code == 400 and bad.value.body["type"] == "invalid_request_error"
    assert not bad.value.message.startswith("data:") and bad.value.body["param"] != "data"
    assert "context" in bad.value.message


def test_harmless_defaults_are_accepted(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        response_format={"type": "text"}, store=False, metadata={"team": "a"}, logprobs=False,
        tool_choice="none", parallel_tool_calls=False)
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4, temperature=0)
    assert reply.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as stored:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], store=True)
    assert stored.value.body["param"] == "store"


@pytest.mark.parametrize("raw, param", [
    (b'{"model": "spec_lm", "prompt": "a \\ud800 b", "max_tokens": 2}', None),
    (b'{"model": "spec_lm", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    (b'{"model": "spec_lm", "prompt": "a", "stream": "yes"}', "stream"),
    (b'{"model": "spec_lm", "prompt": "a", "max_tokens": "5"}', "max_tokens"),
])
def test_client_faults_are_400_and_the_server_keeps_serving(api, client, raw, param):
    reply = requests.post(f"{api.url}/completions", data=raw, timeout=30, headers={"Content-Type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["type"] == "invalid_request_error" and reply.json()["error"]["param"] == param
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).choices


def test_a_wrong_method_is_an_invalid_request(api):
    reply = requests.get(f"{api.url}/chat/completions", timeout=10)
    assert reply.status_code == 405 and reply.json()["error"]["type"] == "invalid_request_error"


def test_a_reply_cut_inside_a_character_ends_before_it(client):
    prompt = "東京 大阪 京都 札幌 福岡 東京 大阪 京都 札幌 福岡 東京 大阪 京都"
    texts = []
    for limit in range(1, 13):
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=limit, temperature=0)
        assert "\ufffd" not in reply.choices[0].text
        if reply.choices[0].finish_reason == "length":
            assert reply.usage.completion_tokens == limit  # every token counted, shown or not
        texts.append(reply.choices[0].text)
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    # some token completed no character: a cut fell inside one there
    assert any(a == b for a, b in zip(texts, texts[1:])), texts


def test_a_huge_body_is_refused_and_the_api_process_stays_small(triton_server):
    server = serve_openai(triton_server, api_key=KEY)
    try:
        before = _rss_kib()

        def body():
            chunk = b"x" * (1 << 16)
            for _ in range((300 * MIB) // len(chunk)):
                yield chunk

        reply = requests.post(f"{server.url}/chat/completions", data=body(), timeout=300,
                              headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        grown = _rss_kib() - before
        assert reply.status_code == 413
        assert "--openai-max-body-mb" in reply.json()["error"]["message"]
        assert grown < 16 * 1024, f"the API process grew by {grown} KiB for a refused body"
    finally:
        server.stop()


def test_a_huge_header_is_refused_while_it_arrives(api):
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: "
    sent, answer = 0, b""
    with socket.create_connection(("127.0.0.1", api.port), timeout=30) as conn:
        conn.sendall(head)
        try:
            while sent < 100 * MIB:
                conn.sendall(b"a" * (1 << 16))
                sent += 1 << 16
                if select.select([conn], [], [], 0)[0]:
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            while chunk := conn.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    assert answer.startswith(b"HTTP/1.1 431"), answer[:100]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "headers_too_large"
    assert sent < 4 * MIB  # answered as the head arrived, not after 100 MB
    assert requests.get(f"{_root(api)}/health", timeout=10).status_code == 200


def test_requests_past_the_concurrency_limit_get_429(triton_server):
    server = serve_openai(triton_server, limits=Limits(max_concurrency=2))
    sdk = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)

    def served() -> bool:
        try:
            return bool(sdk.completions.create(model=MODEL, prompt="Hi", max_tokens=1).choices)
        except openai.RateLimitError:
            return False

    try:
        streams = [sdk.chat.completions.create(model=MODEL, messages=LONG, max_tokens=200, stream=True)
                   for _ in range(2)]
        for stream in streams:
            next(iter(stream))  # both are being answered
        with pytest.raises(openai.RateLimitError) as refused:
            sdk.chat.completions.create(model=MODEL, messages=LONG, max_tokens=2)
        assert refused.value.status_code == 429 and "--openai-max-concurrency" in refused.value.message
        for stream in streams:
            stream.close()
        wait_for(served, 10.0)  # a place is free again once a stream has ended
    finally:
        server.stop()


def test_health_needs_no_key(triton_server):
    server = serve_openai(triton_server, api_key=KEY)
    try:
        assert requests.get(f"{_root(server)}/health", timeout=10).status_code == 200
        assert requests.get(f"{server.url}/models", timeout=10).status_code == 401
    finally:
        server.stop()


def test_tokenize_counts_what_a_generation_counts(api, client):
    prompt = "def fibonacci(n):\n"
    tokens = requests.post(f"{_root(api)}/tokenize", json={"model": MODEL, "prompt": prompt}, timeout=30).json()
    used = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage.prompt_tokens
    assert tokens["count"] == len(tokens["tokens"]) == used and tokens["max_model_len"] == 2048
    back = requests.post(f"{_root(api)}/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}, timeout=30)
    assert back.json() == {"prompt": prompt}
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    chat = requests.post(f"{_root(api)}/tokenize", json={"model": MODEL, "messages": messages}, timeout=30).json()
    assert chat["count"] == client.chat.completions.create(model=MODEL, messages=messages,
                                                           max_tokens=1).usage.prompt_tokens
    bad = requests.post(f"{_root(api)}/detokenize", json={"model": MODEL, "tokens": [10 ** 9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "detokenize"


def test_cors_preflight_is_answered_for_the_given_origin(triton_server):
    server = serve_openai(triton_server, api_key=KEY, cors_origins=["https://app.example"])
    try:
        reply = requests.options(f"{server.url}/chat/completions", timeout=10, headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "https://app.example"
        assert "authorization" in reply.headers["access-control-allow-headers"].lower()
        listed = requests.get(f"{server.url}/models", timeout=10, headers={
            "Origin": "https://app.example", "Authorization": f"Bearer {KEY}"})
        assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == "https://app.example"
    finally:
        server.stop()
