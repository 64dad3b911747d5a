"""`dspark route`: show and change a QoS router's routing on a running server.

The router re-reads ``routing.yaml`` in its model directory when the file changes, so ``set``
edits that file atomically (validated first, version number bumped) and, given the server's
metrics URL, waits until the router reports the new version in effect. No restart; requests in
flight and queued keep going.
"""

from __future__ import annotations

import re
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import click

from dspark.errors import ConfigError

# the repository, routing and parameter modules (protobuf, pydantic, yaml) are imported by the
# commands that use them, so other commands' start-up does not pay for them

_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def router_files(repository: Path, model: str) -> tuple[Path, set[int] | None]:
    """The routing file of a router model and the target versions it may route to."""
    from dspark.params import parse_parameters
    from dspark.repository.modelspec import load_config
    from dspark.triton.params import RouterParameters

    config_path = repository / model / "config.pbtxt"
    if not config_path.is_file():
        raise click.ClickException(f"--model: no {config_path}; is '{model}' a model in {repository}?")
    config = load_config(config_path)
    if config.backend != "qos_router":
        raise click.ClickException(f"--model: '{model}' uses backend '{config.backend}', not qos_router")
    try:
        params = parse_parameters(RouterParameters, {k: v.string_value for k, v in config.parameters.items()})
        return params.routing_path(repository / model), params.versions()
    except ConfigError as exc:
        raise click.ClickException(f"{config_path}: {exc}") from None


def read_metrics(url: str, model: str) -> list[tuple[str, dict[str, str], float]]:
    """The router's samples (name, labels, value) from Triton's /metrics text."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or not match["name"].startswith("dspark_router_"):
            continue
        labels = dict(_LABEL.findall(match["labels"] or ""))
        if labels.get("model") == model:
            samples.append((match["name"], labels, float(match["value"])))
    return samples


def _pairs(option: str, values: tuple[str, ...], key_type=str) -> dict:
    out = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep:
            raise click.BadParameter(f"expected KEY=VALUE, got '{item}'", param_hint=option)
        try:
            out[key_type(key)] = float(value)
        except ValueError:
            raise click.BadParameter(f"'{item}': not a number", param_hint=option) from None
    return out


def _number(option: str, text: str, word: str = "auto") -> int:
    try:
        return int(text)
    except ValueError:
        raise click.BadParameter(f"'{text}': expected '{word}' or a whole number", param_hint=option) from None


def _common(function):
    function = click.option("--metrics-url", default=None,
                            help="Server's metrics URL (e.g. http://127.0.0.1:8002/metrics) to show live state.")(function)
    function = click.option("--model", "-m", default="router_demo", show_default=True,
                            help="The router model.")(function)
    function = click.option("--repository", "-r", type=click.Path(path_type=Path), default=Path("model_repository"),
                            show_default=True, help="Model repository holding the router.")(function)
    return function


@click.group()
def route() -> None:
    """Show or change a QoS router's shares, shadow and tier weights (live, no restart)."""


@route.command()
@_common
def show(repository: Path, model: str, metrics_url: str | None) -> None:
    """Print the routing file and, with --metrics-url, what the running router reports."""
    from dspark.routing.config import load_routing

    path, versions = router_files(repository, model)
    try:
        config = load_routing(path, versions)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{path} (version {config.version}; routable target versions {sorted(versions)})")
    click.echo("shares:  " + ", ".join(f"v{v} {s:g}%" for v, s in sorted(config.shares.items())))
    sh = config.shadow
    click.echo("shadow:  " + (f"v{sh.version} {sh.percent:g}% (atol {sh.atol:g}, rtol {sh.rtol:g})"
                                if sh.version is not None and sh.percent > 0 else "off"))
    click.echo("fallback: " + (f"v{config.fallback_version} answers failed calls to other versions"
                               if config.fallback_version is not None else "none"))
    click.echo(f"max_inflight {config.max_inflight} (+{config.top_tier_headroom} for {config.top_tier}), "
               f"default tier {config.default_tier}, "
               f"fast path while the target answers within {config.inline_max_ms:g} ms")
    click.echo(f"{'tier':<10} {'base':>6} {'deadline_ms':>12} {'timeout_ms':>11} {'max_queue':>10}")
    for name, tier in config.tiers.items():
        click.echo(f"{name:<10} {tier.weight:>6g} {tier.deadline_ms:>12g} {1000 * tier.call_timeout_s:>11g} "
                   f"{tier.max_queue:>10}")
    if metrics_url:
        samples = read_metrics(metrics_url, model)
        live = [int(v) for n, _, v in samples if n == "dspark_router_config_version"]
        click.echo(f"running router: config version {live[0] if live else 'unknown (not loaded?)'}")
        weights = {l["tier"]: v for n, l, v in samples if n == "dspark_router_tier_weight"}
        factors = {l["tier"]: v for n, l, v in samples if n == "dspark_router_fluctuation_factor"}
        for tier in weights:
            click.echo(f"  {tier:<10} weight {weights[tier]:.3g}  f {factors.get(tier, 0):+.3f}")
        for n, l, v in samples:
            if n == "dspark_router_rejections_total":
                click.echo(f"  rejected {l['tier']}/{l['reason']}: {v:g}")


