"""The prefix cache's parameter and its series on /metrics, without Triton (a recording stand-in
for ``pb_utils.MetricFamily``)."""
from __future__ import annotations

import pytest

from dspark.decoding.prefix_cache import PrefixCacheStats
from dspark.decoding.stats import DecodeStats
from dspark.errors import ConfigError
from dspark.params import parse_parameters
from dspark.triton.metrics import SpeculativeMetrics
from dspark.triton.params import SpeculativeParameters


class Metric:
    def __init__(self):
        self.value = 0.0

    def increment(self, n):
        self.value += n

    def set(self, value):
        self.value = value


class MetricFamily:
    COUNTER, GAUGE = "counter", "gauge"
    made: dict = {}

    def __init__(self, name, kind, description):
        self.name = name

    def Metric(self, labels):  # noqa: N802 - pb_utils' name
        metric = MetricFamily.made[self.name] = Metric()
        return metric


class PbUtils:
    MetricFamily = MetricFamily


def test_prefix_cache_counts_reach_metrics_as_increments_and_bytes_as_a_gauge():
    metrics = SpeculativeMetrics(PbUtils, "m", "1")
    made = MetricFamily.made
    metrics.record(DecodeStats(), 1.0, 1, PrefixCacheStats(hits=0, misses=1, bytes_held=1000, blocks=1))
    metrics.record(DecodeStats(), 1.0, 2, PrefixCacheStats(hits=2, misses=1, rows_reused=128, evictions=1,
                                                           bytes_held=700, blocks=1))
    # a request that took its counts earlier but ends later reports nothing twice
    metrics.record(DecodeStats(), 1.0, 2, PrefixCacheStats(hits=1, misses=1, rows_reused=64, bytes_held=700))
    assert made["dspark_speculative_prefix_cache_hits_total"].value == 2
    assert made["dspark_speculative_prefix_cache_misses_total"].value == 1
    assert made["dspark_speculative_prefix_cache_rows_reused_total"].value == 128
    assert made["dspark_speculative_prefix_cache_evictions_total"].value == 1
    assert made["dspark_speculative_prefix_cache_bytes"].value == 700


def test_prefix_cache_budget_parameter():
    assert parse_parameters(SpeculativeParameters, {"llm_model": "m"}).prefix_cache_mb == 256
    assert parse_parameters(SpeculativeParameters, {"llm_model": "m", "prefix_cache_mb": "0"}).prefix_cache_mb == 0
    with pytest.raises(ConfigError) as info:
        parse_parameters(SpeculativeParameters, {"llm_model": "m", "prefix_cache_mb": "-1"})
    assert info.value.field == "parameter 'prefix_cache_mb'"
