"""Metrics the analysis reads: Triton's /metrics of each server, or a Prometheus that scrapes them.

Both give the same thing, a ``Snapshot`` of samples (name, labels, value) with an ``instance``
label naming the server, and counters named without a ``_total`` suffix. The analysis compares two snapshots: counters become deltas (a counter
that went down was reset by a reload and counts from zero), histograms become quantiles of
their bucket deltas. The text format is parsed with ``prometheus_client``'s parser.
"""
from __future__ import annotations

import json
import math
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

from prometheus_client.parser import text_string_to_metric_families

from dspark.errors import UnavailableError

# the families the analysis reads; everything else on /metrics is skipped
PREFIXES = ("nv_inference_", "dspark_router_")
Labels = tuple[tuple[str, str], ...]


@dataclass
class Snapshot:
    """Samples at one moment: {(name, labels): value}; labels include ``instance``."""

    taken_at: float
    values: dict[tuple[str, Labels], float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # instance -> why it could not be read

    def add(self, name: str, labels: Mapping[str, str], value: float) -> None:
        # one spelling for counters whichever source: Triton's nv_inference_request_success is
        # nv_inference_request_success_total once prometheus_client has parsed it
        name = name.removesuffix("_total")
        key = (name, tuple(sorted(labels.items())))
        self.values[key] = self.values.get(key, 0.0) + value

    def select(self, name: str, **match: str) -> Iterable[tuple[dict[str, str], float]]:
        for (sample_name, labels), value in self.values.items():
            if sample_name != name:
                continue
            as_dict = dict(labels)
            if all(as_dict.get(k) == v for k, v in match.items()):
                yield as_dict, value

    def total(self, name: str, **match: str) -> float:
        return sum(value for _, value in self.select(name, **match))


def parse_text(text: str, instance: str, snapshot: Snapshot, families: tuple[str, ...] = PREFIXES,
               versions: Optional[Iterable[int]] = None) -> None:
    """Add the samples of one /metrics text (Prometheus exposition format) whose family name
    starts with one of ``families`` (and, given ``versions``, whose version label is one of them
    or absent) to ``snapshot``. The other lines are dropped before parsing: prometheus_client's
    parser takes ~0.3 ms per KB, and a server's text grows with its models and with every
    version its routers have served."""
    comments = tuple(f"# {kind} {name}" for kind in ("HELP", "TYPE") for name in families)
    marks = None if versions is None else tuple(f'version="{v}"' for v in versions)
    wanted = "\n".join(line for line in text.splitlines()
                       if line.startswith(comments) or (line.startswith(families) and (
                           marks is None or 'version="' not in line or any(m in line for m in marks))))
    for family in text_string_to_metric_families(wanted + "\n"):
        for sample in family.samples:
            snapshot.add(sample.name, {**sample.labels, "instance": instance}, sample.value)


class ScrapeSource:
    """Reads each server's /metrics directly (``instance`` = the metrics URL)."""

    def __init__(self, urls: Sequence[str], timeout_s: float = 5.0):
        self.urls = list(urls)
        self.timeout_s = timeout_s

    def snapshot(self, families: tuple[str, ...] = PREFIXES, versions: Optional[Iterable[int]] = None) -> Snapshot:
        """The samples of ``families`` (name prefixes) on every server, of ``versions`` only
        where a sample has a version label."""
        snapshot = Snapshot(time.monotonic())
        for url in self.urls:
            try:
                with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                    parse_text(response.read().decode(), url, snapshot, families, versions)
            except OSError as error:
                snapshot.errors[url] = str(error)
        return snapshot

    def describe(self) -> str:
        return f"/metrics of {len(self.urls)} server(s)"


class PrometheusSource:
    """Reads the same families from a Prometheus server's HTTP API (instant queries), so the
    analysis sees what the fleet's Prometheus scraped (``instance`` = its scrape target)."""

    QUERY = '{__name__=~"%s"}' % "|".join(f"{p}.*" for p in PREFIXES)

    def __init__(self, base_url: str, timeout_s: float = 5.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def snapshot(self, versions: Optional[Iterable[int]] = None) -> Snapshot:
        """The PREFIXES families (``versions``: a ScrapeSource's filter, not needed here: the
        parsing that it saves is Prometheus' own)."""
        snapshot = Snapshot(time.monotonic())
        url = f"{self.base_url}/api/v1/query?" + urllib.parse.urlencode({"query": self.QUERY})
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                body = json.loads(response.read().decode())
        except (OSError, ValueError) as error:
            snapshot.errors[self.base_url] = str(error)
            return snapshot
        if body.get("status") != "success":
            snapshot.errors[self.base_url] = body.get("error", "query failed")
            return snapshot
        for series in body["data"]["result"]:
            labels = dict(series["metric"])
            name = labels.pop("__name__")
            labels.pop("job", None)
            snapshot.add(name, labels, float(series["value"][1]))
        return snapshot

    def describe(self) -> str:
        return f"Prometheus at {self.base_url}"


def delta(after: Snapshot, before: Optional[Snapshot], name: str, **match: str) -> float:
    """How much the counters ``name`` matching ``match`` grew between two snapshots, summed
    over series; a series that shrank was reset (model reloaded) and counts from zero."""
    total = 0.0
    for (sample_name, labels), value in after.values.items():
        if sample_name != name or any(dict(labels).get(k) != v for k, v in match.items()):
            continue
        previous = before.values.get((sample_name, labels)) if before is not None else None
        total += value if previous is None or value < previous else value - previous
    return total


def histogram_quantile(q: float, after: Snapshot, before: Optional[Snapshot], name: str,
                       **match: str) -> Optional[float]:
    """The q-quantile of the observations of histogram ``name`` between two snapshots (buckets
    summed over the other labels, linear inside a bucket, as Prometheus' histogram_quantile)."""
    buckets: dict[float, float] = {}
    for labels, _ in after.select(f"{name}_bucket", **match):
        bound = float(labels["le"])
        if bound in buckets:
            continue
        buckets[bound] = delta(after, before, f"{name}_bucket", **match, le=labels["le"])
    if not buckets:
        return None
    bounds = sorted(buckets)
    count = buckets[bounds[-1]]
    if count <= 0:
        return None
    rank = q * count
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        if buckets[bound] >= rank:
            if math.isinf(bound):
                return lower_bound
            inside = buckets[bound] - lower_count
            fraction = (rank - lower_count) / inside if inside > 0 else 1.0
            return lower_bound + (bound - lower_bound) * fraction
        lower_bound, lower_count = bound, buckets[bound]
    return bounds[-1]


def read(source, versions: Optional[Iterable[int]] = None) -> Snapshot:
    """A snapshot from ``source`` (of ``versions`` only, where a series has a version); none of
    its servers readable is an error (some is not)."""
    snapshot = source.snapshot(versions=versions)
    if snapshot.errors and not snapshot.values:
        raise UnavailableError(f"metrics: none readable from {source.describe()}: "
                               + "; ".join(f"{k}: {v}" for k, v in snapshot.errors.items()), "metrics")
    return snapshot
