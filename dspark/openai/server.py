"""Run the OpenAI-compatible API with uvicorn on a thread of the calling process (`dspark serve`
starts it this way, so its key is in no argv and no child environment)."""
from __future__ import annotations

import threading
import time
from typing import Optional, Sequence

from dspark.openai.app import create_app
from dspark.openai.limits import LimitedApp, Limits, header_limited_protocol
from dspark.openai.triton import TritonLLMs


class OpenAIServer:
    """``start()`` returns once the port accepts connections; ``stop()`` ends it."""

    def __init__(self, host: str, port: int, triton_http_url: str, api_key: Optional[str] = None,
                 repository_headers: Optional[dict] = None, limits: Limits = Limits(),
                 cors_origins: Sequence[str] = ()):
        import uvicorn

        self.host, self.port = host, port
        app = LimitedApp(create_app(TritonLLMs(triton_http_url, repository_headers), api_key, cors_origins), limits)
        self._server = uvicorn.Server(uvicorn.Config(
            app, host=host, port=port, log_level="warning", access_log=False, lifespan="on",
            http=header_limited_protocol(limits.max_header_bytes)))
        self._server.install_signal_handlers = lambda: None  # the caller owns the signals
        self._thread = threading.Thread(target=self._server.run, name="openai-api", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self, timeout_s: float = 30.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the OpenAI API could not start on {self.host}:{self.port} "
                                   "(is the port in use? --openai-port picks another)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI API did not start on {self.host}:{self.port} in {timeout_s:g} s")
            time.sleep(0.02)

    def request_stop(self) -> None:
        """Stop taking requests; once those running have ended, close the connections to Triton."""
        self._server.should_exit = True

    def stop(self) -> None:
        self.request_stop()
        self._thread.join(timeout=10)
