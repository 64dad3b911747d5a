"""Shadow traffic: after a sampled request is answered, the same inputs go to the shadow version
and its outputs are compared with the answer's (``outputs_agree``); the outcome is counted, never
returned. At most ``ShadowPolicy.max_inflight`` shadow calls run at once; a sampled request
beyond that is counted as ``skipped``."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

import numpy as np

from dspark.routing.config import ShadowPolicy
from dspark.routing.graying import outputs_agree
from dspark.routing.metrics import RouterMetrics

log = logging.getLogger("dspark.routing")
SHADOW_CALL_TIMEOUT_S = 60.0


class Shadower:
    """Runs one router's shadow calls on a small pool of their own (``target``: the router's
    ``runtime.Target``)."""

    def __init__(self, target: Any, metrics: RouterMetrics, name: str,
                 clock: Callable[[], float] = time.monotonic, workers: int = 8):
        self.target, self.metrics, self.name, self.clock = target, metrics, name, clock
        self._lock = threading.Lock()
        self._inflight = 0
        self._logged_at = float("-inf")
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"{name}-shadow")

    def copies(self, payload: Any, outputs: Any) -> tuple[Any, Mapping[str, np.ndarray]]:
        """What a shadow call needs after the answer is sent: its own copy of the inputs and the
        primary outputs as arrays."""
        return self.target.detach(payload), self.target.arrays(outputs)

    def send(self, policy: ShadowPolicy, payload: Any, primary: Mapping[str, np.ndarray]) -> None:
        if policy.version is None:
            return
        with self._lock:
            full = self._inflight >= policy.max_inflight
            if not full:
                self._inflight += 1
        if full:
            self.metrics.shadow(policy.version, "skipped", None)
            return
        self._pool.submit(self._call, payload, primary, policy)

    def stop(self) -> None:
        self._pool.shutdown(wait=False)

    def _call(self, payload: Any, primary: Mapping[str, np.ndarray], policy: ShadowPolicy) -> None:
        version = policy.version
        start = self.clock()
        try:
            outputs = self.target.arrays(self.target.call(payload, version, SHADOW_CALL_TIMEOUT_S))
        except Exception as exc:
            self.metrics.shadow(version, "error", self.clock() - start)
            self._log(logging.WARNING, "%s: shadow version %d failed: %s", self.name, version, exc)
            return
        finally:
            with self._lock:
                self._inflight -= 1
        agree, why = outputs_agree(primary, outputs, policy.atol, policy.rtol, policy.ignore_outputs)
        self.metrics.shadow(version, "agree" if agree else "disagree", self.clock() - start)
        if not agree:
            self._log(logging.INFO, "%s: shadow version %d disagrees: %s", self.name, version, why)

    def _log(self, level: int, message: str, *args: Any) -> None:
        """At most one shadow log line per second: the counts are in the metrics."""
        now = self.clock()
        if now - self._logged_at >= 1.0:
            self._logged_at = now
            log.log(level, message, *args)
