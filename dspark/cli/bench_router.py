"""`dspark bench router`: thin command over dspark/bench/router.py (the QoS router against plain
FIFO, open loop, on a server it starts; the overhead at low load; targets checked with compare)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import click

from dspark.cli.bench_common import bench_errors, emit, print_checks, progress_log


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
@click.option("--capacity-s", default=8.0, show_default=True, help="Seconds measuring the target's capacity.")
@click.option("--seed", default=7, show_default=True)
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Folder for result.json and the plots  [default: bench-results/router-<time>]")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None,
              help="The result's path  [default: OUT/result.json]")
@click.option("--plots/--no-plots", default=True, show_default=True)
@bench_errors
def router(service_ms, instances, variants, bursty_s, overload_s, overloads, repeat, skip_fifo, skip_overhead,
           overhead_only, overhead_rounds, capacity_s, seed, out_dir: Optional[Path], json_path: Optional[Path],
           plots: bool) -> None:
    """QoS router vs plain FIFO: bursty below capacity and sustained overload, plus router overhead."""
    from dspark.bench.plots import plot_router
    from dspark.bench.router import RouterBenchSettings, check_goals, run_router_bench

    settings = RouterBenchSettings(
        service_ms=service_ms, instances=instances, variants=variants, bursty_s=bursty_s, overload_s=overload_s,
        overloads=list(overloads), repeat=repeat, fifo=not skip_fifo, overhead=not skip_overhead,
        scenarios=not overhead_only, overhead_rounds=overhead_rounds, capacity_s=capacity_s, seed=seed)
    out_dir = out_dir or Path("bench-results") / f"router-{time.strftime('%Y%m%d-%H%M%S')}"
    result = run_router_bench(settings, log=progress_log)
    emit(result, json_path or out_dir / "result.json")
    print_checks(check_goals(result), "the router's targets")
    if plots:
        for path in plot_router(result, out_dir):
            click.echo(f"wrote {path}")
