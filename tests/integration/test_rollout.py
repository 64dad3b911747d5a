"""Rollouts on a real server under continuous load: promoted, rolled back for latency and for
errors within two analysis intervals, steered by hand, and a controller killed mid-rollout that
is recovered (finished or rolled back) — with zero failed client requests throughout."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from tests.conftest import TEST_EXIT_TIMEOUT_S, TEST_ROUTER_POLL_MS, dump_log_on_failure
from dspark.bench.openloop import OpenLoopLoad, largest_gap
from dspark.cli.rollout import rollout as rollout_cli
from dspark.rollout import demo
from dspark.rollout.controller import Controller
from dspark.rollout.deployment import Deployment
from dspark.rollout.fleet import Endpoint, Server
from dspark.rollout.plan import Plan
from dspark.rollout.state import HEARTBEAT_ENV, StateStore
from dspark.routing.config import RoutingConfig
from dspark.server.launcher import TritonServer
from dspark.server.access import DEFAULT_HEADER_PATTERN, header_forward_args

pytestmark = pytest.mark.integration
INTERVAL_S = 0.5
FAST_PLAN = {
    "steps": [{"shadow": 30, "hold_s": 1}, {"canary": 25, "hold_s": 1}, {"canary": 100, "hold_s": 0.5}],
    "analysis": {"interval_s": INTERVAL_S, "min_requests": 10},
    "warmup": {"requests": 3},
    "drain_timeout_s": 10,
}
def held_plan(canary_hold_s: float) -> dict:
    return {**FAST_PLAN, "steps": [{"shadow": 30, "hold_s": 1}, {"canary": 25, "hold_s": canary_hold_s},
                                   {"canary": 100, "hold_s": 0.5}]}


@pytest.fixture(scope="module")
def site(request, tmp_path_factory):
    """One explicit-control server with rollout_demo behind its router, and client load on it."""
    root = tmp_path_factory.mktemp("rollout")
    repo = demo.build_repository(root / "repo", poll_interval_ms=TEST_ROUTER_POLL_MS)
    server = TritonServer([repo], model_control="explicit", load_models=[demo.MODEL, demo.ROUTER],
                          exit_timeout_s=TEST_EXIT_TIMEOUT_S, extra_args=header_forward_args(DEFAULT_HEADER_PATTERN))
    failed_before = request.session.testsfailed
    server.start()
    load = demo.LoadGenerator([server.http_url], threads_per_server=3).start()
    site = type("Site", (), {})()
    site.root, site.repo, site.server, site.load = root, repo, server, load
    site.endpoint = Endpoint.parse(server.http_url, server.metrics_url, server.grpc_url)
    site.state_path = root / "state.sqlite"
    site.artifacts = iter(range(1, 100))
    try:
        yield site
    finally:
        load.stop()
        dump_log_on_failure(request, server, failed_before)
        server.stop()


def artifact(site, **behaviour) -> tuple[Path, str]:
    n = next(site.artifacts)
    semver = f"1.{n}.0"
    return demo.model_artifact(site.root / f"model-{n}.py", semver, **behaviour), semver


def run_rollout(site, plan=FAST_PLAN, **behaviour):
    path, semver = artifact(site, **behaviour)
    deployment = Deployment(demo.MODEL, demo.ROUTER, str(site.repo), [site.endpoint])
    state = StateStore(site.state_path)
    controller = Controller(deployment, Plan.from_dict(plan), state, site.server.api_key, say=lambda line: None)
    try:
        return controller.start(path, semver), state
    finally:
        controller.close()


def served_versions(site) -> set[int]:
    server = Server(site.endpoint, site.server.api_key)
    versions = {int(i["version"]) for i in server.index() if i["name"] == demo.MODEL and i.get("state") == "READY"}
    server.close()
    return versions


def routed_versions(site) -> set[int]:
    config = RoutingConfig.load(site.repo / demo.ROUTER / "routing.yaml")
    return {v for v, p in config.shares.items() if p > 0} | ({config.shadow.version} if config.shadow.percent else set())


def assert_consistent(site):
    """Traffic points only at loaded versions; no failed client request so far."""
    assert routed_versions(site) <= served_versions(site)
    assert not site.load.failures(), site.load.failures()[:3]


def test_a_rollout_neither_fails_nor_stalls_clients_of_the_router_or_of_the_model(site):
    """Clients at a fixed request rate with a 1 s timeout, on the router and straight on the
    model, while a version is loaded, promoted and the old one retired (Triton reloads every
    version of the model at both ends): no request fails and answers never pause for long."""
    urls = [site.server.http_url]
    with OpenLoopLoad(urls, demo.ROUTER, rate=40) as router, OpenLoopLoad(urls, demo.MODEL, rate=20, seed=1) as direct:
        time.sleep(1.0)
        start = time.monotonic()
        outcome, _ = run_rollout(site)
        end = time.monotonic()
    assert outcome.promoted, outcome.reason
    for load in (router, direct):
        assert len(load.between(start, end)) > 100
        assert not load.failures(start, end), load.failures(start, end)[:3]
        assert largest_gap(load.answers, start, end) < 1.0
    assert_consistent(site)


@pytest.mark.parametrize("behaviour, reason", [
    ({"service_ms": 20}, "mean latency"),  # 2x slower than the 10 ms current version
    ({"fail_after": 10}, "error rate"),  # answers its warm-up, then fails every request
])
def test_regression_rolls_back_within_two_intervals(site, behaviour, reason):
    before = served_versions(site)
    outcome, state = run_rollout(site, **behaviour)
    assert not outcome.promoted and reason in outcome.reason
    events = state.events(outcome.rollout.id)
    judged = [e for e in events if e["kind"] == "analysis"]
    assert len(judged) <= 2, [e["message"] for e in judged]
    assert "BREACH" in judged[-1]["message"] and reason in judged[-1]["message"]
    rollout = state.get(outcome.rollout.id)
    assert (rollout.phase, rollout.outcome) == ("done", "rolled_back") and reason in rollout.reason
    assert served_versions(site) == before  # the new version is gone, the current one kept serving
    assert not (site.repo / demo.MODEL / str(rollout.new_version)).exists()
    assert_consistent(site)


def test_a_failing_canary_is_answered_by_the_current_version_and_still_rolled_back(site):
    """No shadow step: a version that fails every request after its warm-up takes a quarter of
    the traffic at once. Its failed calls go once more to the current version, so no client
    sees one, and the rollout still rolls back on the error rate."""
    plan = {**FAST_PLAN, "steps": [{"canary": 25, "hold_s": 3}]}
    outcome, state = run_rollout(site, plan=plan, fail_after=10)
    assert not outcome.promoted and "error rate" in outcome.reason
    judged = [e for e in state.events(outcome.rollout.id) if e["kind"] == "analysis"]
    assert "BREACH" in judged[-1]["message"] and "canary 25%" in judged[-1]["message"]
    assert_consistent(site)


def test_accuracy_on_a_labelled_set_gates_the_version_before_any_traffic(site):
    rng = np.random.default_rng(0)
    x = rng.uniform(0.1, 1.0, size=(20, 3)).astype(np.float32)
    np.savez(site.root / "labelled.npz", x=x, labels=np.argmax(x, axis=1))
    plan = {**FAST_PLAN, "analysis": {**FAST_PLAN["analysis"], "accuracy": {
        "dataset": str(site.root / "labelled.npz"), "output": "y", "min": 0.9}}}
    outcome, state = run_rollout(site, plan, scale=-2.0)  # y = -2x: the arg-max is now the smallest x
    assert not outcome.promoted and "accuracy 0.000 of version" in outcome.reason
    scores = next(e for e in state.events(outcome.rollout.id, ("accuracy",)))["data"]
    assert scores[str(outcome.rollout.current_version)] == 1.0
    assert not state.events(outcome.rollout.id, ("route",))[:-1]  # judged before any traffic
    assert_consistent(site)


def test_pause_resume_and_promote_by_hand_while_under_load(site):
    runner = CliRunner()
    base = ["--state", str(site.state_path), "--api-key", site.server.api_key]
    result = {}
    import threading
    thread = threading.Thread(target=lambda: result.update(out=run_rollout(site, held_plan(60))))
    thread.start()
    state = StateStore(site.state_path)
    active = state.get(wait_for_canary(state, thread.is_alive))
    # a second controller on the same model refuses to start
    path, _ = artifact(site)
    second = runner.invoke(rollout_cli, ["run", demo.MODEL, str(path), "--version", "9.0.0", "-r", str(site.repo),
                                         "--router", demo.ROUTER, "--server", site.server.http_url, *base])
    assert second.exit_code != 0 and "another controller" in second.output, second.output
    out = runner.invoke(rollout_cli, ["pause", demo.MODEL, *base])
    assert out.exit_code == 0 and "sent to the controller" in out.output, out.output
    time.sleep(1.0)
    assert state.active(demo.MODEL).paused
    status = runner.invoke(rollout_cli, ["status", demo.MODEL, *base, "--json", "--window", "0.5"])
    report = json.loads(status.output)
    assert report["rollout"]["paused"] and report["rollout"]["step"] == "2/3 canary 25%"
    assert report["shares"] == {"1": 75.0, str(active.new_version): 25.0} or sum(report["shares"].values()) == 100
    assert {row["version"] for row in report["versions"]} == {active.current_version, active.new_version}
    assert all(row["rps"] > 0 for row in report["versions"]), report["versions"]
    table = runner.invoke(rollout_cli, ["status", demo.MODEL, *base, "--window", "0.2"]).output
    assert "(PAUSED)" in table and "READY" in table and "traffic:" in table
    runner.invoke(rollout_cli, ["resume", demo.MODEL, *base])
    out = runner.invoke(rollout_cli, ["promote", demo.MODEL, *base])
    assert out.exit_code == 0, out.output
    thread.join(60)
    outcome, _ = result["out"]
    assert outcome.promoted
    assert served_versions(site) == {outcome.rollout.new_version}
    assert routed_versions(site) == {outcome.rollout.new_version}
    time.sleep(0.5)
    assert site.load.versions(since=time.monotonic() - 0.3) == {outcome.rollout.new_version}
    kinds = [e["message"] for e in state.events(outcome.rollout.id) if e["kind"] == "command"]
    assert any("paused" in k for k in kinds) and any("promoted by hand" in k for k in kinds)
    assert_consistent(site)


def test_status_shows_the_share_the_shadow_really_copied(site):
    plan = {**FAST_PLAN, "steps": [{"shadow": 100, "hold_s": 5}, {"canary": 100, "hold_s": 0.5}]}
    result = {}
    import threading
    thread = threading.Thread(target=lambda: result.update(out=run_rollout(site, plan)))
    thread.start()
    state = StateStore(site.state_path)
    deadline = time.monotonic() + 60
    while not ((active := state.active(demo.MODEL)) and state.events(active.id, ("route",))):
        assert time.monotonic() < deadline and thread.is_alive(), "the rollout never reached its shadow step"
        time.sleep(0.1)
    time.sleep(0.5)
    base = [demo.MODEL, "--state", str(site.state_path), "--api-key", site.server.api_key, "--window", "2"]
    report = json.loads(CliRunner().invoke(rollout_cli, ["status", *base, "--json"]).output)
    shadow = report["shadow"]
    rows = {row["version"]: row["rps"] * 2 for row in report["versions"]}  # requests in the window
    sampled = shadow["copied"] + shadow["skipped"]
    # 100 %: every request the current version answered was sampled; the new version served the copies
    assert shadow["percent"] == 100 and shadow["copied"] > 0
    assert sampled == pytest.approx(rows[active.current_version], rel=0.1, abs=3), (shadow, rows)
    assert shadow["copied"] == pytest.approx(rows[active.new_version], rel=0.1, abs=3), (shadow, rows)
    table = CliRunner().invoke(rollout_cli, ["status", *base[:-1], "0.5"]).output
    assert "sampled requests copied" in table and "skipped (shadow.max_inflight calls in flight)" in table, table
    thread.join(60)
    outcome, _ = result["out"]
    assert outcome.promoted, outcome.reason  # an equal version, copied in full or not, agrees
    for event in state.events(outcome.rollout.id, ("analysis",)):
        if event["data"]["shadow_skipped"]:
            assert "sampled requests not copied" in event["message"]
    assert_consistent(site)


def _cli(site, *args, env: dict | None = None) -> subprocess.Popen:
    command = [sys.executable, "-c", "from dspark.cli.main import main; main()", "rollout", *args,
               "--state", str(site.state_path), "--api-key", site.server.api_key]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})


def wait_for_canary(state: StateStore, alive) -> int:
    """The id of the active rollout once its canary step (step 2) is routed."""
    deadline = time.monotonic() + 60
    while True:
        active = state.active(demo.MODEL)
        if active and any(e["message"].startswith("step 2/3") for e in state.events(active.id, ("route",))):
            return active.id
        assert time.monotonic() < deadline and alive(), "the rollout never reached its canary step"
        time.sleep(0.1)


def _start_in_canary(site, canary_hold_s: float, env: dict | None = None) -> tuple[subprocess.Popen, StateStore, int]:
    """Start `dspark rollout run` in a process and wait for its canary step."""
    path, semver = artifact(site)
    plan = site.root / "slow-plan.yaml"
    plan.write_text(yaml.safe_dump(held_plan(canary_hold_s)))
    process = _cli(site, "run", demo.MODEL, str(path), "--version", semver, "-r", str(site.repo),
                   "--router", demo.ROUTER, "--server", site.server.http_url, "--metrics-url",
                   site.server.metrics_url, "--plan", str(plan), env=env)
    state = StateStore(site.state_path)
    return process, state, wait_for_canary(state, lambda: process.poll() is None)


def _start_and_kill(site) -> tuple[StateStore, int]:
    """Start `dspark rollout run` in a process and kill -9 it during its canary step."""
    process, state, rollout_id = _start_in_canary(site, 2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    site.killed_output = process.stdout.read()
    return state, rollout_id


@pytest.mark.parametrize("command, exit_code, outcome", [(["recover"], 0, "promoted"),
                                                          (["rollback", "--reason", "operator"], 3, "rolled_back")])
def test_killed_controller_is_recovered_consistently(site, command, exit_code, outcome):
    state, rollout_id = _start_and_kill(site)
    assert_consistent(site)  # killed mid-canary: both versions loaded, traffic split between them
    assert len(routed_versions(site)) == 2, site.killed_output
    process = _cli(site, command[0], demo.MODEL, *command[1:])
    output = process.communicate(timeout=120)[0]
    assert process.returncode == exit_code, output
    rollout = state.get(rollout_id)
    assert (rollout.phase, rollout.outcome) == ("done", outcome), output
    survivor = rollout.new_version if outcome == "promoted" else rollout.current_version
    assert served_versions(site) == {survivor} and routed_versions(site) == {survivor}
    if outcome == "rolled_back":
        assert "operator" in rollout.reason
    assert_consistent(site)
    history = CliRunner().invoke(rollout_cli, ["history", demo.MODEL, "--state", str(site.state_path)])
    assert f"{rollout.semver}" in history.output and outcome in history.output


def test_status_tells_a_killed_controller_from_a_live_one(site):
    beat_s = 1.0
    process, state, rollout_id = _start_in_canary(site, 6, env={HEARTBEAT_ENV: str(beat_s)})
    base = [demo.MODEL, "--state", str(site.state_path), "--api-key", site.server.api_key, "--window", "0.1"]

    def status() -> tuple[dict, str]:
        runner = CliRunner()
        return (json.loads(runner.invoke(rollout_cli, ["status", *base, "--json"]).output),
                runner.invoke(rollout_cli, ["status", *base]).output)

    time.sleep(3 * beat_s)  # live well past two heartbeats
    report, table = status()
    assert report["controller"]["running"], report["controller"]
    assert f"controller running (pid {process.pid} on" in table, table
    process.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    process.wait()
    time.sleep(max(0.0, killed_at + 2 * beat_s - time.monotonic()))
    report, table = status()
    assert not report["controller"]["running"], report["controller"]
    last = state.lease(demo.MODEL).beat
    assert report["controller"]["last_heartbeat"] == last
    assert (f"controller not running since {last} (last heartbeat), run `dspark rollout recover {demo.MODEL}`"
            in table), table
    assert f"rollout #{rollout_id} in progress" in table
    # rolled back by hand (test_killed_controller_is_recovered_consistently recovers one)
    stopped = _cli(site, "rollback", demo.MODEL)
    output = stopped.communicate(timeout=120)[0]
    assert stopped.returncode == 3, output
    assert state.get(rollout_id).outcome == "rolled_back"
    assert_consistent(site)


def test_bad_starts_are_refused_naming_the_problem(site):
    runner = CliRunner()
    path, _ = artifact(site)
    base = ["-r", str(site.repo), "--router", demo.ROUTER, "--server", site.server.http_url,
            "--metrics-url", site.server.metrics_url, "--state", str(site.state_path), "--api-key", site.server.api_key]
    routing = site.repo / demo.ROUTER / "routing.yaml"
    before = (routing.read_text(), sorted(p.name for p in (site.repo / demo.MODEL).iterdir()))

    out = runner.invoke(rollout_cli, ["run", demo.MODEL, str(path), "--version", "0.9.0", *base])
    assert out.exit_code == 1 and "version: 0.9.0 is not newer than the recorded" in out.output, out.output
    bad_plan = site.root / "bad-plan.yaml"
    bad_plan.write_text("steps:\n  - {canary: 150, hold_s: 1}\n")
    out = runner.invoke(rollout_cli, ["run", demo.MODEL, str(path), "--version", "9.0.0", *base, "--plan", str(bad_plan)])
    assert out.exit_code == 1 and "steps[0].canary" in out.output and str(bad_plan) in out.output, out.output
    config = RoutingConfig.load(routing)
    current = next(iter(config.shares))
    split = routing.read_text().replace(f"{current}: 100.0", f"{current}: 60.0\n  99: 40.0")
    routing.write_text(split)
    try:
        out = runner.invoke(rollout_cli, ["run", demo.MODEL, str(path), "--version", "9.0.0", *base])
        assert out.exit_code == 1 and "shares: router 'rollout_router' splits traffic" in out.output, out.output
    finally:
        routing.write_text(before[0])
    out = runner.invoke(rollout_cli, ["run", demo.MODEL, str(path), "--version", "9.0.0", *base[:-2], "--api-key",
                                      "wrong-key-0123456789"])
    assert out.exit_code == 1 and "fleet not ready" in out.output and "dspark-api-key" in out.output, out.output
    assert sorted(p.name for p in (site.repo / demo.MODEL).iterdir()) == before[1]  # nothing staged
    assert StateStore(site.state_path).active(demo.MODEL) is None or pytest.fail("a refused start left a rollout")
