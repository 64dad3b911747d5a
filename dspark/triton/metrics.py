"""The backends' metrics on Triton's /metrics (``pb_utils.MetricFamily``; the ``pb_utils``
module is passed in, so this module imports no Triton code). Families must outlive their
metrics, so both are kept."""
from __future__ import annotations

import os
import threading
from typing import Any, Optional

from dspark.decoding.prefix_cache import PrefixCacheStats
from dspark.decoding.stats import DecodeStats

_COUNTER, _GAUGE = "counter", "gauge"
SPECULATIVE_METRICS = {  # name: (kind, description)
    "proposed": (_COUNTER, "Draft tokens proposed (tree: deepest path per target pass)"),
    "accepted": (_COUNTER, "Draft tokens accepted by the target"),
    "generated": (_COUNTER, "Tokens generated"),
    "target_passes": (_COUNTER, "Target model passes after the prompt, per request"),
    "target_calls": (_COUNTER, "Target model calls of the round loops (one call verifies "
                               "the passes of every request batched into it)"),
    "mean_accepted_length": (_GAUGE, "Tokens per target pass, last request"),
    "tokens_per_second": (_GAUGE, "Generated tokens per second, last request"),
    "requests_running": (_GAUGE, "Requests generating now"),
    "prefix_cache_hits": (_COUNTER, "Requests whose prompt started with rows the prefix cache held"),
    "prefix_cache_misses": (_COUNTER, "Requests whose prompt's first block the prefix cache did not hold"),
    "prefix_cache_rows_reused": (_COUNTER, "Prompt rows copied from the prefix cache instead of computed"),
    "prefix_cache_evictions": (_COUNTER, "Blocks of rows the prefix cache dropped to stay within its budget"),
    "prefix_cache_bytes": (_GAUGE, "Bytes of KV rows the prefix cache holds"),
}
PREFIX_COUNTS = ("hits", "misses", "rows_reused", "evictions")  # PrefixCacheStats' counters


class SpeculativeMetrics:
    """``dspark_speculative_*`` series of one model version. Triton shares a Metric between stubs
    with equal labels, and the first stub to release it frees it for all
    (triton-inference-server/server#8663): a reload's new stub starts before the old one ends,
    so each stub's series carries its own pid. Metric calls go to the server one at a time."""

    def __init__(self, pb_utils: Any, model: str, version: str):
        labels = {"model": model, "version": version, "pid": str(os.getpid())}
        kinds = {_COUNTER: pb_utils.MetricFamily.COUNTER, _GAUGE: pb_utils.MetricFamily.GAUGE}
        self.families, self.metrics = [], {}  # families must outlive their metrics
        for key, (kind, description) in SPECULATIVE_METRICS.items():
            suffix = "_total" if kind == _COUNTER else ""
            family = pb_utils.MetricFamily(name=f"dspark_speculative_{key}{suffix}", kind=kinds[kind],
                                           description=description)
            self.families.append(family)
            self.metrics[key] = family.Metric(labels=labels)
        self._lock = threading.Lock()
        self._running = 0
        self._calls_reported = 0
        self._prefix_reported = dict.fromkeys(PREFIX_COUNTS, 0)

    def running(self, change: int) -> None:
        with self._lock:
            self._running += change
            self.metrics["requests_running"].set(self._running)

    def count_generated(self, stats: DecodeStats) -> None:
        """The tokens generated since the last count (live while streaming, so a cancelled
        request is seen to stop)."""
        with self._lock:
            new = stats.generated_tokens - stats.reported
            if new > 0:
                stats.reported += new
                self.metrics["generated"].increment(new)

    def record(self, stats: DecodeStats, seconds: float, target_calls: int,
               prefix: Optional[PrefixCacheStats] = None) -> None:
        """A finished request (``target_calls``: the engine's count so far; ``prefix``: its
        prefix cache's counts so far, when it has one)."""
        self.count_generated(stats)
        with self._lock:
            if prefix is not None:
                for key in PREFIX_COUNTS:  # counts taken by requests ending together may come out of order
                    value = getattr(prefix, key)
                    if value > self._prefix_reported[key]:
                        self.metrics[f"prefix_cache_{key}"].increment(value - self._prefix_reported[key])
                        self._prefix_reported[key] = value
                self.metrics["prefix_cache_bytes"].set(prefix.bytes_held)
            self.metrics["proposed"].increment(stats.proposed)
            self.metrics["accepted"].increment(stats.accepted)
            self.metrics["target_passes"].increment(stats.rounds)
            # requests finishing together may report their engine counts out of order
            if target_calls > self._calls_reported:
                self.metrics["target_calls"].increment(target_calls - self._calls_reported)
                self._calls_reported = target_calls
            self.metrics["mean_accepted_length"].set(stats.mean_accepted_length)
            if seconds > 0:
                self.metrics["tokens_per_second"].set(stats.generated_tokens / seconds)

    def close(self) -> None:
        self.metrics.clear()
        self.families.clear()


class OnnxMetrics:
    """``dspark_onnx_*`` of one model version, and the execution provider it runs on and why (a
    gauge set to 1), with one count per preferred provider skipped at load."""

    def __init__(self, pb_utils: Any, model: str, version: str, choice: Any):
        labels = {"model": model, "version": version}
        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        batches = pb_utils.MetricFamily(name="dspark_onnx_batches_total", kind=counter,
                                        description="ONNX Runtime runs (one per batch of requests)")
        rows = pb_utils.MetricFamily(name="dspark_onnx_batch_rows_total", kind=counter,
                                     description="Rows run through ONNX Runtime; divided by runs it is the mean batch")
        chosen = pb_utils.MetricFamily(
            name="dspark_execution_provider", kind=gauge,
            description="1 for the execution provider a model runs on; reason: first_preference or fallback")
        fallback = pb_utils.MetricFamily(
            name="dspark_execution_provider_fallback_total", kind=counter,
            description="Preferred execution providers skipped at load because they are not usable here")
        self.families = [batches, rows, chosen, fallback]
        self.batches, self.rows = batches.Metric(labels=labels), rows.Metric(labels=labels)
        reason = "fallback" if choice.fell_back else "first_preference"
        self.providers = [chosen.Metric(labels={**labels, "provider": choice.chosen, "reason": reason})]
        self.providers[0].set(1)
        for skipped in choice.skipped:
            metric = fallback.Metric(labels={**labels, "requested": skipped, "chosen": choice.chosen})
            metric.increment(1)
            self.providers.append(metric)

    def batch(self, rows: int) -> None:
        """One ONNX Runtime run over ``rows`` rows."""
        self.batches.increment(1)
        self.rows.increment(rows)
