"""A rollout plan: the steps a new version goes through and the thresholds that stop it.

Plans are YAML, parsed by pydantic; a bad field raises ``ConfigError`` naming it
(``steps[2].canary: ...``). The built-in default (``DEFAULT_PLAN``) is a shadow phase, canary
steps 5 -> 25 -> 50 -> 100 %, then promotion; see docs/rollout.md.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, Union

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from dspark.errors import ConfigError, from_validation_error


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Step(_Strict):
    """One step: send ``canary`` % of the traffic to the new version, or copy ``shadow`` % of it
    there (clients still get the current version's answer). The step lasts ``hold_s`` seconds
    and/or until the new version has served ``requests`` requests, whichever comes last."""

    canary: Optional[float] = Field(default=None, gt=0, le=100)
    shadow: Optional[float] = Field(default=None, gt=0, le=100)
    hold_s: Optional[float] = Field(default=None, ge=0)
    requests: Optional[int] = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _one_kind(self) -> "Step":
        if (self.canary is None) == (self.shadow is None):
            raise ValueError("give exactly one of canary (percent of traffic) or shadow (percent copied)")
        if self.hold_s is None and self.requests is None:
            raise ValueError("give hold_s (seconds) and/or requests (count) to say how long the step lasts")
        return self

    @property
    def kind(self) -> str:
        return "canary" if self.canary is not None else "shadow"

    @property
    def percent(self) -> float:
        return self.canary if self.canary is not None else self.shadow

    def describe(self) -> str:
        hold = " and ".join(p for p in (f"{self.hold_s:g} s" if self.hold_s is not None else "",
                                        f"{self.requests} requests" if self.requests else "") if p)
        return f"{self.kind} {self.percent:g}% for {hold}"


class Accuracy(_Strict):
    """A labelled set (``.npz`` with one array per model input plus ``labels``) sent to the new
    version once it is loaded; the arg-max of ``output`` must match ``labels`` at least ``min``
    of the time."""

    dataset: Path
    output: str
    min: float = Field(ge=0, le=1)


class Analysis(_Strict):
    """Checks run every ``interval_s`` on the metrics of that interval; one breach rolls back."""

    interval_s: float = Field(default=5.0, gt=0)
    # fewer requests than this to the new version in an interval: no verdict on rates and latency
    min_requests: int = Field(default=20, ge=1)
    max_error_rate: float = Field(default=0.01, ge=0, le=1)
    # new / current; "mean" from Triton's per-version counters, "p99" from the router's histograms
    latency: Literal["mean", "p99"] = "mean"
    max_latency_ratio: float = Field(default=1.5, gt=1)
    # latency is judged on the step so far once it spans this many intervals (one interval's
    # latency is noisy on a busy host; errors and disagreement count at once)
    latency_intervals: int = Field(default=2, ge=1)
    # below this (ms) on the new version, latency is not judged (noise of a sub-millisecond model)
    latency_floor_ms: float = Field(default=1.0, ge=0)
    max_disagreement: float = Field(default=0.05, ge=0, le=1)
    accuracy: Optional[Accuracy] = None
    breaches_to_rollback: int = Field(default=1, ge=1)


class Warmup(_Strict):
    """Requests sent straight to the new version before any traffic; one failure rolls back.

    ``instance_requests``: inferences Triton runs on every new instance (``model_warmup`` in
    config.pbtxt, zeros shaped from the inputs) before the version it belongs to is ready. Triton
    reloads *every* version of a model on a load, and swaps each in once all its instances are
    ready: without this, the reloaded current version takes all traffic on fresh stubs whose first
    calls are slow (measured 100-240 ms each). 0 leaves config.pbtxt as the model spec says; a
    spec whose extra_config has its own model_warmup keeps it."""

    requests: int = Field(default=5, ge=0)
    instance_requests: int = Field(default=2, ge=0)


class Plan(_Strict):
    steps: list[Step] = Field(min_length=1)
    analysis: Analysis = Analysis()
    warmup: Warmup = Warmup()
    load_timeout_s: float = Field(default=120.0, gt=0)
    # servers that load at once; a load starts new stubs for every version of the model, and the
    # next servers start only when these are ready (1: servers that share a host never compete)
    parallel_loads: int = Field(default=1, ge=1)
    # after promotion: the old version is unloaded once no request to it is in flight (or at this limit)
    drain_timeout_s: float = Field(default=30.0, gt=0)

    @classmethod
    def from_dict(cls, data: Union[dict, None], path: Optional[Path] = None) -> "Plan":
        try:
            return cls.model_validate(data or {})
        except pydantic.ValidationError as error:
            raise from_validation_error(error, ConfigError, path=path) from None

    @classmethod
    def load(cls, path: Union[str, Path, None]) -> "Plan":
        """The plan in ``path``, or the built-in default when ``path`` is None."""
        if path is None:
            return DEFAULT_PLAN
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            raise ConfigError("", "plan file does not exist", path) from None
        except yaml.YAMLError as error:
            raise ConfigError("", f"not valid YAML: {error}", path) from None
        if data is not None and not isinstance(data, dict):
            raise ConfigError("", "a plan is a mapping with steps, analysis, warmup", path)
        return cls.from_dict(data, path)

    def to_dict(self) -> dict:
        return self.model_dump(mode="json", exclude_none=True)


DEFAULT_PLAN = Plan(steps=[
    Step(shadow=20, hold_s=30),
    Step(canary=5, hold_s=30),
    Step(canary=25, hold_s=30),
    Step(canary=50, hold_s=30),
    Step(canary=100, hold_s=30),
])
