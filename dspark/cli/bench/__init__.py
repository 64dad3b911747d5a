"""`dspark bench`: thin commands over dspark/bench. `model` and `system` drive any Triton server,
`compare` checks a result against a baseline, `profile` attaches profilers, `all` re-measures the
docs' tables. The group's other commands live in their own modules (micro benchmarks:
kernels.py; LLM: bench_spec.py; router: bench_router.py; rollouts: bench_rollout.py) and are
added to the group here, in one place (COMMANDS at the end)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import click

from dspark.cli import bench_prefix, bench_rollout, bench_router, bench_spec, kernels
from dspark.cli.bench import runs
from dspark.cli.bench_common import bench_errors, emit, print_checks, progress_log
from dspark.server.access import API_KEY_ENV, API_KEY_HEADER, repository_headers


@click.group()
def bench() -> None:
    """Benchmarks: micro (operators), model and system (a running server), compare, profile, all."""


# --- bench model / bench system -----------------------------------------------------------------
def load_options(command):
    options = [
        click.option("--url", default=None, help="Server address host:port  [default: 127.0.0.1:8000 for http, "
                     ":8001 for grpc]"),
        click.option("--protocol", type=click.Choice(["http", "grpc", "grpc-stream"]), default="http", show_default=True,
                     help="grpc-stream: gRPC streaming, with time to first token and inter-token latency."),
        click.option("--concurrency", default=None, metavar="LIST|START:END[:STEP]",
                     help="Closed loop: requests outstanding (sweep)  [default: 1]"),
        click.option("--request-rate", default=None, metavar="LIST|START:END[:STEP]",
                     help="Open loop instead: requests per second (sweep)."),
        click.option("--arrivals", type=click.Choice(["constant", "poisson"]), default="constant", show_default=True,
                     help="Request-rate mode: spacing of the sends."),
        click.option("--batch", default=1, show_default=True, help="Batch size of each request (batching models)."),
        click.option("--shape", "shapes", multiple=True, metavar="NAME:d1,d2",
                     help="Shape of a variable-size input (without the batch dimension)."),
        click.option("--warmup", "warmup_s", default=2.0, show_default=True, help="Seconds of load before measuring."),
        click.option("--window", "window_s", default=2.0, show_default=True, help="Seconds per measurement window."),
        click.option("--stable-windows", default=3, show_default=True, help="Windows that must agree."),
        click.option("--stability", default=10.0, show_default=True,
                     help="Percent within which those windows' req/s and mean latency must agree."),
        click.option("--max-windows", default=10, show_default=True, help="Give up on stability after this many."),
        click.option("--timeout", "timeout_s", default=60.0, show_default=True, help="Client timeout per request (s)."),
        click.option("--metrics-url", default=None,
                     help="Triton's metrics endpoint  [default: on --url's host, its port + 2 (HTTP) or + 1 "
                          "(gRPC), as `dspark serve` lays them out; 'none' to skip]"),
        click.option("--server-pid", type=int, default=None,
                     help="The server's pid for CPU/memory sampling  [default: the process listening on --url]"),
        click.option("--parameter", "parameters", multiple=True, metavar="KEY=VALUE",
                     help="A request parameter sent with every request (JSON value or text), e.g. tier=gold."),
        click.option("--api-key", default=None, help=f"Sent as the {API_KEY_HEADER} header  [default: ${API_KEY_ENV}]"),
        click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
                     help="Folder for result.json and the plots  [default: bench-results/<command>-<time>]"),
        click.option("--plots/--no-plots", default=True, show_default=True),
        click.option("--progress/--no-progress", default=None, help="Progress bar  [default: when stderr is a terminal]"),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def request_parameters(texts) -> dict:
    parameters = {}
    for text in texts:
        key, sep, value = text.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{text!r}: expected KEY=VALUE", param_hint="--parameter")
        try:
            parameters[key] = json.loads(value)
        except ValueError:
            parameters[key] = value
        if not isinstance(parameters[key], (str, int, float, bool)):
            parameters[key] = value
    return parameters


def _run_load(kind: str, models, url, protocol, concurrency, request_rate, arrivals, batch, shapes, warmup_s,
              window_s, stable_windows, stability, max_windows, timeout_s, metrics_url, server_pid, parameters,
              api_key, out_dir, plots, progress) -> None:
    import time

    from dspark.bench.inputs import parse_shapes
    from dspark.bench.load import LoadSettings
    from dspark.bench.model import LoadBenchSettings, parse_levels, run_load_bench
    from dspark.bench.plots import plot_result
    from dspark.bench.progress import Progress
    from dspark.bench.resources import default_metrics_url

    if concurrency and request_rate:
        raise click.UsageError("give --concurrency or --request-rate, not both")
    mode = "rate" if request_rate else "concurrency"
    levels = parse_levels(request_rate or concurrency or "1")
    if mode == "concurrency" and any(level != int(level) for level in levels):
        raise click.UsageError("--concurrency levels are whole numbers")
    url = url or ("127.0.0.1:8000" if protocol == "http" else "127.0.0.1:8001")
    if metrics_url is None:
        metrics_url = default_metrics_url(url, protocol)
    api_key = api_key or os.environ.get(API_KEY_ENV)
    settings = LoadBenchSettings(
        models=list(models), url=url, protocol=protocol, mode=mode, levels=levels, batch=batch,
        shapes=parse_shapes(shapes),
        load=LoadSettings(warmup_s=warmup_s, window_s=window_s, stable_windows=stable_windows,
                          stability=stability / 100, max_windows=max_windows, arrivals=arrivals),
        timeout_s=timeout_s, metrics_url=None if metrics_url == "none" else metrics_url, server_pid=server_pid,
        headers=repository_headers(api_key), parameters=request_parameters(parameters))
    out_dir = out_dir or Path("bench-results") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    with Progress(len(levels), f"bench {kind}", progress, echo=progress_log) as bar:
        result = run_load_bench(settings, bar)
    emit(result, out_dir / "result.json")
    for row in result.rows:
        for error, count in sorted(row["errors"].items()):
            click.echo(f"errors at {row['level']:g}: {error} x{count}, e.g. {row['error_examples'].get(error, '')!r}")
    if plots:
        for path in plot_result(result, out_dir, stem=kind):
            click.echo(f"wrote {path}")


@click.command("model")
@click.argument("model")
@click.option("--input-data", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="JSON in perf_analyzer's input-data format  [default: generated from the model's config]")
@load_options
@bench_errors
def model(model: str, input_data: Optional[Path], **options) -> None:
    """Latency percentiles, throughput and errors of MODEL on a running server, per concurrency or rate."""
    from dspark.bench.model import ModelSpec

    _run_load("model", [ModelSpec(model, 1.0, input_data)], **options)


@click.command("system")
@click.argument("models", nargs=-1, required=True, metavar="NAME[:WEIGHT[:INPUT_DATA.json]]...")
@load_options
@bench_errors
def system(models: tuple[str, ...], **options) -> None:
    """Several models at once with a traffic mix (WEIGHT shares); per-model and total results."""
    from dspark.bench.model import ModelSpec

    _run_load("system", [ModelSpec.parse(m) for m in models], **options)


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


# --- bench profile ------------------------------------------------------------------------------
@click.command("profile")
@click.argument("model", required=False)
@click.option("--url", default="127.0.0.1:8000", show_default=True, help="The server's HTTP address (to find it).")
@click.option("--server-pid", type=int, default=None, help="The server's pid  [default: the process on --url]")
@click.option("--duration", "duration_s", default=10.0, show_default=True, help="Seconds to profile.")
@click.option("--rate", default=100, show_default=True, help="py-spy samples per second.")
@click.option("--load-concurrency", default=1, show_default=True,
              help="With MODEL: requests kept outstanding during the profile (0: no load).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Folder for the profiles  [default: bench-results/profile-<time>]")
@bench_errors
def profile(model: Optional[str], url: str, server_pid: Optional[int], duration_s: float, rate: int,
            load_concurrency: int, out_dir: Optional[Path]) -> None:
    """py-spy on the backend stubs (MODEL's, when given) and `perf stat` on the server, for a set time."""
    import threading
    import time

    from dspark.bench.profile import profile as run_profile
    from dspark.bench.resources import server_pid as find_pid

    pid = server_pid or find_pid(url)
    if pid is None:
        raise click.ClickException(f"no process listens on {url} on this machine: pass --server-pid")
    out_dir = out_dir or Path("bench-results") / f"profile-{time.strftime('%Y%m%d-%H%M%S')}"
    load_thread = None
    if model and load_concurrency > 0:
        from dspark.bench.load import LoadSettings
        from dspark.bench.model import LoadBenchSettings, ModelSpec, run_load_bench

        window = max(1.0, duration_s / 4)
        windows = int(duration_s / window) + 1  # as many windows as cover the profile, stable or not
        settings = LoadBenchSettings([ModelSpec(model)], url=url, levels=[float(load_concurrency)], server_pid=pid,
                                     load=LoadSettings(warmup_s=0.5, window_s=window, stable_windows=windows,
                                                       max_windows=windows))
        holder: dict = {}

        def drive() -> None:
            try:
                holder["result"] = run_load_bench(settings)
            except Exception as error:  # reported below; the profile still stands
                holder["error"] = error
        load_thread = threading.Thread(target=drive, daemon=True)
        load_thread.start()
        time.sleep(1.0)
    report = run_profile(pid, duration_s, out_dir, model, rate)
    if load_thread is not None:
        load_thread.join(timeout=duration_s + 60)
        if "result" in holder:
            holder["result"].save(out_dir / "load.json")
            report.files.append("load.json")
        elif "error" in holder:
            report.problems.append(f"load during the profile failed: {holder['error']}")
    click.echo(f"profiled {len(report.processes)} process(es) for {duration_s:g} s: "
               + ", ".join(f"{p.role} {p.name} ({p.pid})" for p in report.processes))
    for counter in report.perf_counters:
        click.echo(f"  perf stat {counter['event']:<18} {counter['value']:>16,.0f} {counter['unit']}")
    if report.not_supported:
        click.echo(f"  not supported here: {', '.join(report.not_supported)}")
    for problem in report.problems:
        click.echo(f"  {problem}")
    click.echo(f"wrote {out_dir}: {', '.join(report.files + ['profile.json'])}")


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


# --- bench crosscheck ---------------------------------------------------------------------------
@click.command("crosscheck")
@click.option("--model", default="mlp_classifier", show_default=True)
@click.option("--http-url", default=None, help="A running server's HTTP address  [default: start the demo server]")
@click.option("--grpc-url", default=None, help="A running server's gRPC address  [default: start the demo server]")
@click.option("--concurrency", default="1,4", show_default=True)
@click.option("--repeats", default=2, show_default=True, help="Alternating runs of each side.")
@click.option("--seconds", default=6.0, show_default=True, help="Measured seconds per run.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=Path("bench-results/crosscheck.json"),
              show_default=True)
@bench_errors
def crosscheck(model: str, http_url: Optional[str], grpc_url: Optional[str], concurrency: str, repeats: int,
               seconds: float, json_path: Path) -> None:
    """`bench model` against a plain tritonclient loop, alternately, on the same server and model."""
    from dspark.bench.crosscheck import run_crosscheck
    from dspark.bench.model import parse_levels

    levels = [int(v) for v in parse_levels(concurrency)]
    server = None
    if not (http_url or grpc_url):
        from dspark.paths import demo_repositories
        from dspark.server.launcher import TritonServer

        server = TritonServer(demo_repositories(), model_control="explicit", load_models=[model])
        server.start()
        http_url, grpc_url = server.http_url, server.grpc_url
    try:
        urls = {p: u for p, u in (("http", http_url), ("grpc", grpc_url)) if u}
        emit(run_crosscheck(urls, model, levels, repeats, seconds, log=progress_log), json_path)
    finally:
        if server is not None:
            server.stop()


COMMANDS = [
    model, system, compare, profile, bench_all, crosscheck,
    kernels.bench_kernels, kernels.bench_pool, kernels.bench_gemm, kernels.micro,
    bench_spec.spec, bench_spec.shapes, bench_spec.openai, bench_spec.llm_quality,
    bench_router.router, bench_rollout.rollout_bench, bench_prefix.prefix,
]
for command in COMMANDS + runs.COMMANDS:
    bench.add_command(command)
