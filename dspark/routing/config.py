"""The routing configuration: tiers, fluctuation factor, canary shares and shadow.

It lives in a YAML file next to the router model (``routing.yaml``) so that it can change
while the server runs: the router re-reads the file when its modification time or size
changes, and keeps the last valid configuration if the new file is invalid.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

def router_parameters(params: Mapping[str, str], model_dir: Path) -> tuple[Path, set[int] | None]:
    """The routing file (``routing_file``, relative to the router's model folder) and target
    versions (``target_versions``, e.g. "1,2"; "*" for any version the target serves, as a
    rollout adds new ones) a router model's config parameters name; a version that is not a
    number raises ValueError."""
    routing = Path(params.get("routing_file", "routing.yaml"))
    listed = params.get("target_versions", "1").strip()
    versions = None if listed == "*" else {int(v) for v in listed.split(",") if v.strip()}
    return (routing if routing.is_absolute() else model_dir / routing), versions


class ConfigError(ValueError):
    """An invalid routing configuration; the message names the field."""


@dataclass(frozen=True)
class TierPolicy:
    weight: float
    deadline_ms: float
    max_queue: int = 1000


@dataclass(frozen=True)
class FluctuationPolicy:
    """Parameters of the QPS fluctuation factor f (see docs/router.md)."""

    window_s: float = 10.0
    short_window_s: float = 1.0
    min: float = -0.5
    max: float = 1.0
    min_qps: float = 1.0


@dataclass(frozen=True)
class ShadowPolicy:
    version: int | None = None
    percent: float = 0.0
    atol: float = 0.0
    rtol: float = 0.0
    max_inflight: int = 2
    ignore_outputs: tuple[str, ...] = ()  # outputs left out of the comparison (e.g. a version tag)


@dataclass(frozen=True)
class RoutingConfig:
    tiers: Mapping[str, TierPolicy] = field(
        default_factory=lambda: {
            "diamond": TierPolicy(weight=8, deadline_ms=2000),
            "gold": TierPolicy(weight=3, deadline_ms=3000),
            "standard": TierPolicy(weight=1, deadline_ms=5000),
        }
    )
    default_tier: str = "standard"
    max_inflight: int = 4
    fluctuation: FluctuationPolicy = field(default_factory=FluctuationPolicy)
    shares: Mapping[int, float] = field(default_factory=lambda: {1: 100.0})
    shadow: ShadowPolicy = field(default_factory=ShadowPolicy)
    version: int = 0  # bumped by `dspark route set`; exported as a metric to confirm a reload
    # fast path: when nothing is queued and a slot is free, execute calls the target itself,
    # but only while the target's recent latency (EWMA) is at most this; 0 turns it off
    inline_max_ms: float = 5.0

    def validate(self, allowed_versions: set[int] | None = None) -> "RoutingConfig":
        """Check every field; raise ConfigError naming the first bad one."""
        if not self.tiers:
            raise ConfigError("tiers: at least one tier is required")
        for name, tier in self.tiers.items():
            _positive(f"tiers.{name}.weight", tier.weight)
            _positive(f"tiers.{name}.deadline_ms", tier.deadline_ms)
            _positive(f"tiers.{name}.max_queue", tier.max_queue)
        if self.default_tier not in self.tiers:
            raise ConfigError(
                f"default_tier: '{self.default_tier}' is not one of the tiers ({', '.join(self.tiers)})"
            )
        _positive("max_inflight", self.max_inflight)
        if not isinstance(self.inline_max_ms, (int, float)) or not self.inline_max_ms >= 0:
            raise ConfigError(f"inline_max_ms: must be a number >= 0 (0 turns the fast path off), got {self.inline_max_ms!r}")
        fl = self.fluctuation
        _positive("fluctuation.window_s", fl.window_s)
        _positive("fluctuation.short_window_s", fl.short_window_s)
        if fl.short_window_s > fl.window_s:
            raise ConfigError("fluctuation.short_window_s: must not exceed fluctuation.window_s")
        if not -1.0 < fl.min <= 0.0:
            raise ConfigError(f"fluctuation.min: must be in (-1, 0] so weights stay positive, got {fl.min}")
        if not 0.0 <= fl.max:
            raise ConfigError(f"fluctuation.max: must be >= 0, got {fl.max}")
        _positive("fluctuation.min_qps", fl.min_qps)
        if not self.shares:
            raise ConfigError("shares: at least one version needs a share")
        for version, share in self.shares.items():
            if allowed_versions is not None and version not in allowed_versions:
                raise ConfigError(
                    f"shares: version {version} is not a routable version of the target "
                    f"(allowed: {sorted(allowed_versions)})"
                )
            if not (isinstance(share, (int, float)) and 0.0 <= share <= 100.0):
                raise ConfigError(f"shares.{version}: must be a percentage in [0, 100], got {share!r}")
        total = sum(self.shares.values())
        if not math.isclose(total, 100.0, abs_tol=1e-6):
            raise ConfigError(f"shares: percentages must sum to 100, got {total:g}")
        sh = self.shadow
        if not 0.0 <= sh.percent <= 100.0:
            raise ConfigError(f"shadow.percent: must be in [0, 100], got {sh.percent}")
        if sh.percent > 0 and sh.version is None:
            raise ConfigError("shadow.version: required when shadow.percent > 0")
        if sh.version is not None and allowed_versions is not None and sh.version not in allowed_versions:
            raise ConfigError(
                f"shadow.version: version {sh.version} is not a routable version of the target "
                f"(allowed: {sorted(allowed_versions)})"
            )
        if sh.atol < 0 or sh.rtol < 0:
            raise ConfigError("shadow.atol/shadow.rtol: tolerances must be >= 0")
        _positive("shadow.max_inflight", sh.max_inflight)
        return self

    # --- file format -------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "RoutingConfig":
        data = dict(data or {})
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"{sorted(unknown)[0]}: unknown field (known: {', '.join(sorted(known))})")
        kwargs: dict[str, Any] = {}
        if "tiers" in data:
            tiers = _mapping("tiers", data["tiers"])
            kwargs["tiers"] = {
                str(name): _build(TierPolicy, f"tiers.{name}", spec) for name, spec in tiers.items()
            }
        for key, kind in (("default_tier", str), ("max_inflight", int), ("version", int), ("inline_max_ms", float)):
            if key in data:
                kwargs[key] = _typed(key, data[key], kind)
        if "fluctuation" in data:
            kwargs["fluctuation"] = _build(FluctuationPolicy, "fluctuation", data["fluctuation"])
        if "shares" in data:
            shares = _mapping("shares", data["shares"])
            kwargs["shares"] = {
                _typed("shares (version key)", k, int): _typed(f"shares.{k}", v, float) for k, v in shares.items()
            }
        if "shadow" in data:
            kwargs["shadow"] = _build(ShadowPolicy, "shadow", data["shadow"])
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["shares"] = {int(v): float(s) for v, s in self.shares.items()}
        out["shadow"]["ignore_outputs"] = list(self.shadow.ignore_outputs)
        return out

    @classmethod
    def load(cls, path: Path, allowed_versions: set[int] | None = None) -> "RoutingConfig":
        try:
            data = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        try:
            return cls.from_dict(data).validate(allowed_versions)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    def save(self, path: Path) -> None:
        """Write atomically (temp file + rename) so a reader never sees half a file."""
        path = Path(path)
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        fd, tmp = tempfile.mkstemp(prefix=".routing-", suffix=".yaml", dir=path.parent)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)


class ConfigWatcher:
    """Re-reads a routing file when it changes; keeps the last good config on errors."""

    def __init__(self, path: Path, allowed_versions: set[int] | None = None):
        self.path = Path(path)
        self.allowed_versions = allowed_versions
        self._stamp: tuple[int, int] | None = None
        self.config = RoutingConfig().validate(None) if not self.path.exists() else self._read()
        self.last_error: str | None = None

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def _read(self) -> RoutingConfig:
        self._stamp = self._file_stamp()
        return RoutingConfig.load(self.path, self.allowed_versions)

    def poll(self) -> RoutingConfig | None:
        """Return the new config if the file changed and is valid, else None.

        An invalid new file leaves the current config in place and sets ``last_error``.
        """
        stamp = self._file_stamp()
        if stamp is None or stamp == self._stamp:
            return None
        try:
            new = self._read()
        except (ConfigError, OSError) as exc:
            self.last_error = str(exc)
            return None
        self.last_error = None
        self.config = new
        return new


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"{name}: must be a positive number, got {value!r}")


def _mapping(name: str, value: Any) -> Mapping:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name}: must be a mapping, got {type(value).__name__}")
    return value


def _typed(name: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool) and kind is not str:
        raise ConfigError(f"{name}: must be a {kind.__name__}, got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: must be a {kind.__name__}, got {value!r}") from None


def _build(cls: type, name: str, spec: Any) -> Any:
    spec = _mapping(name, spec)
    fields = cls.__dataclass_fields__
    kwargs = {}
    for key, value in spec.items():
        if key not in fields:
            raise ConfigError(f"{name}.{key}: unknown field (known: {', '.join(fields)})")
        kind = {"int": int, "float": float, "int | None": int}.get(str(fields[key].type), float)
        if str(fields[key].type).startswith("tuple[str"):
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{name}.{key}: must be a list of names, got {value!r}")
            kwargs[key] = tuple(value)
        else:
            kwargs[key] = None if value is None else _typed(f"{name}.{key}", value, kind)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{name}: {exc}") from None
