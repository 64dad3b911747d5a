"""`dspark bench rollout`: thin command over dspark/bench/rollout.py (rollouts in a row under an
open-loop load: time to promote, to detect and roll back; largest gap between answers, p99
against the steady p99, failed client requests)."""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

import click

from dspark.bench.rollout import PATTERN
from dspark.cli.bench.common import bench_errors, emit


@click.command(name="rollout")
@click.option("--rollouts", default=20, show_default=True)
@click.option("--servers", default=1, show_default=True, help="Servers in the fleet (sharing one repository).")
@click.option("--rate", default=60.0, show_default=True, help="Client requests per second, in all (open loop).")
@click.option("--arrivals", type=click.Choice(["fixed", "poisson"]), default="fixed", show_default=True,
              help="Evenly spaced or Poisson arrivals.")
@click.option("--steady", "steady_s", default=10.0, show_default=True,
              help="Seconds of steady load before the first rollout (the baseline).")
@click.option("--pattern", default=",".join(PATTERN), show_default=True,
              help="Kinds of rollout, in turn: good, slow (2x slower), error (fails after 10 answers).")
@click.option("--interval", "interval_s", default=1.0, show_default=True, help="Analysis interval (s).")
@click.option("--hold", "hold_s", default=2.0, show_default=True, help="Seconds each step is held.")
@click.option("--parallel-loads", default=1, show_default=True, type=click.IntRange(min=1),
              help="Servers that load a version at once (the plan's parallel_loads).")
@click.option("--json", "--output", "json_path", type=click.Path(path_type=Path), default=None,
              help="The result's path  [default: bench-results/rollout-<time>.json]")
@bench_errors
def rollout_bench(rollouts: int, servers: int, rate: float, arrivals: str, steady_s: float, pattern: str,
                  interval_s: float, hold_s: float, parallel_loads: int, json_path: Optional[Path]) -> None:
    """Rollouts in a row under an open-loop load: time to promote, to detect and roll back;
    largest gap between answers, p99 against steady, failed requests (1 s timeout)."""
    from dspark.bench.rollout import run_rollout_bench

    workdir = Path(tempfile.mkdtemp(prefix="dspark-bench-rollout-"))
    try:
        result = run_rollout_bench(rollouts, servers, rate, arrivals, interval_s, hold_s, workdir, steady_s,
                                   [k.strip() for k in pattern.split(",") if k.strip()], parallel_loads,
                                   say=click.echo)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    emit(result, json_path or Path("bench-results") / f"rollout-{time.strftime('%Y%m%d-%H%M%S')}.json")
