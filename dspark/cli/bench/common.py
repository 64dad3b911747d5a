"""What the `dspark bench` commands share: one-line errors, progress lines, the result table and
JSON, the compare checks' verdict. Imports no command module, so any of them can use it."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import click

from dspark.errors import DsparkError


def bench_errors(command):
    """Errors of dspark's model (bad settings, files, results) as one-line CLI errors."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except DsparkError as error:
            raise click.ClickException(str(error)) from None
    return wrapper


def progress_log(text: str) -> None:
    click.echo(text, err=True)


def emit(result, json_path: Optional[Path]) -> None:
    """Print the one table (with the machine line and notes); write the JSON."""
    from dspark.bench.results import header_line

    click.echo(header_line(result))
    for note in result.notes:
        click.echo(note)
    click.echo(result.table())
    if json_path:
        click.echo(f"wrote {result.save(json_path)}")


def print_checks(checks, title: str) -> list:
    """The checks' table and one line naming those that failed; returns them."""
    from dspark.bench.compare import format_checks

    click.echo(f"{title}:")
    click.echo(format_checks(checks))
    failed = [c for c in checks if c.failed]
    if failed:
        def measured(c) -> str:  # a bound on the value alone has no ratio
            return f"{c.new:.4g}" if c.ratio != c.ratio else f"{c.ratio:.3f}x, band ±{c.band:.1%}"
        click.echo(f"FAIL: {len(failed)} of {len(checks)} checks: " + "; ".join(
            f"{c.point} {c.metric} {c.verdict} ({measured(c)}{', target ' + c.target if c.target else ''})"
            for c in failed))
    else:
        click.echo(f"PASS: {len(checks)} checks within their bands and targets")
    unsure = [c for c in checks if c.verdict == "unsure"]
    if unsure:
        click.echo(f"NOTE: BASE and NEW are one run each: their bands are the spread of windows inside each run, "
                   f"not between runs, so {len(unsure)} changes beyond them are 'unsure', not regressions; "
                   "compare folders of repeated runs (or pass --min-band with the noise you know between runs) "
                   "to judge them")
    return failed
