"""Bounds on what one client can make the API process hold: it runs inside `dspark serve`, which
supervises Triton, so running out of memory would take every model down with it.

- ``max_body_bytes``: a request body is read as it arrives and refused (413) at the limit, so an
  oversized body never sits in memory; the rest of it is read and dropped so the client gets
  the answer (for at most ``DRAIN_S``, then the connection is closed).
- ``max_header_bytes``: a request line and headers longer than this are refused (431) as they
  arrive, before the HTTP parser has gathered them.
- ``max_concurrency``: requests being answered at once (a stream counts until it ends); one
  more is refused with 429, which OpenAI's SDKs retry after a pause.

A pure ASGI wrapper (no BaseHTTPMiddleware: see app.py) plus a subclass of uvicorn's httptools
protocol for the header bound.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Optional

from dspark.openai.protocol import OpenAIError

MIB = 1 << 20
DRAIN_S = 30.0  # how long the rest of a refused body is read before the connection is closed


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 8 * MIB
    max_header_bytes: int = 64 << 10
    max_concurrency: int = 256


def _error_body(status: int, message: str, param: Optional[str], code: str) -> bytes:
    kind = "rate_limit_error" if status == 429 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


async def _send_json(send, status: int, body: bytes, headers: tuple = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class LimitedApp:
    """Wraps an ASGI app with the body and concurrency limits of ``limits``."""

    def __init__(self, app, limits: Limits, clock=time.monotonic):
        self.app, self.limits, self.clock = app, limits, clock
        self.running = 0
        size = limits.max_body_bytes
        shown = f"{size / MIB:g} MiB" if size >= MIB else f"{size} bytes"
        self.too_large_message = (f"the request body is larger than {shown}, "
                                  "this server's limit (dspark serve --openai-max-body-mb raises it)")
        self.too_many = _error_body(
            429, f"{limits.max_concurrency} requests are being answered, this server's limit; retry "
                 "later (dspark serve --openai-max-concurrency raises it)", None, "too_many_requests")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.running >= self.limits.max_concurrency:
            return await _send_json(send, 429, self.too_many, ((b"retry-after", b"1"),))
        limit = self.limits.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                return await self._refuse_body(receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    if message.get("more_body", False):
                        await self._drain(receive)
                    raise OpenAIError(413, self.too_large_message, code="body_too_large")
            return message

        self.running += 1
        try:
            await self.app(scope, counted, send)
        finally:
            self.running -= 1

    async def _drain(self, receive) -> None:
        """Read and drop the rest of a refused body (memory stays flat): a client that writes its
        whole body before it reads the reply then sees the answer."""
        deadline = self.clock() + DRAIN_S
        while self.clock() < deadline:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                break

    async def _refuse_body(self, receive, send) -> None:
        await self._drain(receive)
        await _send_json(send, 413, _error_body(413, self.too_large_message, None, "body_too_large"),
                         ((b"connection", b"close"),))


def header_limited_protocol(max_header_bytes: int):
    """uvicorn's httptools protocol, answering 431 once a request's line and headers pass
    ``max_header_bytes`` while they are still arriving."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    body = _error_body(431, f"the request line and headers are larger than {max_header_bytes >> 10} KiB, "
                            "this server's limit (dspark serve --openai-max-header-kb raises it)",
                       None, "headers_too_large")
    reply = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
             b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)

    class HeaderLimitedProtocol(HttpToolsProtocol):
        _head_bytes = 0
        _in_head = False

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes = True, 0

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            # a head again only once the next request's first byte arrives (on_message_begin): a
            # chunk that ended with a whole request is no head
            self._in_head, self._head_bytes = False, 0

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return
            super().data_received(data)
            if self._in_head:  # this chunk ended inside a head: the parser holds it
                self._head_bytes += len(data)
                if self._head_bytes > max_header_bytes:
                    self.transport.write(reply)
                    self.transport.close()

    return HeaderLimitedProtocol
