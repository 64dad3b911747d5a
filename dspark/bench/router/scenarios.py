"""The router bench's settings and scenarios: the target (service time x instances), the tier
mix, the arrival process, the bursty and overload shapes, and how a refused request is classified."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

from dspark.errors import ConfigError
from dspark.routing.config import RoutingConfig

_DEFAULTS = RoutingConfig()
TIERS = tuple(_DEFAULTS.tiers)  # diamond, gold, standard
TIER_MIX = (10, 30, 60)  # the default shares of diamond, gold, standard
ARRIVALS = ("poisson", "constant")
ALL = "all"  # the tier of a scenario's summary row (goodput, queues, the client's lateness)
ROUTER_CEILING_INSTANCES = 4  # instances of the zero-time target behind the router-throughput measurement
CEILING_OUTSTANDING = 32
UNLOADED_CALLS = 200
# error kinds of a request the router refused with a reason (UNAVAILABLE + its message)
REASONS = (("queue deadline", "deadline"), ("queue is full", "queue_full"),
           ("did not answer within", "target_timeout"), ("shutting down", "shutdown"))
EXPLAINED = frozenset(kind for _, kind in REASONS)


def classify(kind: str, message: str) -> str:
    """The router's reason for refusing a request, read from its UNAVAILABLE message; other
    errors keep their kind (``timeout``: no answer within the client's timeout, i.e. hung)."""
    if kind == "UNAVAILABLE":
        return next((reason for marker, reason in REASONS if marker in message), kind)
    return kind




@dataclass(frozen=True)
class Variant:
    """A router configuration under test: calls in flight for every tier, the top tier's extra
    and the hand-off lead (routing.yaml max_inflight, top_tier_headroom, handoff_lead_ms); the
    defaults are the routing file's."""

    max_inflight: int | str = _DEFAULTS.max_inflight
    headroom: int = _DEFAULTS.top_tier_headroom
    lead_ms: float = _DEFAULTS.handoff_lead_ms

    @property
    def model(self) -> str:
        return ("bench_router" if self == Variant() else
                f"bench_router_m{self.max_inflight}_h{self.headroom}_l{self.lead_ms:g}".replace(".", "_"))

    @property
    def label(self) -> str:
        return "router" if self == Variant() else f"router {self.max_inflight}:{self.headroom}:{self.lead_ms:g}"

    @classmethod
    def parse(cls, text: str) -> "Variant":
        parts = text.split(":")
        try:
            inflight = parts[0] if parts[0] == "auto" else int(parts[0])
            return cls(inflight, int(parts[1]) if len(parts) > 1 else 0, float(parts[2]) if len(parts) > 2 else 0.0)
        except (ValueError, IndexError):
            raise ConfigError("variant", f"{text!r}: expected MAX_INFLIGHT:HEADROOM[:LEAD_MS], e.g. 3:0 or auto:1:2") \
                from None


@dataclass(frozen=True)
class Scenario:
    name: str
    duration_s: float
    offered: float  # mean offered load, x capacity
    rate_at: Callable[[float], float]  # t -> arrivals/s


@dataclass(frozen=True)
class BurstShape:
    """The bursty scenario's load, as multiples of the target's capacity: ``base`` and, in the
    last ``burst_s`` of every ``period_s``, ``burst``."""

    base: float = 0.65
    burst: float = 1.65
    burst_s: float = 2.0
    period_s: float = 10.0

    @classmethod
    def parse(cls, text: str) -> "BurstShape":
        try:
            base, burst, burst_s, period_s = (float(part) for part in text.split(":"))
        except ValueError:
            raise ConfigError("burst", f"{text!r}: expected BASE:BURST:BURST_S:PERIOD_S, e.g. 0.65:1.65:2:10") from None
        if not (base > 0 and burst > 0 and 0 < burst_s < period_s):
            raise ConfigError("burst", f"{text!r}: loads must be > 0 and 0 < BURST_S < PERIOD_S")
        return cls(base, burst, burst_s, period_s)


def bursty(capacity: float, duration_s: float, shape: BurstShape = BurstShape()) -> Scenario:
    base, burst, burst_s, period_s = shape.base, shape.burst, shape.burst_s, shape.period_s
    mean = (base * (period_s - burst_s) + burst * burst_s) / period_s
    return Scenario(f"bursty {mean:.2f}x ({burst:g}x {burst_s:g}s/{period_s:g}s)", duration_s, mean,
                    lambda t: capacity * (burst if (t % period_s) >= period_s - burst_s else base))


def overload(capacity: float, factor: float, duration_s: float) -> Scenario:
    return Scenario(f"overload {factor:g}x", duration_s, factor, lambda t: capacity * factor)


@dataclass
class RouterBenchSettings:
    service_ms: float = 20.0
    instances: int = 2
    variants: list[Variant] = field(default_factory=list)
    tier_mix: tuple[float, ...] = TIER_MIX  # shares of diamond, gold, standard in every load
    arrivals: str = "poisson"        # the scenarios' arrival process: poisson or constant (evenly spaced)
    burst: BurstShape = BurstShape()
    bursty_s: float = 20.0           # 0: no bursty scenario
    overload_s: float = 15.0
    overloads: list[float] = field(default_factory=lambda: [1.5, 2.0])
    repeat: int = 3
    fifo: bool = True                # also the target directly (the A/B baseline)
    overhead: bool = True            # the low-load overhead and one router's ceiling
    scenarios: bool = True           # False: the overhead alone
    overhead_rounds: int = 7
    overhead_calls: tuple[int, int] = (100, 60)  # sequential calls per round at 1 ms and at service_ms
    capacity_s: float = 8.0          # closed loop, each of direct and router per round (and the ceiling's)
    capacity_rounds: int = 3         # rounds of the capacity measurement, direct and router alternating
    seed: int = 7
    timeout_s: float = 120.0         # a request without an answer by then is counted as hung ("timeout")

    def __post_init__(self) -> None:
        self.variants = list(dict.fromkeys(v for v in self.variants if v != Variant()))
        if self.repeat < 1 or self.overhead_rounds < 1 or self.capacity_rounds < 1:
            raise ConfigError("repeat", "repeats and rounds must be >= 1")
        if len(self.tier_mix) != len(TIERS) or min(self.tier_mix) < 0 or sum(self.tier_mix) <= 0:
            raise ConfigError("tier_mix", f"{len(TIERS)} shares >= 0 ({', '.join(TIERS)}), not all 0; "
                                          f"got {', '.join(f'{m:g}' for m in self.tier_mix)}")
        if self.arrivals not in ARRIVALS:
            raise ConfigError("arrivals", f"{self.arrivals!r}: expected {' or '.join(ARRIVALS)}")
        if not (self.overhead or self.scenarios):
            raise ConfigError("overhead", "nothing to measure: the overhead is skipped and so are the scenarios")

    @property
    def deadlines_s(self) -> dict[str, float]:
        return {t: policy.deadline_ms / 1000 for t, policy in RoutingConfig().tiers.items()}

    @property
    def modes(self) -> list[tuple[str, str, bool]]:
        """(mode, model, sends tiers): FIFO (the target directly) first, then each router."""
        return ([("fifo", "bench_target", False)] if self.fifo else []) + [
            (v.label, v.model, True) for v in [Variant(), *self.variants]]

    def scenario_list(self, capacity: float) -> list[Scenario]:
        return ([bursty(capacity, self.bursty_s, self.burst)] if self.bursty_s > 0 else []) + [
            overload(capacity, f, self.overload_s) for f in self.overloads]

    def to_json(self) -> dict:
        data = asdict(self)
        data["variants"] = [v.label for v in self.variants]
        data["tier_mix"] = dict(zip(TIERS, self.tier_mix))
        data["deadlines_ms"] = {t: 1000 * s for t, s in self.deadlines_s.items()}
        return data

