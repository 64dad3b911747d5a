"""Routing config: file format, validation messages naming the field, watching for changes."""

import os
import time
from pathlib import Path

import pytest

from dspark.errors import ConfigError
from dspark.routing.config import ConfigWatcher, RoutingConfig, TierPolicy

EXAMPLE = """
version: 3
default_tier: gold
max_inflight: 6
tiers:
  diamond: {weight: 8, deadline_ms: 200}
  gold: {weight: 3, deadline_ms: 500, max_queue: 50}
fluctuation: {window_s: 5, short_window_s: 0.5, min: -0.25, max: 2}
shares: {1: 80, 2: 20}
shadow: {version: 2, percent: 5, atol: 0.001, ignore_outputs: [version]}
"""


def test_load_and_round_trip(tmp_path):
    path = tmp_path / "routing.yaml"
    path.write_text(EXAMPLE)
    cfg = RoutingConfig.load(path, allowed_versions={1, 2})
    assert cfg.version == 3 and cfg.default_tier == "gold" and cfg.max_inflight == 6
    assert cfg.tiers["gold"].max_queue == 50 and cfg.tiers["diamond"].deadline_ms == 200
    assert cfg.shares == {1: 80.0, 2: 20.0}
    assert cfg.shadow.version == 2 and cfg.shadow.atol == 0.001
    assert cfg.fluctuation.min == -0.25 and cfg.shadow.ignore_outputs == ("version",)
    assert cfg.inline_max_ms == 5.0  # the default
    cfg.save(path)
    assert RoutingConfig.load(path) == cfg


@pytest.mark.parametrize("text, field", [
    ("shares: {1: 80, 2: 30}", "shares: percentages must sum to 100"),
    ("shares: {1: 50, 7: 50}", "shares: version 7 is not a routable version"),
    ("tiers: {gold: {weight: 0, deadline_ms: 5}}\ndefault_tier: gold", "tiers.gold.weight"),
    ("tiers: {gold: {weight: 1, deadline_ms: 5, colour: 3}}", "tiers.gold.colour: unknown field"),
    ("default_tier: platinum", "default_tier: 'platinum' is not one of the tiers"),
    ("max_inflight: -1", "max_inflight: must be 'auto' (the target's instance count) or a whole number from 1 to 256, got -1"),
    ("max_inflight: many", "max_inflight: must be 'auto'"),
    ("max_inflight: 2.7", "max_inflight: must be 'auto' (the target's instance count) or a whole number from 1 to 256, got 2.7"),
    ("tiers: {gold: {weight: .inf, deadline_ms: 5}}\ndefault_tier: gold", "tiers.gold.weight: Input should be a finite number"),
    ("tiers: {gold: {weight: .nan, deadline_ms: 5}}\ndefault_tier: gold", "tiers.gold.weight: Input should be a finite number"),
    ("tiers: {gold: {weight: -2, deadline_ms: 5}}\ndefault_tier: gold", "tiers.gold.weight: Input should be greater than 0"),
    ("tiers: {gold: {weight: true, deadline_ms: 5}}\ndefault_tier: gold", "tiers.gold.weight: Input should be a valid number"),
    ("tiers: {gold: {weight: 1, deadline_ms: 5, max_queue: 2.5}}\ndefault_tier: gold", "tiers.gold.max_queue: Input should be a valid integer"),
    ("tiers: {gold: {weight: 1, deadline_ms: 5, timeout_ms: 0}}\ndefault_tier: gold", "tiers.gold.timeout_ms: Input should be greater than 0"),
    ("tiers: {gold: {weight: 1, deadline_ms: 5, timeout_ms: 1.0e+308}}\ndefault_tier: gold",
     "tiers.gold.timeout_ms: Input should be less than or equal to 86400000"),
    ("tiers: {gold: {weight: 1, deadline_ms: 1.0e+308}}\ndefault_tier: gold",
     "tiers.gold.deadline_ms: Input should be less than or equal to 86400000"),
    ("tiers: {gold: {weight: 1.0e+308, deadline_ms: 5}}\ndefault_tier: gold",
     "tiers.gold.weight: Input should be less than or equal to 1000000"),
    ("fluctuation: {max: 1.0e+308}", "fluctuation.max: Input should be less than or equal to 100"),
    ("max_inflight: 99999999999", "max_inflight: must be 'auto' (the target's instance count) or a whole number from 1 to 256, got 99999999999"),
    ("top_tier_headroom: 1000", "top_tier_headroom: Input should be less than or equal to 256"),
    ("cancel_check_ms: 1.0e+308", "cancel_check_ms: Input should be less than or equal to 86400000"),
    ("top_tier_headroom: 0.5", "top_tier_headroom: Input should be a valid integer"),
    ("inline_max_ms: -1", "inline_max_ms: Input should be greater than or equal to 0"),
    ("shares: {1: .nan}", r"shares[1]: Input should be a finite number"),
    ("shares: {one: 100}", "shares: key 'one': Input should be a valid integer"),
    ("[1, 2]", "the routing file must be a mapping of fields (tiers, default_tier, max_inflight"),
    ("42", "the routing file must be a mapping of fields"),
    ("{1: 2, version: 3}", "1: unknown field (known: tiers, "),
    ("tiers: {7: {weight: 1, deadline_ms: 5}}", "tiers: key 7: Input should be a valid string"),
    ("fluctuation: {min: -1.5}", "fluctuation.min"),
    ("fluctuation: {short_window_s: 20}", "fluctuation.short_window_s"),
    ("shadow: {percent: 10}", "shadow.version: required"),
    ("shadow: {version: 9, percent: 10}", "shadow.version: version 9"),
    ("shadow: {version: 2, percent: 150}", "shadow.percent"),
    ("colour: red", "colour: unknown field"),
    ("fallback_version: 9", "fallback_version: version 9 is not a routable version of the target (allowed: [1, 2])"),
    ("fallback_version: two", "fallback_version: Input should be a valid integer"),
    ("shares: [1, 2]", "shares: Input should be a valid dictionary (got [1, 2])"),
    ("tiers: {gold: {weight: 1", "not valid YAML"),
    ("version: " + "9" * 400, "version: Input should be less than or equal to 9007199254740991"),
    ("version: 9007199254740993", "version: Input should be less than or equal to 9007199254740991"),
    ("version: -1", "version: Input should be greater than or equal to 0"),
])
def test_bad_config_names_the_field(tmp_path, text, field):
    path = tmp_path / "routing.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        RoutingConfig.load(path, allowed_versions={1, 2})
    assert field in str(info.value)
    assert str(info.value).startswith(f"{path}: ")


