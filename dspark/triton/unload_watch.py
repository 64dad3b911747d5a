"""How a Python model with requests in flight learns that Triton is unloading it.

Triton calls ``finalize`` only once every request has had its final response, so a model whose
requests run for seconds learns of an unload (or a server stop) from the server's health
endpoints: while busy, it asks every ``UNLOAD_POLL_S`` whether the server is live and the model
ready; while idle, every ``IDLE_POLL_S`` (an unload that then never reaches finalize is reported,
with every thread's stack, so a stop that hangs is diagnosable).
"""
from __future__ import annotations

import faulthandler
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Optional

from dspark.triton.adapter import server_http_url
from dspark.triton.request_pool import RequestPool
from dspark.triton.response_sender import StreamLedger

UNLOAD_POLL_S = 0.25
IDLE_POLL_S = 1.0
# an unload ends running requests within a round and Triton then calls finalize; when it has not
# after this long, the model logs so with every thread's stack
UNLOAD_REPORT_S = 5.0


RESTRICTED = 403  # Triton's answer to an endpoint restricted by --http-restricted-api


def _http_status(url: str) -> int:
    """The HTTP status of GET ``url``; OSError when the server does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


class UnloadWatch:
    """A thread that sets ``pool.closing`` once the server is gone or no longer has this model
    ready (running requests then end at their next round, answered). Server liveness, not
    readiness: with Triton's default strict readiness the server is "not ready" while any other
    model loads or unloads."""

    def __init__(self, name: str, version: str, pool: RequestPool, streams: StreamLedger,
                 log_info: Callable[[str], None], log_warn: Callable[[str], None],
                 base_url: Optional[str] = None):
        self.name, self.version, self.pool, self.streams = name, version, pool, streams
        self.log_info, self.log_warn = log_info, log_warn
        self.base_url = base_url if base_url is not None else server_http_url()
        self.finalizing = threading.Event()
        self.thread = threading.Thread(target=self.watch, name="unload-watch", daemon=True)

    def start(self) -> "UnloadWatch":
        self.thread.start()
        return self

    def stop(self, timeout_s: float) -> None:
        """Finalize has begun: end the thread."""
        self.finalizing.set()
        if self.thread.is_alive():
            self.thread.join(timeout_s)

    def watch(self) -> None:
        """The thread's loop (ends once the pool closes, then reports a finalize that does not follow)."""
        if self.base_url is None:
            return
        urls = [f"http://{self.base_url}/v2/health/live",
                f"http://{self.base_url}/v2/models/{self.name}/versions/{self.version}/ready"]
        failures = late = 0
        seen_ready, asked = False, float("-inf")
        while not self.pool.closing.wait(UNLOAD_POLL_S):
            busy = self.pool.load != (0, 0)
            if not busy and time.monotonic() - asked < IDLE_POLL_S:
                continue
            asked = time.monotonic()
            try:
                codes = [_http_status(url) for url in urls]
                ready = all(code == 200 for code in codes)
                failures = late = 0
                # a running request means the model was ready, even when the server stopped
                # before a check saw it so; a restricted endpoint tells nothing
                seen_ready = seen_ready or (busy and RESTRICTED not in codes)
            except (ConnectionError, urllib.error.URLError) as error:
                if isinstance(getattr(error, "reason", error), TimeoutError):
                    late = self._late(late, error)
                    continue  # a busy server answers late; that is no reason to stop
                if not (seen_ready or busy):
                    continue  # refused before ever ready: the server opens HTTP once every model loaded
                failures += 1  # refused: the server is gone
                ready = failures < 2
            except OSError as error:  # a timeout, or anything else the network says: ask again
                late = self._late(late, error)
                continue
            seen_ready = seen_ready or ready
            if not ready and seen_ready:  # never ready: still loading, or the endpoints are restricted
                running, waiting = self.pool.load
                self.pool.closing.set()
                if running or waiting:
                    self.log_info(f"speculative backend: {self.name} is unloading; stopping "
                                  f"{running} running and {waiting} waiting requests")
        if not self.finalizing.wait(UNLOAD_REPORT_S):
            self._report_stuck()

    def _report_stuck(self) -> None:
        running, waiting = self.pool.load
        cause = ""
        if not (running or waiting or self.streams.open_streams):
            cause = ("; every request had its final response, so Triton itself holds the model: its gRPC "
                     "frontend keeps a request whose stream the client cancelled as the final response was "
                     "written (Triton 2.51; docs/speculative.md, \"Why an unload hung\")")
        self.log_warn(f"speculative backend: {self.name}: not finalized {UNLOAD_REPORT_S:g} s after "
                      f"the unload began ({running} requests running, {waiting} waiting; "
                      f"{self.streams.summary()}){cause}; the stub's thread stacks follow on stderr")
        faulthandler.dump_traceback(all_threads=True)

    def _late(self, late: int, error: BaseException) -> int:
        """Count health checks that got no answer in time; say so once, at the fourth."""
        late += 1
        if late == 4:
            self.log_warn(f"speculative backend: {self.name}: the server's health endpoints "
                          f"did not answer 4 times in a row ({error!r}); still asking")
        return late
