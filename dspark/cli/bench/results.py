"""`dspark bench compare | all`: a result against a baseline (ratios with noise bands, targets),
and the docs' tables re-measured through the commands they name."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from dspark.cli.bench.common import bench_errors, print_checks, progress_log


# --- bench compare ------------------------------------------------------------------------------
@click.command("compare")
@click.argument("base", type=click.Path(path_type=Path, exists=True))
@click.argument("new", type=click.Path(path_type=Path, exists=True))
@click.option("--target", "targets", multiple=True, metavar="METRIC=+N%|METRIC<=Rx|METRIC>=V",
              help="What NEW must reach (repeatable): a change (qps=+20%, p99=-10%), a bound on NEW/BASE "
                   "(p99<=2x, goodput>=0.97x) or on NEW's own value (within_deadline>=0.995).")
@click.option("--metric", "metrics", multiple=True, help="Only check these metrics (repeatable)  [default: all]")
@click.option("--min-band", type=float, default=None,
              help="Smallest noise band, percent  [default: 2; with one run on each side a change beyond the "
                   "band is then 'unsure'; given, it is judged]")
@click.option("--ignore-key", "ignore_keys", multiple=True,
              help="Match rows without this field, e.g. model, to compare two models at the same settings.")
@click.option("--base-where", multiple=True, metavar="FIELD=VALUE",
              help="Only BASE's rows with this value (repeatable), e.g. to compare rows of one result: "
                   "--base-where mode=fifo --new-where mode=router --ignore-key mode.")
@click.option("--new-where", multiple=True, metavar="FIELD=VALUE", help="Only NEW's rows with this value (repeatable).")
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
@bench_errors
def compare(base: Path, new: Path, targets, metrics, min_band: float, ignore_keys, base_where, new_where,
            json_out) -> None:
    """NEW against BASE (result files, or folders of repeated runs): ratio per metric with its noise
    band; exit 1 when a target is missed or a metric regressed beyond the band."""
    from dspark.bench import compare as cmp

    base_result, new_result = cmp.load_side(base), cmp.load_side(new)
    if base_where:
        base_result = cmp.select(base_result, cmp.parse_where(base_where))
    if new_where:
        new_result = cmp.select(new_result, cmp.parse_where(new_where))
    checks = cmp.compare(base_result, new_result, cmp.parse_targets(targets),
                         None if min_band is None else min_band / 100, ignore_keys, metrics)
    failed = print_checks(checks, f"{new_result.benchmark}: {new} against {base}")
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({"base": str(base), "new": str(new), "failed": len(failed),
                                        "checks": [vars(c) for c in checks]}, indent=1))
    if failed:
        sys.exit(1)


# --- bench all ----------------------------------------------------------------------------------
@click.command("all")
@click.option("--table", "tables", multiple=True, help="Only these docs tables (repeatable)  [default: all]")
@click.option("--measure/--no-measure", default=True, show_default=True,
              help="--no-measure re-renders the docs from the results already in --results.")
@click.option("--results", "results_dir", type=click.Path(path_type=Path), default=Path("bench-results/docs"),
              show_default=True)
@click.option("--list", "list_only", is_flag=True, help="List the docs tables and their commands.")
@bench_errors
def bench_all(tables, measure: bool, results_dir: Path, list_only: bool) -> None:
    """Re-measure the tables the docs hold between <!-- bench:NAME --> markers, and rewrite them."""
    from dspark.bench import docs

    selected = docs.select(tables)
    if list_only:
        for table in selected:
            click.echo(f"{table.name:<14} {table.doc:<22} dspark {' '.join(docs.args_for(table, results_dir))}")
        return

    root = click.get_current_context().find_root().command  # the `dspark` group

    def run(args: list[str]) -> None:
        try:
            root.main(args=args, prog_name="dspark", standalone_mode=False)
        except click.ClickException as error:
            raise click.ClickException(f"dspark {' '.join(args)}: {error.format_message()}") from None

    for path in docs.refresh(selected, run if measure else None, results_dir, echo=progress_log):
        click.echo(f"rewrote {path}")


