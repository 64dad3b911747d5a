"""The routing configuration: tiers, concurrency, fluctuation factor, canary shares and shadow.

It lives in a YAML file next to the router model (``routing.yaml``) so that it can change
while the server runs: the router re-reads the file when its modification time or size
changes, and keeps the last valid configuration if the new file is invalid (any file: empty or
only comments, over 64 KiB, not UTF-8, not YAML, a list or a scalar, keys of mixed types, a bad
value). A missing file means the defaults.

Parsing is pydantic's: the dataclasses below carry their constraints as type annotations and
``parse_routing`` validates a mapping against them, so every error names its field path
(``tiers.gold.weight: Input should be greater than 0 (got 0)``) as a ``dspark.errors.ConfigError``.

Stable function API (``dspark route`` and the rollout controller use it; keep it):

- ``load_routing(path, allowed_versions=None) -> RoutingConfig``: read and validate a file.
- ``save_routing(config, path)``: validate and write atomically (a reader never sees half a file).
- ``update_routing(path, allowed_versions=None, **changes) -> RoutingConfig``: load (or start
  from the defaults), replace fields (``shares={1: 90, 2: 10}``, ``shadow=ShadowPolicy(...)``),
  bump ``version``, validate, save; returns the new config. The running router applies it
  within about half a second and reports ``dspark_router_config_version``.
- ``RoutingConfig`` with ``shares`` (percent per target version, summing to 100) and ``shadow``
  (``ShadowPolicy``), ``dataclasses.replace`` to change fields, ``.validate(versions)``.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Optional, Union

import yaml
from pydantic import ConfigDict, Field, PlainValidator, Strict, TypeAdapter, ValidationError

from dspark.errors import ConfigError, field_path, from_validation_error

# Upper bounds: a finite but huge value would overflow a timestamp (a target call's timeout in
# microseconds, a condition wait), turn the round-robin's credits into inf - inf = NaN, or start
# a thread per slot.
MAX_MS = 86_400_000.0  # one day, for every duration in milliseconds
MAX_S = 86_400.0
MAX_WEIGHT = 1_000_000.0
MAX_FACTOR = 100.0  # fluctuation.max: base x (1 + f) stays finite for any weight
MAX_INFLIGHT = 256  # lane threads: up to 2 x max_inflight + headroom of them
MAX_ROUTING_BYTES = 64 * 1024
# the config version is exported as a gauge (a double), which rollouts compare to confirm a step:
# above 2**53 - 1 neighbouring versions round to one value, and a huge one fails the update
MAX_CONFIG_VERSION = 2**53 - 1

# YAML gives numbers their own types: strict types keep `2.7` from becoming 2 and `true` from 1.0
Positive = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]
NonNegative = Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)]
Weight = Annotated[float, Strict(), Field(gt=0, le=MAX_WEIGHT, allow_inf_nan=False)]
Milliseconds = Annotated[float, Strict(), Field(gt=0, le=MAX_MS, allow_inf_nan=False)]
NonNegativeMs = Annotated[float, Strict(), Field(ge=0, le=MAX_MS, allow_inf_nan=False)]
Seconds = Annotated[float, Strict(), Field(gt=0, le=MAX_S, allow_inf_nan=False)]
Percent = Annotated[float, Strict(), Field(ge=0, le=100, allow_inf_nan=False)]
Count = Annotated[int, Strict(), Field(gt=0)]
SlotCount = Annotated[int, Strict(), Field(ge=0, le=MAX_INFLIGHT)]
_FIELDS = ConfigDict(extra="forbid")


def _auto_or_count(value: Any) -> Union[str, int]:
    if value == "auto" or (type(value) is int and 0 < value <= MAX_INFLIGHT):
        return value
    raise ValueError(f"must be 'auto' (the target's instance count) or a whole number from 1 to {MAX_INFLIGHT}")


MaxInflight = Annotated[Union[Literal["auto"], int], PlainValidator(_auto_or_count)]


@dataclass(frozen=True)
class TierPolicy:
    __pydantic_config__ = _FIELDS
    weight: Weight
    deadline_ms: Milliseconds  # the longest a request waits in the router's queue
    max_queue: Count = 1000
    # the longest a target call may take before the client gets UNAVAILABLE (default deadline_ms)
    timeout_ms: Optional[Milliseconds] = None

    @property
    def call_timeout_s(self) -> float:
        return (self.timeout_ms if self.timeout_ms is not None else self.deadline_ms) / 1000.0


@dataclass(frozen=True)
class FluctuationPolicy:
    """Parameters of the QPS fluctuation factor f (see docs/router.md)."""

    __pydantic_config__ = _FIELDS
    window_s: Seconds = 10.0
    short_window_s: Seconds = 1.0
    min: Annotated[float, Strict(), Field(gt=-1, le=0)] = -0.5  # > -1 so weights stay positive
    max: Annotated[float, Strict(), Field(ge=0, le=MAX_FACTOR, allow_inf_nan=False)] = 1.0
    min_qps: Positive = 1.0


@dataclass(frozen=True)
class ShadowPolicy:
    __pydantic_config__ = _FIELDS
    version: Optional[Annotated[int, Strict()]] = None
    percent: Percent = 0.0
    # floating-point outputs agree within |shadow - primary| <= atol + rtol * |primary|: the
    # rounding of a different kernel or summation order agrees, a changed result does not
    atol: NonNegative = 1e-5
    rtol: NonNegative = 1e-5
    max_inflight: Count = 2  # shadow calls in flight; a sampled request beyond that is skipped (counted)
    ignore_outputs: tuple[str, ...] = ()  # outputs left out of the comparison (e.g. a version tag)


def _default_tiers() -> dict[str, TierPolicy]:
    return {
        "diamond": TierPolicy(weight=8, deadline_ms=2000),
        "gold": TierPolicy(weight=3, deadline_ms=3000),
        "standard": TierPolicy(weight=1, deadline_ms=5000),
    }


@dataclass(frozen=True)
class RoutingConfig:
    __pydantic_config__ = _FIELDS
    tiers: dict[str, TierPolicy] = field(default_factory=_default_tiers)
    default_tier: str = "standard"
    # target calls in flight for every tier: "auto" = the target's instance count (its
    # config.pbtxt), so no instance waits for work while the router holds the queue
    max_inflight: MaxInflight = "auto"
    # further calls in flight that only the top tier (highest weight) may use: a top-tier
    # request never waits behind lower-tier calls already queued at the target
    top_tier_headroom: SlotCount = 1
    # a further call may go out this long before a running call is expected to end (its average
    # latency), so the instance gets its next request without waiting for the router's hand-off
    # (0.5-2 ms a call, 3-6 % of a 10-20 ms target's capacity); 0 = never (docs/router.md)
    handoff_lead_ms: NonNegativeMs = 2.0
    fluctuation: FluctuationPolicy = field(default_factory=FluctuationPolicy)
    shares: dict[Annotated[int, Strict()], Percent] = field(default_factory=lambda: {1: 100.0})
    shadow: ShadowPolicy = field(default_factory=ShadowPolicy)
    # a call that fails on another version goes once more to this one, within the request's time
    # left (a rollout's canary steps name the current version: a failing canary is answered by
    # it); the failure still counts against its version. None: the client gets the failure
    fallback_version: Optional[Annotated[int, Strict()]] = None
    # bumped by `dspark route set`; exported as a metric to confirm a reload
    version: Annotated[int, Strict(), Field(ge=0, le=MAX_CONFIG_VERSION)] = 0
    # fast path: when nothing is queued and a slot is free, execute calls the target itself,
    # but only while the target's recent latency (EWMA) is at most this; 0 turns it off
    inline_max_ms: NonNegativeMs = 5.0
    # a request that waited at least this long in the queue is asked whether its client is still
    # there before it is sent (an IPC round trip of ~0.2 ms, paid while the target waits for work)
    cancel_check_ms: NonNegativeMs = 1000.0

    def slots(self, target_instances: int | None) -> int:
        """Calls in flight that any tier may use (``max_inflight``, "auto" = the target's
        instances; 1 when they are unknown)."""
        if self.max_inflight == "auto":
            return max(1, target_instances or 1)
        return self.max_inflight

    @property
    def top_tier(self) -> str:
        """The tier with the highest base weight (the first listed among equals)."""
        return max(self.tiers, key=lambda name: self.tiers[name].weight)

    def validate(self, allowed_versions: set[int] | None = None) -> "RoutingConfig":
        """Check every field, then the relations between them; raise ConfigError naming the
        first bad one. Returns the config, re-built from its fields (so a ``replace`` with a bad
        value is caught here too)."""
        checked = parse_routing(asdict(self))
        if not checked.tiers:
            raise ConfigError("tiers", "at least one tier is required")
        if checked.default_tier not in checked.tiers:
            raise ConfigError("default_tier", f"'{checked.default_tier}' is not one of the tiers "
                                              f"({', '.join(checked.tiers)})")
        if checked.fluctuation.short_window_s > checked.fluctuation.window_s:
            raise ConfigError("fluctuation.short_window_s", "must not exceed fluctuation.window_s")
        if not checked.shares:
            raise ConfigError("shares", "at least one version needs a share")
        for version in checked.shares:
            if allowed_versions is not None and version not in allowed_versions:
                raise ConfigError("shares", f"version {version} is not a routable version of the target "
                                            f"(allowed: {sorted(allowed_versions)})")
        total = sum(checked.shares.values())
        if not math.isclose(total, 100.0, abs_tol=1e-6):
            raise ConfigError("shares", f"percentages must sum to 100, got {total:g}")
        fallback = checked.fallback_version
        if fallback is not None and allowed_versions is not None and fallback not in allowed_versions:
            raise ConfigError("fallback_version", f"version {fallback} is not a routable version of the target "
                                                  f"(allowed: {sorted(allowed_versions)})")
        shadow = checked.shadow
        if shadow.percent > 0 and shadow.version is None:
            raise ConfigError("shadow.version", "required when shadow.percent > 0")
        if shadow.version is not None and allowed_versions is not None and shadow.version not in allowed_versions:
            raise ConfigError("shadow.version", f"version {shadow.version} is not a routable version of the "
                                                f"target (allowed: {sorted(allowed_versions)})")
        return checked

    # --- file format -------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any) -> "RoutingConfig":
        return parse_routing(data)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for tier in out["tiers"].values():
            if tier["timeout_ms"] is None:
                del tier["timeout_ms"]
        out["shadow"]["ignore_outputs"] = list(self.shadow.ignore_outputs)
        return out

    @classmethod
    def load(cls, path: Path, allowed_versions: set[int] | None = None) -> "RoutingConfig":
        return load_routing(path, allowed_versions)

    def save(self, path: Path) -> None:
        save_routing(self, path)


_ADAPTER = TypeAdapter(RoutingConfig)
_SECTIONS: dict[str, type] = {"tiers": TierPolicy, "fluctuation": FluctuationPolicy, "shadow": ShadowPolicy}


def _known_fields(loc: tuple) -> str:
    """The field names allowed where an unknown one was found (top level, a tier, a section)."""
    kind = TierPolicy if loc[:1] == ("tiers",) and len(loc) == 3 else _SECTIONS.get(loc[0]) if len(loc) == 2 else RoutingConfig
    return ", ".join(name for name in kind.__dataclass_fields__ if not name.startswith("__"))


def parse_routing(data: Any) -> RoutingConfig:
    """A mapping (parsed YAML) as a RoutingConfig, field by field. Raises ConfigError naming the
    field path."""
    if not isinstance(data, Mapping):
        raise ConfigError("", f"the routing file must be a mapping of fields ({_known_fields(())}), "
                              f"got {type(data).__name__} {data!r:.60}")
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = tuple(part for part in first["loc"] if part != "[key]")
        if first["type"] in ("unexpected_keyword_argument", "extra_forbidden", "invalid_key"):
            name = ".".join(str(part) for part in loc)
            raise ConfigError(name, f"unknown field (known: {_known_fields(loc)})") from None
        if first["loc"][-1:] == ("[key]",):
            raise ConfigError(field_path(loc[:-1]), f"key {loc[-1]!r}: {first['msg']}") from None
        if first["type"] == "value_error":  # our own validators' messages, without pydantic's prefix
            reason = first["msg"].removeprefix("Value error, ")
            raise ConfigError(field_path(loc), f"{reason}, got {first['input']!r}") from None
        raise from_validation_error(exc, ConfigError) from None


def load_routing(path: Path, allowed_versions: set[int] | None = None) -> RoutingConfig:
    """Read and validate a routing file; ConfigError names the file and the field."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_ROUTING_BYTES + 1)
    except OSError as exc:
        raise ConfigError("", f"cannot read: {exc.strerror or exc}", path) from None
    if len(raw) > MAX_ROUTING_BYTES:
        raise ConfigError("", f"larger than {MAX_ROUTING_BYTES // 1024} KiB, the most a routing file may be "
                              "(it is parsed on the router's clock thread, which enforces the deadlines)", path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError("", f"not UTF-8 text (byte {exc.start}: {raw[exc.start:exc.start + 1]!r}); "
                              "save the file as UTF-8", path) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("", f"not valid YAML: {exc}", path) from None
    if data is None:
        raise ConfigError("", "has no fields (empty, only comments, or cut short while being written): write "
                              "the whole file (`dspark route set` replaces it in one rename), or delete it "
                              "for the defaults", path)
    try:
        return parse_routing(data).validate(allowed_versions)
    except ConfigError as exc:
        raise ConfigError(exc.field, exc.reason, path) from None


def save_routing(config: RoutingConfig, path: Path) -> None:
    """Validate, then write atomically (temp file + rename) so a reader never sees half a file."""
    path = Path(path)
    text = yaml.safe_dump(config.validate().to_dict(), sort_keys=False)
    fd, tmp = tempfile.mkstemp(prefix=".routing-", suffix=".yaml", dir=path.parent)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def update_routing(path: Path, allowed_versions: set[int] | None = None, **changes: Any) -> RoutingConfig:
    """Load ``path`` (the defaults if it does not exist), replace ``changes``, bump the version,
    validate against ``allowed_versions`` and save. Raises ConfigError (nothing written)."""
    path = Path(path)
    current = load_routing(path, allowed_versions) if path.exists() else RoutingConfig()
    if current.version >= MAX_CONFIG_VERSION:
        raise ConfigError("version", f"is {current.version}, the highest a routing version may be (2**53 - 1, "
                                     "the largest a metric holds exactly): write a lower version into the file "
                                     "(the router applies any valid one)", path)
    try:
        new = replace(current, version=current.version + 1, **changes)
    except TypeError as exc:  # a field name that does not exist
        raise ConfigError("", str(exc), path) from None
    try:
        new = new.validate(allowed_versions)
    except ConfigError as exc:
        raise ConfigError(exc.field, exc.reason, path) from None
    save_routing(new, path)
    return new


def target_instances(repository: Path, target: str) -> int | None:
    """How many instances the target model runs, from its config.pbtxt in ``repository`` (None
    when it has none there or it cannot be read): ``max_inflight: auto`` keeps that many calls
    in flight. Triton's defaults apply: a group without a count is one instance, per listed GPU."""
    from dspark.repository.modelspec import load_config

    try:
        config = load_config(Path(repository) / target / "config.pbtxt")
    except (OSError, ValueError):
        return None
    return sum(max(1, group.count) * max(1, len(group.gpus)) for group in config.instance_group) or 1


class ConfigWatcher:
    """Re-reads a routing file when it changes; keeps the last good config on any error."""

    def __init__(self, path: Path, allowed_versions: set[int] | None = None):
        self.path = Path(path)
        self.allowed_versions = allowed_versions
        self._stamp: tuple[int, int] | None = None
        self.last_error: str | None = None
        self.config = RoutingConfig().validate(None) if not self.path.exists() else self._read()

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def _read(self) -> RoutingConfig:
        self._stamp = self._file_stamp()
        return load_routing(self.path, self.allowed_versions)

    def poll(self) -> RoutingConfig | None:
        """Return the new config if the file changed and is valid, else None.

        Never raises: an invalid new file (or any failure reading it) leaves the current config
        in place and sets ``last_error``; the next change is read again.
        """
        stamp = self._file_stamp()
        if stamp is None or stamp == self._stamp:
            return None
        try:
            new = self._read()
        except Exception as exc:  # noqa: BLE001 - whatever is in the file, the watcher goes on
            self.last_error = str(exc) or type(exc).__name__
            return None
        self.last_error = None
        self.config = new
        return new
