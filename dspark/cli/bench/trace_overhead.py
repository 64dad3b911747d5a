"""`dspark bench trace`: thin command over dspark/bench/trace_overhead.py (the probes' end-to-end
cost: decode tokens/s of the demo LLMs and router throughput, built without probes, with probes
detached, and with `dspark trace` attached)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import click

from dspark.cli.bench.common import bench_errors, emit, progress_log


@click.command("trace")
@click.option("--model", "models", multiple=True, default=("spec_lm", "gemma_lm"), show_default=True,
              help="The demo repository's LLM models to decode with (repeatable).")
@click.option("--rounds", default=5, show_default=True, type=click.IntRange(min=1),
              help="Interleaved rounds of A, B and C (medians over them).")
@click.option("--tokens", default=64, show_default=True, type=click.IntRange(min=2), help="Tokens per decode run.")
@click.option("--runs", default=2, show_default=True, type=click.IntRange(min=1),
              help="Decode runs per model, build and round.")
@click.option("--threads", default=2, show_default=True, help="Threads of the models.")
@click.option("--router/--no-router", default=True, show_default=True, help="Also the router's throughput.")
@click.option("--router-seconds", "router_s", default=6.0, show_default=True,
              help="Seconds of closed loop per build and round.")
@click.option("--outstanding", default=8, show_default=True, help="Requests kept outstanding at the router.")
@click.option("--build-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Build the modules without probes here and keep them for the next run  [default: a temporary "
                   "folder, removed afterwards]")
@click.option("--json", "--json-out", "json_path", type=click.Path(path_type=Path), default=None,
              help="The result's path  [default: bench-results/trace-<time>.json]")
@bench_errors
def trace_bench(models, rounds: int, tokens: int, runs: int, threads: int, router: bool, router_s: float,
                outstanding: int, build_dir: Optional[Path], json_path: Optional[Path]) -> None:
    """What the USDT probes cost: decode tokens/s of the demo LLMs (in process) and router
    throughput, A: built without probes, B: probes detached, C: `dspark trace` attached; as root
    with bpftrace (docs/trace.md)."""
    from dspark.bench.trace_overhead import TraceBenchSettings, run_trace_bench

    settings = TraceBenchSettings(models=list(models), rounds=rounds, tokens=tokens, runs=runs, threads=threads,
                                  router=router, router_s=router_s, outstanding=outstanding, build_dir=build_dir)
    result = run_trace_bench(settings, log=lambda text: progress_log(f"  {text}"))
    emit(result, json_path or Path("bench-results") / f"trace-{time.strftime('%Y%m%d-%H%M%S')}.json")
