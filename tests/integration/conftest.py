"""The OpenAI-compatible API in front of the session's real Triton server: ``api`` (one per test
module, as `dspark serve --openai-port` runs it) and ``client``, the real `openai` SDK on it."""
from __future__ import annotations

import socket

import openai
import pytest

from dspark.openai.server import OpenAIServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_openai(triton_server, **options) -> OpenAIServer:
    """A started OpenAI API on a free loopback port (``options``: OpenAIServer's, e.g. limits)."""
    server = OpenAIServer("127.0.0.1", free_port(), triton_server.http_url,
                          repository_headers=triton_server.repository_headers, **options)
    server.start()
    return server


@pytest.fixture(scope="module")
def api(triton_server):
    server = serve_openai(triton_server)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=180)
