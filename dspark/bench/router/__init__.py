"""`bench router`: the QoS router against plain FIFO, open loop, in one run, on a server it starts.

The repository it builds holds a sleep-based target (``service_ms`` x ``instances``; default
20 ms x 2, a held-out scenario) with the router in front of it (the demo's routing:
max_inflight auto, headroom 1 for diamond, lead 2 ms, deadlines 2/3/5 s, shares 100 %, no
shadow) and any ``Variant`` routers beside it; for the overhead at low load, targets of 1 ms and
of the service time, each with a router and two bare BLS forwarders (one returns the response
from ``execute``: the fast path's floor; one answers from a worker thread through the response
sender: the floor of any queued path), and a zero-time target for one router's ceiling.

Everything is driven by the package's load generator over one HTTP transport (connections kept
across runs): the target's capacity is a closed-loop point; each scenario is one seeded
``arrival_schedule`` (Poisson arrivals, tier mix 10/30/60) replayed with ``run_fixed`` at the
target directly (FIFO) and at each router, so A and B see the same arrivals; overheads and the
unloaded diamond p99 are sequential ``run_fixed`` calls. Triton's /metrics before and after each
run give the time requests waited in Triton's queue in front of each model and the router's own
latency histogram. The rows (scenario, mode, tier) and the targets, checked with `compare`,
make one ``BenchResult``.
"""
from dspark.bench.router.measure import run_router_bench
from dspark.bench.router.repository import Variant, build_repository, bench_server
from dspark.bench.router.result import (COLUMNS, METRICS, Goal, Run, check_goals, goals, histogram_delta,
                                        histogram_p99, router_histograms, scenario_rows)
from dspark.bench.router.scenarios import (ALL, TIER_MIX, TIERS, BurstShape, RouterBenchSettings, Scenario, bursty,
                                           classify, overload)

__all__ = ["ALL", "BurstShape", "COLUMNS", "METRICS", "TIER_MIX", "TIERS", "Goal", "RouterBenchSettings", "Run", "Scenario",
           "Variant", "bench_server", "build_repository", "bursty", "check_goals", "classify", "goals",
           "histogram_delta", "histogram_p99", "overload", "router_histograms", "run_router_bench", "scenario_rows"]
