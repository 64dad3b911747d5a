"""The API process's own bounds (body, headers, concurrency) and its parsing of hostile bodies,
through Starlette's test client: each refusal is a 4xx in OpenAI's error shape."""
import asyncio
import json

import pytest
from starlette.testclient import TestClient

from dspark.openai.app import create_app, parse_body
from dspark.openai.limits import LimitedApp, Limits
from dspark.openai.protocol import OpenAIError


class _NoTriton:
    """Stands in for TritonLLMs where no request reaches the model."""

    async def close(self):
        pass

    async def ready(self):
        return False


def _client(limits=Limits(), **options):
    return TestClient(LimitedApp(create_app(_NoTriton(), **options), limits), raise_server_exceptions=False)


def test_a_body_over_the_limit_is_refused_while_it_streams_in():
    sent = []

    def chunks():
        for _ in range(64):
            sent.append(1)
            yield b"x" * 4096

    reply = _client(Limits(max_body_bytes=10_000)).post("/v1/completions", content=chunks())
    assert reply.status_code == 413
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and "--openai-max-body-mb" in error["message"]
    assert len(sent) == 64  # the rest was read (and dropped) so the client sees the answer


def test_a_declared_length_over_the_limit_is_refused_before_reading():
    reply = _client(Limits(max_body_bytes=100)).post("/v1/completions", content=b"{" + b" " * 200 + b"}")
    assert reply.status_code == 413 and "larger than 100 bytes" in reply.json()["error"]["message"]


@pytest.mark.parametrize("raw, words", [
    (b"[" * 100_000 + b"]" * 100_000, "nests too deeply"),
    (b'{"model": "m", "prompt": "\\ud800"}', "lone UTF-16 surrogate"),
    (b"{not json", "not JSON"),
])
def test_hostile_bodies_are_client_errors(raw, words):
    with pytest.raises(OpenAIError) as error:
        parse_body(raw)
    assert error.value.status == 400 and words in error.value.message
    reply = _client().post("/v1/completions", content=raw)
    assert reply.status_code == 400 and words in reply.json()["error"]["message"]


def test_a_surrogate_pair_is_a_character():
    assert parse_body(b'{"p": "\\ud83d\\ude80"}') == {"p": "\U0001F680"}


def test_a_wrong_method_is_a_client_error():
    reply = _client().get("/v1/completions")
    assert reply.status_code == 405 and reply.json()["error"]["type"] == "invalid_request_error"


def test_health_needs_no_key_and_follows_triton():
    reply = _client(api_key="k").get("/health")
    assert reply.status_code == 503  # this Triton is never ready


def test_cors_is_off_unless_an_origin_is_given():
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    assert "access-control-allow-origin" not in _client().options("/v1/chat/completions", headers=preflight).headers
    reply = _client(cors_origins=["https://app.example"]).options("/v1/chat/completions", headers=preflight)
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "https://app.example"
    assert "authorization" in reply.headers["access-control-allow-headers"].lower()


def test_requests_past_the_concurrency_limit_get_429():
    async def slow_app(scope, receive, send):
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def call(app):
        replies = []

        async def send(message):
            replies.append(message)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        await app({"type": "http", "method": "GET", "path": "/", "headers": []}, receive, send)
        return replies[0]["status"], (replies[1]["body"] if len(replies) > 1 else b"")

    async def run():
        global release
        release = asyncio.Event()
        app = LimitedApp(slow_app, Limits(max_concurrency=2))
        first = [asyncio.ensure_future(call(app)) for _ in range(2)]
        await asyncio.sleep(0)
        status, body = await call(app)  # a third while two are answered
        release.set()
        return status, json.loads(body), [await f for f in first], await call(app)

    status, body, first, after = asyncio.run(run())
    assert status == 429 and body["error"]["type"] == "rate_limit_error"
    assert [s for s, _ in first] == [200, 200] and after[0] == 200
