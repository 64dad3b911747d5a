"""The served LLMs, reached through Triton's HTTP generate endpoints (aiohttp, keep-alive).

An LLM is any ready model whose backend is dspark's ``speculative``: found from Triton's
repository index and model configs, never by name. A request is one call to the same endpoint a
Triton user would call: ``/v2/models/M/generate`` (one response), or ``generate_stream`` with
``stream: true`` (server-sent events, one per response the model sends; the final one carries
``usage``). So Triton does the same work for the API as for its own clients, and the API adds only
its own CPU: over gRPC, Triton's streaming frontend and grpcio's threads cost more per response.
When the HTTP client goes away the connection to Triton is closed, which Triton turns into the
request's cancellation; the backend sees it within a round and stops.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from dspark.openai.protocol import OpenAIError, backend_error

LLM_BACKEND = "speculative"
MODELS_TTL_S = 2.0  # how long the list of served LLMs is reused
CONNECT_TIMEOUT_S = 10.0  # a generation itself may take minutes: no total timeout


@dataclass
class Piece:
    """Text the model streamed; the last piece of a request also has the usage counts."""
    text: str
    prompt_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    finish_reason: Optional[str] = None
    logprobs: Optional[list[dict]] = None  # the backend's entries, when asked for

    @property
    def final(self) -> bool:
        return self.finish_reason is not None


def piece_of(response: dict) -> Piece:
    """A Piece from one JSON response of the generate endpoints (``usage`` only on the final one)."""
    if "error" in response:
        raise backend_error(str(response["error"]))
    text = response.get("text_output", "")
    usage = response.get("usage")
    logprobs = json.loads(response["logprobs"]) if "logprobs" in response else None
    if usage is None:
        return Piece(text, logprobs=logprobs)
    counts = json.loads(usage)
    return Piece(text, counts["prompt_tokens"], counts["completion_tokens"], counts["finish_reason"],
                 logprobs)


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body[:300].decode("utf-8", "replace")


class TritonLLMs:
    """Lists and calls the LLMs of one Triton server (``http_url``: host:port of its HTTP
    endpoint). ``headers``: sent with every call (the server's key: its model-repository API
    needs it, and so does inference when the server was started with ``--key-inference``)."""

    def __init__(self, http_url: str, headers: Optional[dict] = None):
        self.base = http_url if "://" in http_url else f"http://{http_url}"
        self.headers = headers or {}
        self._session = None
        self._models: list[dict] = []
        self._models_at = 0.0
        self._backends: dict[tuple[str, str], Optional[str]] = {}  # (name, version) -> backend
        self._lock: Optional[asyncio.Lock] = None

    def session(self):
        if self._session is None:  # created inside the event loop that uses it
            import aiohttp

            self._session = aiohttp.ClientSession(
                self.base, timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
                connector=aiohttp.TCPConnector(limit=0), skip_auto_headers=("User-Agent",))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _get_json(self, method: str, path: str, headers: Optional[dict] = None):
        import aiohttp

        try:
            async with self.session().request(method, path, headers=headers) as reply:
                body = await reply.read()
                if reply.status != 200:
                    raise OpenAIError(503 if reply.status == 503 else 500,
                                      f"Triton answered {reply.status} to {path}: {_error_text(body)}")
                return json.loads(body)
        except aiohttp.ClientError as error:
            raise self._unreachable(error) from None

    def _unreachable(self, error: Exception) -> OpenAIError:
        return OpenAIError(503, f"Triton is not reachable at {self.base}: {error}", code="model_unavailable")

    async def models(self) -> list[dict]:
        """[{"id", "created"}] of the ready LLMs, refreshed every MODELS_TTL_S (one index call;
        a model's config is read once per loaded version)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if time.monotonic() - self._models_at < MODELS_TTL_S:
                return self._models
            index = await self._get_json("POST", "/v2/repository/index", self.headers)
            ready = {(entry["name"], entry.get("version", "")) for entry in index if entry.get("state") == "READY"}
            self._backends = {key: backend for key, backend in self._backends.items() if key in ready}
            found: dict[str, dict] = {}
            for name, version in sorted(ready):
                if (name, version) not in self._backends:
                    config = await self._get_json("GET", f"/v2/models/{name}/config", self.headers)
                    self._backends[(name, version)] = config.get("backend")
                if self._backends[(name, version)] == LLM_BACKEND:
                    found[name] = {"id": name, "object": "model", "created": 0, "owned_by": "dspark"}
            self._models, self._models_at = list(found.values()), time.monotonic()
            return self._models

    async def require(self, model: str) -> None:
        if model not in {m["id"] for m in await self.models()}:
            self._models_at = 0.0  # a model loaded since: look again once
            if model not in {m["id"] for m in await self.models()}:
                raise OpenAIError(404, f"model '{model}' is not a served LLM (GET /v1/models lists them)",
                                  "model", "model_not_found")

    async def generate(self, model: str, inputs: dict, stream: bool) -> AsyncIterator[Piece]:
        """The model's pieces of text; the last one is final. Closing this iterator before the
        final piece (the HTTP client went away) closes the connection, which cancels the request."""
        import aiohttp

        body = json.dumps({**inputs, "stream": stream}).encode()
        path = f"/v2/models/{model}/generate_stream" if stream else f"/v2/models/{model}/generate"
        done = False  # Triton has answered the whole request: the connection may be reused
        try:
            reply = await self.session().post(path, data=body, headers={"Content-Type": "application/json",
                                                                        **self.headers})
        except aiohttp.ClientError as error:
            raise self._unreachable(error) from None
        try:
            if reply.status != 200 or not stream:
                whole = await reply.read()
                done = True
                if reply.status != 200:
                    raise backend_error(_error_text(whole))
                piece = piece_of(json.loads(whole))
                if not piece.final:
                    raise OpenAIError(500, f"model '{model}' answered without usage counts")
                yield piece
                return
            async for line in reply.content:
                if not line.startswith(b"data: "):
                    continue  # the blank line that ends each event
                piece = piece_of(json.loads(line[6:]))
                if piece.final:
                    await reply.read()  # the end of the chunked body: then the connection is reusable
                    done = True
                yield piece
                if done:
                    return
            raise OpenAIError(500, f"model '{model}' ended its stream without a final response")
        except aiohttp.ClientError as error:
            raise OpenAIError(500, f"the stream from Triton broke: {error}") from None
        finally:
            if done:
                reply.release()
            else:
                reply.close()  # closing the connection cancels the model's request