def test_not_utf8_names_the_byte(tmp_path):
    path = tmp_path / "routing.yaml"
    path.write_bytes(b"version: 1\ndefault_tier: st\xe4ndard\n")
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 27: b'\\xe4'\); save the file as UTF-8"):
        RoutingConfig.load(path)


def test_watcher_reloads_on_change_and_keeps_last_good(tmp_path):
    path = tmp_path / "routing.yaml"
    path.write_text(EXAMPLE)
    watcher = ConfigWatcher(path, {1, 2})
    assert watcher.poll() is None
    new = RoutingConfig.from_dict({"shares": {1: 50, 2: 50}, "version": 4}).validate()
    new.save(path)
    got = watcher.poll()
    assert got is not None and got.shares == {1: 50.0, 2: 50.0} and watcher.config.version == 4
    path.write_text("shares: {1: 10}\n")
    os.utime(path, ns=(1, 1))
    assert watcher.poll() is None
    assert "shares: percentages must sum to 100" in watcher.last_error
    assert watcher.config.version == 4


@pytest.mark.parametrize("garbage, why", [
    (b"- 1\n- 2\n", "must be a mapping of fields"),
    (b"just a string\n", "must be a mapping of fields"),
    (b"{1: 2, version: 3}\n", "1: unknown field"),
    (b"\xff\xfe\x00 not text", "not UTF-8 text"),
    (b"tiers: [", "not valid YAML"),
])
def test_watcher_survives_any_file_and_applies_the_next_valid_one(tmp_path, garbage, why):
    path = tmp_path / "routing.yaml"
    path.write_text(EXAMPLE)
    watcher = ConfigWatcher(path, {1, 2})
    path.write_bytes(garbage)
    os.utime(path, ns=(10**9, 10**9))
    assert watcher.poll() is None and why in watcher.last_error
    assert watcher.config.version == 3, "the last good config stays"
    RoutingConfig(shares={2: 100.0}, version=9).save(path)
    assert watcher.poll().version == 9 and watcher.config.shares == {2: 100.0}


DEMO_ROUTING = (Path(__file__).parents[3] / "model_repository" / "router_demo" / "routing.yaml").read_bytes()


