"""The router's metric hooks (``RouterMetrics``; the Triton adapter maps them to /metrics), the
thread that applies them off the request path, and per-stage timings for the overhead breakdown."""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections import deque
from pathlib import Path
from statistics import median

log = logging.getLogger("dspark.routing")
# a folder: when set, each router writes its per-stage timings there (StageTimes), as <router>.json
STAGES_ENV = "DSPARK_ROUTER_STAGES"


class RouterMetrics:
    """Metric hooks; the default records nothing. The Triton adapter maps them to MetricFamily."""

    def request(self, tier: str, version: int, count: int = 1) -> None: ...
    def rejection(self, tier: str, reason: str, count: int = 1) -> None: ...
    def target_error(self, version: int, count: int = 1) -> None: ...  # failed or timed-out calls (rollout analysis)
    def queue_time(self, tier: str, seconds: float) -> None: ...
    def latency(self, tier: str, version: int, seconds: float) -> None: ...
    def shadow(self, version: int, outcome: str, seconds: float | None) -> None: ...
    def weights(self, tier: str, weight: float, factor: float) -> None: ...
    def config_version(self, version: int) -> None: ...
    def fast_path(self, count: int) -> None: ...


class DeferredMetrics:
    """Hands metric calls to a background thread that applies them in batches every
    ``flush_s``: each pb_utils metric update is an IPC round trip to the Triton process, which
    would otherwise compete with the request's own response for the stub's channel."""

    def __init__(self, target: RouterMetrics, flush_s: float = 0.25):
        self._target = target
        self._flush_s = flush_s
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="router-metrics", daemon=True)
        self._thread.start()

    def __getattr__(self, name: str):
        def record(*args):
            self._calls.put((name, args))
        self.__dict__[name] = record  # found directly from the next call on
        return record

    def _drain(self) -> None:
        while True:
            closed = self._closed.wait(self._flush_s)
            while True:
                try:
                    name, args = self._calls.get_nowait()
                except queue.Empty:
                    break
                try:
                    getattr(self._target, name)(*args)
                except Exception:
                    log.exception("metric update %s failed", name)
            if closed:
                return

    def close(self, timeout_s: float = 5.0) -> None:
        self._closed.set()
        self._thread.join(timeout_s)


class StageTimes:
    """Per-stage durations of recent requests (for the overhead breakdown in docs/router.md);
    written as JSON medians to ``path`` at every tick. Off unless the adapter asks for it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._stages: dict[str, deque] = {}

    def add(self, stage: str, seconds: float) -> None:
        self._stages.setdefault(stage, deque(maxlen=2000)).append(seconds)

    def dump(self) -> None:
        summary = {stage: {"p50_ms": 1000 * median(values), "n": len(values)}
                   for stage, values in list(self._stages.items()) if values}
        # readers poll the file while it is rewritten: replace it whole, never truncate it
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(summary, indent=1))
        partial.replace(self.path)
