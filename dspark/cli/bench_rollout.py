"""`dspark bench rollout`: thin command over dspark/bench/rollout.py (rollouts in a row under load:
time to promote, to detect and roll back, failed client requests)."""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

import click

from dspark.cli.bench_common import bench_errors, emit


@click.command(name="rollout")
@click.option("--rollouts", default=20, show_default=True)
@click.option("--servers", default=1, show_default=True, help="Servers in the fleet (sharing one repository).")
@click.option("--threads", default=2, show_default=True, help="Client threads per server.")
@click.option("--interval", "interval_s", default=0.5, show_default=True, help="Analysis interval (s).")
@click.option("--hold", "hold_s", default=1.0, show_default=True, help="Seconds each step is held.")
@click.option("--json", "--output", "json_path", type=click.Path(path_type=Path), default=None,
              help="The result's path  [default: bench-results/rollout-<time>.json]")
@bench_errors
def rollout_bench(rollouts: int, servers: int, threads: int, interval_s: float, hold_s: float,
                  json_path: Optional[Path]) -> None:
    """Rollouts in a row under load: time to promote, to detect and roll back, failed requests."""
    from dspark.bench.rollout import run_rollout_bench

    workdir = Path(tempfile.mkdtemp(prefix="dspark-bench-rollout-"))
    try:
        result = run_rollout_bench(rollouts, servers, threads, interval_s, hold_s, workdir, say=click.echo)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    emit(result, json_path or Path("bench-results") / f"rollout-{time.strftime('%Y%m%d-%H%M%S')}.json")