@pytest.mark.parametrize("text, why", [
    (b"", "has no fields (empty, only comments, or cut short while being written)"),
    (b"\n  \n", "has no fields"),
    (DEMO_ROUTING[:40], "has no fields"),  # the demo's file cut inside its first (comment) line
    (b"version: 1\n" + b"# padding\n" * 1_100_000, "larger than 64 KiB, the most a routing file may be"),
])
def test_an_empty_truncated_or_huge_routing_file_is_rejected_and_the_last_good_config_stays(tmp_path, text, why):
    path = tmp_path / "routing.yaml"
    path.write_text(EXAMPLE)
    watcher = ConfigWatcher(path, {1, 2})
    path.write_bytes(text)
    os.utime(path, ns=(10**9, 10**9))
    started = time.monotonic()
    assert watcher.poll() is None and why in watcher.last_error
    assert time.monotonic() - started < 0.5, "a huge file is refused without parsing it"
    assert watcher.config.version == 3, "the last good config stays"
    with pytest.raises(ConfigError) as info:
        RoutingConfig.load(path)
    assert str(info.value).startswith(f"{path}: {why}")


def test_update_routing_bumps_the_version_and_validates(tmp_path):
    from dspark.routing.config import ShadowPolicy, load_routing, update_routing

    path = tmp_path / "routing.yaml"
    path.write_text(EXAMPLE)
    new = update_routing(path, {1, 2}, shares={1: 50, 2: 50}, shadow=ShadowPolicy(version=2, percent=10))
    assert (new.version, new.shares, new.shadow.percent) == (4, {1: 50.0, 2: 50.0}, 10.0)
    assert load_routing(path, {1, 2}) == new
    with pytest.raises(ConfigError, match="shares: version 9 is not a routable version"):
        update_routing(path, {1, 2}, shares={9: 100})
    with pytest.raises(ConfigError, match="tiers.gold.weight: Input should be a finite number"):
        update_routing(path, {1, 2}, tiers={"gold": TierPolicy(weight=float("inf"), deadline_ms=5)})
    assert load_routing(path, {1, 2}).version == 4, "nothing written for a rejected change"


def test_the_highest_routing_version_is_exact_as_a_gauge_and_is_not_bumped_past(tmp_path):
    """The router exports the version as a gauge (a double) that rollouts compare: every version
    a file may hold is exact there, and `route set` on the highest says so instead of writing it."""
    from dspark.routing.config import MAX_CONFIG_VERSION, load_routing, update_routing

    path = tmp_path / "routing.yaml"
    path.write_text(f"version: {MAX_CONFIG_VERSION}\n")
    assert load_routing(path).version == MAX_CONFIG_VERSION
    assert float(MAX_CONFIG_VERSION) == MAX_CONFIG_VERSION and float(MAX_CONFIG_VERSION + 2) != MAX_CONFIG_VERSION + 2
    with pytest.raises(ConfigError, match=r"version: is 9007199254740991, the highest a routing version may be"):
        update_routing(path, shares={1: 100})
    assert load_routing(path).version == MAX_CONFIG_VERSION, "nothing written"


def test_missing_file_means_defaults(tmp_path):
    watcher = ConfigWatcher(tmp_path / "routing.yaml")
    assert watcher.config.shares == {1: 100.0}
    assert set(watcher.config.tiers) == {"diamond", "gold", "standard"}


def test_route_set_changes_the_fast_path_threshold(tmp_path):
    import shutil

    from click.testing import CliRunner

    from dspark.cli.route import route
    from dspark.paths import project_root

    shutil.copytree(project_root() / "model_repository" / "router_demo", tmp_path / "router_demo")
    result = CliRunner().invoke(route, ["set", "-r", str(tmp_path), "-m", "router_demo", "--inline-max-ms", "0"])
    assert result.exit_code == 0, result.output
    assert RoutingConfig.load(tmp_path / "router_demo" / "routing.yaml").inline_max_ms == 0
    shown = CliRunner().invoke(route, ["show", "-r", str(tmp_path), "-m", "router_demo"])
    assert "fast path while the target answers within 0 ms" in shown.output


def test_route_set_names_and_clears_the_fallback_version(tmp_path):
    import shutil

    from click.testing import CliRunner

    from dspark.cli.route import route
    from dspark.paths import project_root

    shutil.copytree(project_root() / "model_repository" / "router_demo", tmp_path / "router_demo")
    path = tmp_path / "router_demo" / "routing.yaml"
    result = CliRunner().invoke(route, ["set", "-r", str(tmp_path), "-m", "router_demo", "--fallback-version", "1"])
    assert result.exit_code == 0, result.output
    assert RoutingConfig.load(path).fallback_version == 1
    shown = CliRunner().invoke(route, ["show", "-r", str(tmp_path), "-m", "router_demo"])
    assert "fallback: v1 answers failed calls to other versions" in shown.output
    result = CliRunner().invoke(route, ["set", "-r", str(tmp_path), "-m", "router_demo", "--fallback-version", "none"])
    assert result.exit_code == 0 and RoutingConfig.load(path).fallback_version is None


