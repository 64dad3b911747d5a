"""The served LLMs, reached through Triton's gRPC streaming API (tritonclient.grpc.aio).

An LLM is any ready model whose backend is dspark's ``speculative``: found from Triton's
repository index and model configs, never by name. One request = one gRPC stream that sends
one inference request and half-closes; the model's final response carries ``usage``. When the
HTTP client goes away the call is cancelled, which the backend sees within a round and stops.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional

import numpy as np

from dspark.openai.protocol import OpenAIError, backend_error

LLM_BACKEND = "speculative"
MODELS_TTL_S = 2.0  # how long the list of served LLMs is reused


@dataclass
class Piece:
    """Text the model streamed; the last piece of a request also has the usage counts."""
    text: str
    prompt_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    finish_reason: Optional[str] = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None


def _bytes_input(grpc, name: str, value) -> object:
    if isinstance(value, bool):
        tensor = grpc.InferInput(name, [1], "BOOL")
        tensor.set_data_from_numpy(np.array([value], dtype=bool))
    else:
        tensor = grpc.InferInput(name, [1], "BYTES")
        tensor.set_data_from_numpy(np.array([value.encode("utf-8")], dtype=np.object_))
    return tensor


class TritonLLMs:
    """Lists and calls the LLMs of one Triton server. ``headers``: sent with the repository
    index call (the model-repository API may need the server's key)."""

    def __init__(self, grpc_url: str, headers: Optional[dict] = None):
        self.grpc_url = grpc_url
        self.headers = headers or {}
        self._client = None
        self._models: list[dict] = []
        self._models_at = 0.0
        self._lock: Optional[asyncio.Lock] = None

    def client(self):
        if self._client is None:  # created inside the event loop that uses it
            import tritonclient.grpc.aio as grpc_aio

            self._client = grpc_aio.InferenceServerClient(self.grpc_url)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def models(self) -> list[dict]:
        """[{"id", "created"}] of the ready LLMs, refreshed every MODELS_TTL_S."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if time.monotonic() - self._models_at < MODELS_TTL_S:
                return self._models
            client = self.client()
            index = await client.get_model_repository_index(headers=self.headers, as_json=True)
            found = []
            for entry in index.get("models", []):
                if entry.get("state") != "READY":
                    continue
                config = await client.get_model_config(entry["name"], as_json=True)
                if config.get("config", {}).get("backend") == LLM_BACKEND and \
                        entry["name"] not in {m["id"] for m in found}:
                    found.append({"id": entry["name"], "object": "model", "created": 0,
                                  "owned_by": "dspark"})
            self._models, self._models_at = found, time.monotonic()
            return found

    async def require(self, model: str) -> None:
        if model not in {m["id"] for m in await self.models()}:
            self._models_at = 0.0  # a model loaded since: look again once
            if model not in {m["id"] for m in await self.models()}:
                raise OpenAIError(404, f"model '{model}' is not a served LLM (GET /v1/models lists them)",
                                  "model", "model_not_found")

    async def generate(self, model: str, inputs: dict, stream: bool) -> AsyncIterator[Piece]:
        """The model's pieces of text; the last one is final. Cancelling the consumer (the HTTP
        client went away) cancels the gRPC call."""
        import tritonclient.grpc as grpc

        tensors = [_bytes_input(grpc, name, value) for name, value in inputs.items()]
        tensors.append(_bytes_input(grpc, "stream", stream))
        request = {"model_name": model, "inputs": tensors,
                   "outputs": [grpc.InferRequestedOutput("text_output"), grpc.InferRequestedOutput("usage")]}

        async def one_request():
            yield request  # then the request side closes: the stream ends after the final response

        responses = self.client().stream_infer(one_request())
        finished = False
        try:
            async for result, error in responses:
                if error is not None:
                    raise backend_error(str(error.message()))
                text = b"".join(result.as_numpy("text_output").ravel()).decode("utf-8")
                usage = result.as_numpy("usage")
                if usage is None:
                    yield Piece(text)
                    continue
                counts = json.loads(usage.ravel()[0])
                finished = True
                yield Piece(text, counts["prompt_tokens"], counts["completion_tokens"],
                            counts["finish_reason"])
                return
            raise OpenAIError(500, f"model '{model}' ended its stream without a final response")
        finally:
            if not finished:
                responses.cancel()
