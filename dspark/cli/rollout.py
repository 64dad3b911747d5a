"""`dspark rollout`: staged model updates (shadow, canary, promotion, automatic rollback) on one
Triton server or a fleet. The work is done by ``dspark.rollout``; these commands parse options,
hold the per-model lock and print. Exit status of ``run``/``recover``: 0 promoted, 3 rolled back,
4 no rollout of the model in progress (``recover``, ``rollback``, ``promote``, ``pause``,
``resume``), 1 any failure (the lock held, a server unreachable, the state file unusable), 2 a
wrong command line."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import click

from dspark.errors import DsparkError

if TYPE_CHECKING:
    from dspark.rollout.state import StateStore
# dspark.rollout (tritonclient, psutil, yaml) is imported by the commands that use it, so other
# commands' start-up does not pay for it

ROLLED_BACK_EXIT = 3
# distinct from every failure, so the Kubernetes Job starts `run` only when there is truly nothing
# to recover (exit 1 was both, and a state volume it could not write sent it on to `run`)
NOTHING_IN_PROGRESS_EXIT = 4


def _state_option(function):
    return click.option("--state", "state_path", type=click.Path(path_type=Path), default=None,
                        help="The rollout state file (SQLite). Default: $DSPARK_ROLLOUT_STATE or "
                             "~/.local/state/dspark/rollout.sqlite.")(function)


def _key_option(function):
    return click.option("--api-key", envvar="DSPARK_API_KEY", default=None,
                        help="Key for the servers' model-repository API (header dspark-api-key); "
                             "default $DSPARK_API_KEY.")(function)


def _fleet_options(function):
    for decorator in reversed([
        click.option("--server", "-s", "servers", multiple=True,
                     help="A server's HTTP endpoint, e.g. http://10.0.0.5:8000 (repeat for a fleet)."),
        click.option("--metrics-url", "metrics_urls", multiple=True,
                     help="Each server's metrics URL, in --server order (default: HTTP port + 2)."),
        click.option("--grpc-url", "grpc_urls", multiple=True,
                     help="Each server's gRPC host:port, in --server order, which loads go by "
                          "(default: HTTP port + 1)."),
        click.option("--servers-file", type=click.Path(path_type=Path, exists=True), default=None,
                     help="A file of endpoints: one 'URL [METRICS_URL]' a line, or a YAML list (pod IPs)."),
        click.option("--servers-dns", "servers_dns", multiple=True,
                     help="HOST:PORT whose every address is a server, e.g. a headless Service's name."),
    ]):
        function = decorator(function)
    return function


def _open_state(path: Optional[Path]) -> StateStore:
    from dspark.rollout.state import StateStore, default_state_path

    try:
        return StateStore(path or default_state_path())
    except DsparkError as error:
        _fail(error)


def _fail(error: Exception) -> None:
    raise click.ClickException(str(error)) from None


@click.group()
def rollout() -> None:
    """Roll a new model version out: shadow, canary steps, analysis, promotion or rollback."""


@rollout.command()
@click.argument("model")
@click.argument("artifact", type=click.Path(path_type=Path, exists=True))
@click.option("--version", "semver", required=True, help="Semantic version of the artifact, e.g. 1.3.0.")
@click.option("--repository", "-r", default="model_repository", show_default=True,
              help="The repository the servers share: a folder or s3://[host:port/]bucket/path.")
@click.option("--router", default=None, help="The QoS router in front of MODEL (shadow and canary need one).")
@click.option("--routing-file", default=None,
              help="The router's routing.yaml: a path, or an s3:// object the fleet's pods sync "
                   "(default: REPOSITORY/ROUTER/routing.yaml).")
@_fleet_options
@click.option("--prometheus", default=None, help="Read metrics from this Prometheus (http://host:9090) "
                                                 "instead of each server's /metrics.")
@click.option("--plan", "plan_path", type=click.Path(path_type=Path), default=None,
              help="Plan YAML (steps, analysis thresholds); default: the built-in plan.")
@_state_option
@_key_option
def run(model, artifact, semver, repository, router, routing_file, servers, metrics_urls, grpc_urls, servers_file,
        servers_dns, prometheus, plan_path, state_path, api_key) -> None:
    """Publish ARTIFACT as version SEMVER of MODEL and roll it out by the plan."""
    from dspark.rollout.deployment import Deployment
    from dspark.rollout.fleet import read_endpoints
    from dspark.rollout.plan import Plan

    try:
        plan = Plan.load(plan_path)
        deployment = Deployment(model, router, repository,
                                read_endpoints(servers, metrics_urls, servers_file, servers_dns, grpc_urls), routing_file,
                                prometheus)
    except DsparkError as error:
        _fail(error)
    _drive(deployment, plan, _open_state(state_path), api_key, lambda c: c.start(artifact, semver))


@rollout.command()
@click.argument("model")
@click.option("--rollback", "roll_back", is_flag=True, help="Roll the interrupted rollout back instead of finishing it.")
@_state_option
@_key_option
def recover(model, roll_back, state_path, api_key) -> None:
    """Finish (or --rollback) a rollout whose controller was stopped or killed."""
    state, active = _active(state_path, model)
    _drive_recorded(active, state, api_key, roll_back)


def _active(state_path: Optional[Path], model: str):
    """The state file and the rollout of ``model`` in progress (an error when there is none)."""
    state = _open_state(state_path)
    active = state.active(model)
    if active is None:
        click.echo(f"no rollout of '{model}' in progress (exit {NOTHING_IN_PROGRESS_EXIT})", err=True)
        sys.exit(NOTHING_IN_PROGRESS_EXIT)
    return state, active


def _drive_recorded(active, state: StateStore, api_key, roll_back: bool) -> None:
    """Recover a rollout with the deployment and plan it recorded when it started."""
    from dspark.rollout.deployment import Deployment
    from dspark.rollout.plan import Plan

    settings = active.settings
    _drive(Deployment.from_settings(settings["deployment"]), Plan.from_dict(settings["plan"]), state,
           api_key, lambda c: c.recover(roll_back))


def _drive(deployment, plan, state: StateStore, api_key, action) -> None:
    from dspark.rollout.controller import Controller

    controller = None
    try:
        controller = Controller(deployment, plan, state, api_key, say=lambda line: click.echo(line))
        outcome = action(controller)  # holds the model's lock while it runs
    except DsparkError as error:
        _fail(error)
    finally:
        if controller is not None:
            controller.close()
    if not outcome.promoted:
        click.echo(f"rolled back: {outcome.reason}", err=True)
        sys.exit(ROLLED_BACK_EXIT)
    click.echo(f"promoted: {deployment.model} {outcome.rollout.semver} (version {outcome.rollout.new_version})")


def _command(name: str, help_text: str):
    @rollout.command(name=name, help=help_text)
    @click.argument("model")
    @click.option("--reason", default=None, help="Recorded with the command.")
    @_state_option
    @_key_option
    def command(model, reason, state_path, api_key) -> None:
        from dspark.rollout.state import ModelLock

        state, active = _active(state_path, model)
        running = ModelLock(state.path, model).held_by_other()
        if running:
            state.send(model, name, reason)
            click.echo(f"{name}: sent to the controller of rollout #{active.id}")
            return
        if name in ("pause", "resume"):
            state.update(active.id, paused=name == "pause")
            click.echo(f"rollout #{active.id} {name}d (no controller runs: `dspark rollout recover {model}` goes on)")
        elif name == "rollback":
            state.update(active.id, reason=f"rolled back by hand{': ' + reason if reason else ''}")
            _drive_recorded(active, state, api_key, roll_back=True)
        else:
            _fail(click.ClickException(f"no controller is running rollout #{active.id}: "
                                       f"`dspark rollout recover {model}` goes on from phase '{active.phase}'"))
    return command


_command("rollback", "Roll the rollout of MODEL back now (traffic to the current version, new one unloaded).")
_command("promote", "Skip the remaining steps: promote the new version of MODEL now.")
_command("pause", "Hold the rollout of MODEL at its current step (analysis and rollback go on).")
_command("resume", "Let a paused rollout of MODEL go on.")


@rollout.command()
@click.argument("model", required=False)
@_fleet_options
@click.option("--window", default=1.0, show_default=True, help="Seconds over which live rates are measured.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@_state_option
@_key_option
def status(model, servers, metrics_urls, grpc_urls, servers_file, servers_dns, window, as_json, state_path,
           api_key) -> None:
    """Versions per server, traffic shares, health, live metrics and the rollout in progress."""
    from dspark.rollout import status as status_report
    from dspark.rollout.fleet import read_endpoints

    state = _open_state(state_path)
    try:
        given = servers or servers_file or servers_dns
        endpoints = read_endpoints(servers, metrics_urls, servers_file, servers_dns, grpc_urls) if given else None
        report = status_report.collect(state, model, endpoints, api_key, window)
    except DsparkError as error:
        _fail(error)
    click.echo(json.dumps(report, indent=2) if as_json else status_report.render(report))


@rollout.command()
@click.argument("model", required=False)
@click.option("--limit", default=20, show_default=True)
@click.option("--events", "event_id", type=int, default=None, help="Show the events of rollout #ID.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@_state_option
def history(model, limit, event_id, as_json, state_path) -> None:
    """Past rollouts: versions, outcome, reason, duration (or one rollout's events)."""
    from dspark.rollout import status as status_report

    state = _open_state(state_path)
    if event_id is not None:
        events = state.events(event_id)
        if as_json:
            click.echo(json.dumps(events, indent=2))
        for event in events if not as_json else ():
            click.echo(f"{event['at']}  {event['kind']:<9} {event['message']}")
        return
    rows = status_report.history_rows(state.history(model, limit))
    click.echo(json.dumps(rows, indent=2) if as_json else status_report.render_history(rows))


@rollout.command(name="sync-routing")
@click.argument("source")
@click.argument("destination", type=click.Path(path_type=Path))
@click.option("--interval", "interval_s", default=1.0, show_default=True, help="Seconds between checks.")
@click.option("--once", is_flag=True, help="Copy once and exit.")
def sync_routing(source, destination, interval_s, once) -> None:
    """Keep DESTINATION equal to the S3 object SOURCE (a pod's sidecar: the router there reads
    the routing file a controller writes to S3 once for the whole fleet)."""
    from dspark.rollout.store import sync_file

    try:
        sync_file(source, destination, interval_s, once)
    except DsparkError as error:
        _fail(error)