@pytest.mark.parametrize("option, value, message", [
    ("--fallback-version", "9", "fallback_version: version 9 is not a routable version of the target (allowed: [1, 2])"),
    ("--max-inflight", "99999999999", "max_inflight: must be 'auto' (the target's instance count) or a whole number from 1 to 256"),
    ("--weight", "gold=1e308", "tiers.gold.weight: Input should be less than or equal to 1000000"),
    ("--deadline-ms", "gold=1e308", "tiers.gold.deadline_ms: Input should be less than or equal to 86400000"),
])
def test_route_set_refuses_a_huge_value_naming_the_field(tmp_path, option, value, message):
    import shutil

    from click.testing import CliRunner

    from dspark.cli.route import route
    from dspark.paths import project_root

    shutil.copytree(project_root() / "model_repository" / "router_demo", tmp_path / "router_demo")
    before = (tmp_path / "router_demo" / "routing.yaml").read_text()
    result = CliRunner().invoke(route, ["set", "-r", str(tmp_path), "-m", "router_demo", option, value])
    assert result.exit_code == 1 and message in result.output
    assert (tmp_path / "router_demo" / "routing.yaml").read_text() == before


@pytest.mark.parametrize("raw, tier, user", [
    (None, None, None),
    ("", None, None),
    ('{"tier": "gold", "user_id": "alice"}', "gold", "alice"),
    ('{"dspark-tier": "diamond", "dspark-user-id": 42}', "diamond", "42"),
    ('{"tier": "gold", "dspark-tier": "diamond"}', "gold", None),  # a parameter wins over a header
    ('{"tier": "", "dspark-tier": "diamond", "other": [1, 2]}', "diamond", None),
    ('{"Dspark-Tier": "diamond", "DSPARK-USER-ID": "bob"}', "diamond", "bob"),  # header names: any case
    ('{"Tier": "gold"}', None, None),  # a parameter's name is the client's own: exact
])
def test_request_parameters(raw, tier, user):
    from dspark.routing.request import route_fields

    fields = route_fields(raw)
    assert (fields.tier, fields.user_id) == (tier, user)


@pytest.mark.parametrize("raw, message", [
    ('{"tier": 5}', "parameters.tier: Input should be a valid string (got 5)"),
    ('{"dspark-tier": true}', "parameters.dspark-tier: Input should be a valid string (got True)"),
    ('{"user_id": 1.5}', "parameters.user_id: Input should be a valid string (got 1.5)"),
    ('[1, 2]', "parameters: Input should be a valid dictionary"),
    ('{"tier": ', "parameters: not valid JSON"),
])
def test_bad_request_parameters_name_the_field(raw, message):
    from dspark.errors import RequestError
    from dspark.routing.request import route_fields

    with pytest.raises(RequestError) as info:
        route_fields(raw)
    assert message in str(info.value) and info.value.code == "INVALID_ARG"


def test_router_parameters_name_the_bad_one(tmp_path):
    from dspark.params import parse_parameters as parse_config
    from dspark.triton.params import RouterParameters

    params = parse_config(RouterParameters, {"target_model": "t", "target_versions": "1, 2", "routing_file": "r.yaml"})
    assert (params.routing_path(tmp_path), params.versions()) == (tmp_path / "r.yaml", {1, 2})
    assert params.poll_interval_ms == 500
    assert parse_config(RouterParameters, {"target_model": "t", "poll_interval_ms": "100"}).poll_interval_ms == 100
    with pytest.raises(ConfigError, match="parameter 'poll_interval_ms'.*greater than or equal to 10"):
        parse_config(RouterParameters, {"target_model": "t", "poll_interval_ms": "1"})
    assert parse_config(RouterParameters, {"target_model": "t", "target_versions": "*"}).versions() is None
    with pytest.raises(ConfigError, match="parameter 'target_versions': must list version numbers, e.g. \"1,2\", or \"\\*\" for any; got '1,x'"):
        parse_config(RouterParameters, {"target_model": "t", "target_versions": "1,x"}).versions()
    with pytest.raises(ConfigError, match="parameter 'target_model'"):
        parse_config(RouterParameters, {"target_versions": "1"})
    with pytest.raises(ConfigError, match="parameter 'routing_fle': is not a parameter of this backend; did you mean 'routing_file'"):
        parse_config(RouterParameters, {"target_model": "t", "routing_fle": "r.yaml"})


def test_the_request_side_routing_fields_have_names_of_their_own():
    """The router's config parameters (dspark.triton.params.RouterParameters, read by
    dspark.params.parse_parameters) and a request's routing fields are told apart by name."""
    from dspark.routing import request

    assert not hasattr(request, "RouterParameters") and not hasattr(request, "parse_parameters")
    assert request.route_fields({"tier": "gold", "dspark-user-id": 7}) == request.RouteFields("gold", "7")