@route.command(name="set")
@_common
@click.option("--share", "shares", multiple=True, metavar="VERSION=PERCENT",
              help="Canary share of a target version (repeat; shares must sum to 100).")
@click.option("--shadow-version", type=int, default=None, help="Version that receives shadow copies.")
@click.option("--shadow-percent", type=float, default=None, help="Share of requests copied to the shadow (0 = off).")
@click.option("--shadow-atol", type=float, default=None, help="Absolute tolerance of the shadow comparison.")
@click.option("--shadow-rtol", type=float, default=None, help="Relative tolerance of the shadow comparison.")
@click.option("--weight", "weights", multiple=True, metavar="TIER=WEIGHT", help="Base weight of a tier (repeat).")
@click.option("--deadline-ms", "deadlines", multiple=True, metavar="TIER=MS", help="Queue deadline of a tier (repeat).")
@click.option("--max-inflight", default=None, metavar="auto|N",
              help="Concurrent calls to the target for every tier ('auto': the target's instance count).")
@click.option("--top-tier-headroom", type=int, default=None,
              help="Further concurrent calls only the top tier may use.")
@click.option("--inline-max-ms", type=float, default=None,
              help="Fast path (idle router forwards from execute) while the target answers within this; 0 = off.")
@click.option("--fallback-version", default=None, metavar="N|none",
              help="Version that answers a request whose call to another version failed ('none': the client "
                   "gets the failure).")
@click.option("--wait-s", type=float, default=10.0, show_default=True,
              help="With --metrics-url: how long to wait for the router to report the new version.")
def set_(repository: Path, model: str, metrics_url: str | None, shares, shadow_version, shadow_percent,
         shadow_atol, shadow_rtol, weights, deadlines, max_inflight, top_tier_headroom, inline_max_ms,
         fallback_version, wait_s) -> None:
    """Change routing; the running router applies it within about half a second."""
    from dspark.routing.config import RoutingConfig, load_routing, update_routing

    path, versions = router_files(repository, model)
    try:
        config = load_routing(path, versions) if path.exists() else RoutingConfig()
        changes = {}
        new_shares = _pairs("--share", shares, int)
        if new_shares:
            changes["shares"] = new_shares
        shadow = config.shadow
        for field, value in (("version", shadow_version), ("percent", shadow_percent),
                             ("atol", shadow_atol), ("rtol", shadow_rtol)):
            if value is not None:
                shadow = replace(shadow, **{field: value})
        tiers = dict(config.tiers)
        for option, values, field in (("--weight", weights, "weight"), ("--deadline-ms", deadlines, "deadline_ms")):
            for tier, value in _pairs(option, values).items():
                if tier not in tiers:
                    raise click.BadParameter(f"unknown tier '{tier}' (tiers: {', '.join(tiers)})", param_hint=option)
                tiers[tier] = replace(tiers[tier], **{field: value})
        if max_inflight is not None:
            changes["max_inflight"] = max_inflight if max_inflight == "auto" else _number("--max-inflight", max_inflight)
        if fallback_version is not None:
            changes["fallback_version"] = (None if fallback_version.lower() == "none"
                                           else _number("--fallback-version", fallback_version, "none"))
        for key, value in (("top_tier_headroom", top_tier_headroom), ("inline_max_ms", inline_max_ms)):
            if value is not None:
                changes[key] = value
        config = update_routing(path, versions, shadow=shadow, tiers=tiers, **changes)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote {path} (version {config.version})")
    if not metrics_url:
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        live = [v for n, _, v in read_metrics(metrics_url, model) if n == "dspark_router_config_version"]
        if live and live[0] >= config.version:
            click.echo(f"router '{model}' runs config version {config.version}")
            return
        time.sleep(0.2)
    click.echo(f"router '{model}' did not report version {config.version} within {wait_s:g} s; "
               "check the server log for 'routing file rejected'", err=True)
    sys.exit(1)
