"""Routing config: file format, validation messages naming the field, watching for changes."""

import os

import pytest

from dspark.routing.config import ConfigError, ConfigWatcher, RoutingConfig

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
    ("max_inflight: -1", "max_inflight"),
    ("max_inflight: many", "max_inflight: must be a int"),
    ("inline_max_ms: -1", "inline_max_ms: must be a number >= 0"),
    ("fluctuation: {min: -1.5}", "fluctuation.min"),
    ("fluctuation: {short_window_s: 20}", "fluctuation.short_window_s"),
    ("shadow: {percent: 10}", "shadow.version: required"),
    ("shadow: {version: 9, percent: 10}", "shadow.version: version 9"),
    ("shadow: {version: 2, percent: 150}", "shadow.percent"),
    ("colour: red", "colour: unknown field"),
    ("shares: [1, 2]", "shares: must be a mapping"),
    ("tiers: {gold: {weight: 1", "not valid YAML"),
])
def test_bad_config_names_the_field(tmp_path, text, field):
    path = tmp_path / "routing.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("(", r"\(")) as info:
        RoutingConfig.load(path, allowed_versions={1, 2})
    assert str(path) in str(info.value)


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
