"""`dspark bench router`: thin command over dspark/bench/router.py (the QoS router against plain
FIFO, open loop, on a server it starts; the overhead at low load; targets checked with compare)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import click

from dspark.cli.bench.common import bench_errors, emit, print_checks, progress_log


def _tier_mix(ctx, param, value):
    try:
        return tuple(float(part) for part in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected shares of diamond,gold,standard, e.g. 10,30,60") from None


def _burst(ctx, param, value):
    from dspark.bench.router import BurstShape
    from dspark.errors import ConfigError

    try:
        return BurstShape.parse(value)
    except ConfigError as error:
        raise click.BadParameter(error.reason) from None


def _variants(ctx, param, values):
    from dspark.bench.router import Variant
    from dspark.errors import ConfigError

    try:
        return [Variant.parse(v) for v in values]
    except ConfigError as error:
        raise click.BadParameter(error.reason) from None


@click.command(name="router")
@click.option("--service-ms", default=20.0, show_default=True, help="Target's service time per request.")
@click.option("--instances", default=2, show_default=True, help="Target instances (capacity = instances/service time).")
@click.option("--variant", "variants", multiple=True, callback=_variants, metavar="MAX_INFLIGHT:HEADROOM[:LEAD_MS]",
              help="Also run a router with these routing.yaml settings (repeatable), e.g. 2:0 (as many calls as "
                   "instances), 3:0 (instances+1 for every tier), auto:1:2 (headroom and a 2 ms hand-off lead).")
@click.option("--tier-mix", default="10,30,60", show_default=True, callback=_tier_mix, metavar="DIAMOND,GOLD,STANDARD",
              help="Shares of the tiers in every load (capacity and scenarios).")
@click.option("--arrivals", type=click.Choice(["poisson", "constant"]), default="poisson", show_default=True,
              help="The scenarios' arrival process: Poisson, or evenly spaced at the scenario's rate.")
@click.option("--burst", default="0.65:1.65:2:10", show_default=True, callback=_burst, metavar="BASE:BURST:BURST_S:PERIOD_S",
              help="The bursty scenario: BASE x capacity, and BURST x capacity in the last BURST_S of every PERIOD_S.")
@click.option("--bursty-s", default=20.0, show_default=True, help="Length of the bursty scenario per mode (0: skip it).")
@click.option("--overload-s", default=15.0, show_default=True, help="Length of each overload scenario per mode.")
@click.option("--overload", "overloads", multiple=True, type=float, default=(1.5, 2.0), show_default=True,
              help="Overload factors (repeatable).")
@click.option("--repeat", default=3, show_default=True,
              help="Runs of every scenario; the table shows medians of the runs' percentiles.")
@click.option("--skip-fifo", is_flag=True, help="Only the routers (A/B of router settings in less time).")
@click.option("--skip-overhead", is_flag=True, help="No low-load overhead and ceiling measurement (A/B runs).")
@click.option("--overhead-only", is_flag=True, help="Only the low-load overhead and ceiling (a few minutes).")
@click.option("--overhead-rounds", default=7, show_default=True, help="Rounds of the low-load overhead measurement.")
@click.option("--capacity-s", default=8.0, show_default=True,
              help="Seconds per round measuring the capacity, the target directly and through the router each.")
@click.option("--capacity-rounds", default=3, show_default=True,
              help="Rounds of the capacity measurement (direct and router alternating).")
@click.option("--seed", default=7, show_default=True)
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Folder for result.json and the plots  [default: bench-results/router-<time>]")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None,
              help="The result's path  [default: OUT/result.json]")
@click.option("--plots/--no-plots", default=True, show_default=True)
@bench_errors
def router(service_ms, instances, tier_mix, arrivals, burst, variants, bursty_s, overload_s, overloads, repeat,
           skip_fifo, skip_overhead, overhead_only, overhead_rounds, capacity_s, capacity_rounds, seed, out_dir: Optional[Path], json_path: Optional[Path],
           plots: bool) -> None:
    """QoS router vs plain FIFO: its capacity against the target's, bursty load below capacity and
    sustained overload, plus the router's overhead at low load."""
    from dspark.bench.plots import plot_router
    from dspark.bench.router import RouterBenchSettings, check_goals, run_router_bench

    settings = RouterBenchSettings(
        service_ms=service_ms, instances=instances, tier_mix=tier_mix, arrivals=arrivals, burst=burst, variants=variants,
        bursty_s=bursty_s, overload_s=overload_s, overloads=list(overloads), repeat=repeat, fifo=not skip_fifo,
        overhead=not skip_overhead, scenarios=not overhead_only, overhead_rounds=overhead_rounds,
        capacity_s=capacity_s, capacity_rounds=capacity_rounds, seed=seed)
    out_dir = out_dir or Path("bench-results") / f"router-{time.strftime('%Y%m%d-%H%M%S')}"
    result = run_router_bench(settings, log=progress_log)
    emit(result, json_path or out_dir / "result.json")
    print_checks(check_goals(result), "the router's targets")
    if plots:
        for path in plot_router(result, out_dir):
            click.echo(f"wrote {path}")
