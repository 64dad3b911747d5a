"""Judge the new version against the current one from the metrics of one analysis interval.

Sources (labels ``model``, ``version``; summed over servers):
- error rate: failures / requests of the target's new version. Requests: Triton's
  ``nv_inference_request_success`` + ``_failure`` (canary and shadow calls alike). Failures: the
  larger of Triton's ``nv_inference_request_failure`` and what the router saw
  (``dspark_router_target_errors`` + ``dspark_router_shadow{outcome="error"}``): Triton counts
  an error *response* of a Python-based model (all of dspark's backends) as a success.
- latency: ``mean`` = Δ``nv_inference_compute_infer_duration_us`` / Δ``nv_inference_request_success``
  per version: Triton's own timing of the model's execution, without the queue in front of it
  (which depends on the share of traffic each version gets, not on the version); ``p99`` = the router's
  ``dspark_router_latency_seconds`` histogram per version (canary steps; a shadow step has no
  primary traffic on the new version and is judged on the mean).
- disagreement: the router's ``dspark_router_shadow_total`` outcomes for the new version; the
  ``skipped`` ones (sampled, but ``shadow.max_inflight`` calls were in flight) are counted and shown.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from dspark.rollout.metrics import Snapshot, delta, histogram_quantile
from dspark.rollout.plan import Analysis


@dataclass
class VersionStats:
    version: int
    requests: float = 0.0
    failures: float = 0.0
    mean_ms: Optional[float] = None
    p99_ms: Optional[float] = None

    @property
    def error_rate(self) -> Optional[float]:
        return self.failures / self.requests if self.requests else None


@dataclass
class Verdict:
    """The outcome of one interval: ``breach`` is the reason to roll back, or None."""

    current: VersionStats
    new: VersionStats
    shadow_agree: float = 0.0
    shadow_disagree: float = 0.0
    shadow_error: float = 0.0
    shadow_skipped: float = 0.0
    reasons: dict[str, str] = field(default_factory=dict)  # check (errors, latency, disagreement, ...) -> why
    notes: list[str] = field(default_factory=list)

    @property
    def breach(self) -> Optional[str]:
        """Why to roll back, or None."""
        return "; ".join(self.reasons.values()) or None

    @property
    def disagreement(self) -> Optional[float]:
        compared = self.shadow_agree + self.shadow_disagree
        return self.shadow_disagree / compared if compared else None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["new"]["error_rate"] = self.new.error_rate
        out["current"]["error_rate"] = self.current.error_rate
        out["disagreement"] = self.disagreement
        out["breach"] = self.breach
        return out

    def summary(self) -> str:
        def fmt(stats: VersionStats) -> str:
            rate = "-" if stats.error_rate is None else f"{100 * stats.error_rate:.1f}%"
            mean = "-" if stats.mean_ms is None else f"{stats.mean_ms:.1f}ms"
            p99 = "" if stats.p99_ms is None else f" p99 {stats.p99_ms:.1f}ms"
            return f"v{stats.version}: {stats.requests:.0f} req, err {rate}, mean {mean}{p99}"
        text = f"{fmt(self.new)} | {fmt(self.current)}"
        if self.disagreement is not None:
            text += f" | shadow disagree {100 * self.disagreement:.1f}%"
        return text

    @property
    def shadow_copied(self) -> float:
        """Sampled requests copied to the new version (answered or failed there)."""
        return self.shadow_agree + self.shadow_disagree + self.shadow_error


def version_stats(before: Optional[Snapshot], after: Snapshot, model: str, version: int,
                  router: Optional[str], with_p99: bool) -> VersionStats:
    labels = {"model": model, "version": str(version)}
    success = delta(after, before, "nv_inference_request_success", **labels)
    failures = delta(after, before, "nv_inference_request_failure", **labels)
    duration_us = delta(after, before, "nv_inference_compute_infer_duration_us", **labels)
    requests = success + failures
    if router:  # errors the router saw; hidden among Triton's successes when Triton counted no failure
        seen = (delta(after, before, "dspark_router_target_errors", model=router, version=str(version))
                + delta(after, before, "dspark_router_shadow", model=router, version=str(version), outcome="error"))
        failures = min(max(failures, seen), requests)
    stats = VersionStats(version, requests, failures, duration_us / success / 1000 if success else None)
    if with_p99 and router:
        p99 = histogram_quantile(0.99, after, before, "dspark_router_latency_seconds",
                                 model=router, version=str(version))
        stats.p99_ms = None if p99 is None else 1000 * p99
    return stats


def judge(before: Optional[Snapshot], after: Snapshot, *, model: str, router: Optional[str],
          current: int, new: int, phase: str, rules: Analysis) -> Verdict:
    """Compare version ``new`` with ``current`` over the interval between two snapshots."""
    with_p99 = rules.latency == "p99" and phase == "canary"
    verdict = Verdict(version_stats(before, after, model, current, router, with_p99),
                      version_stats(before, after, model, new, router, with_p99))
    if router:
        for outcome in ("agree", "disagree", "error", "skipped"):
            setattr(verdict, f"shadow_{outcome}",
                    delta(after, before, "dspark_router_shadow", model=router, version=str(new), outcome=outcome))
    reasons = verdict.reasons
    fresh, old = verdict.new, verdict.current
    if fresh.requests >= rules.min_requests:
        rate = fresh.error_rate
        if rate > rules.max_error_rate:
            reasons["errors"] = (f"error rate {100 * rate:.1f}% on version {new} ({fresh.failures:.0f} of "
                                 f"{fresh.requests:.0f} requests) > {100 * rules.max_error_rate:g}%")
        key = "p99_ms" if with_p99 else "mean_ms"
        ours, theirs = getattr(fresh, key), getattr(old, key)
        if ours is not None and theirs and ours >= rules.latency_floor_ms:
            ratio = ours / theirs
            if ratio > rules.max_latency_ratio:
                label = "p99" if with_p99 else "mean"
                reasons["latency"] = (f"{label} latency {ours:.1f} ms on version {new} vs {theirs:.1f} ms "
                                      f"on version {current} ({ratio:.2f}x > {rules.max_latency_ratio:g}x)")
    else:
        verdict.notes.append(f"{fresh.requests:.0f} requests to version {new} (< min_requests {rules.min_requests}): "
                             "rates and latency not judged")
    if verdict.shadow_skipped:
        sampled = verdict.shadow_copied + verdict.shadow_skipped
        verdict.notes.append(f"{verdict.shadow_skipped:.0f} of {sampled:.0f} sampled requests not copied to version "
                             f"{new} ({100 * verdict.shadow_skipped / sampled:.0f}%): shadow.max_inflight calls were "
                             "in flight")
    compared = verdict.shadow_agree + verdict.shadow_disagree
    if compared >= rules.min_requests and verdict.disagreement > rules.max_disagreement:
        reasons["disagreement"] = (f"shadow disagreement {100 * verdict.disagreement:.1f}% on version {new} "
                                   f"({verdict.shadow_disagree:.0f} of {compared:.0f}) > {100 * rules.max_disagreement:g}%")
    return verdict
