"""`dspark bench prefix`: a thin command over dspark/bench/prefix.py (the prefix cache's saving on
the time to the first token)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import click

from dspark.cli.bench_common import bench_errors, emit, progress_log


@click.command("prefix")
@click.option("--prefix-tokens", default=2000, show_default=True, type=click.IntRange(min=64),
              help="Tokens the two prompts of the shared-prefix case share.")
@click.option("--turns", default=5, show_default=True, type=click.IntRange(min=2),
              help="User turns of the chat case (the last one is timed).")
@click.option("--turn-tokens", default=300, show_default=True, type=click.IntRange(min=1),
              help="Tokens of each user message.")
@click.option("--reply-tokens", default=32, show_default=True, type=click.IntRange(min=1),
              help="Tokens of each assistant reply before the last turn.")
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(min=1),
              help="Interleaved repeats of each case (median).")
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "--json-out", "json_path", type=click.Path(path_type=Path), default=None,
              help="The result's path  [default: bench-results/prefix-<time>.json]")
@bench_errors
def prefix(prefix_tokens: int, turns: int, turn_tokens: int, reply_tokens: int, repeats: int, threads: int,
           json_path: Optional[Path]) -> None:
    """Time to the first token with the prefix cache against without it, on the demo's SmolLM2: a
    prompt sharing a long prefix with the one before (target <= 0.15x) and a chat's last turn
    (target <= 0.3x)."""
    from dspark.bench.prefix import PrefixBenchSettings, run_prefix_bench

    settings = PrefixBenchSettings(prefix_tokens, turns, turn_tokens, reply_tokens, repeats, threads)
    result = run_prefix_bench(settings, log=lambda text: progress_log(f"  {text}"))
    emit(result, json_path or Path("bench-results") / f"prefix-{time.strftime('%Y%m%d-%H%M%S')}.json")
