"""Rollout building blocks without a server: plans, metrics parsing and arithmetic, the
analysis verdicts, the state file and its lock, atomic staging, endpoint lists."""
from __future__ import annotations

import datetime as dt
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from dspark.errors import ConfigError, UnavailableError
from dspark.repository import atomic
from dspark.rollout.analysis import judge
from dspark.rollout.fleet import Endpoint, read_endpoints
from dspark.rollout.metrics import Snapshot, delta, histogram_quantile, parse_text
from dspark.rollout.plan import DEFAULT_PLAN, Analysis, Plan
from dspark.rollout.state import HEARTBEAT_ENV, Heartbeat, ModelLock, StateStore, heartbeat_interval


# ---------------------------------------------------------------- plans
def test_default_plan_is_shadow_then_canary_steps():
    assert [(s.kind, s.percent) for s in DEFAULT_PLAN.steps] == [
        ("shadow", 20), ("canary", 5), ("canary", 25), ("canary", 50), ("canary", 100)]


@pytest.mark.parametrize("data, field", [
    ({"steps": [{"canary": 5}]}, "steps[0]"),  # no duration
    ({"steps": [{"canary": 5, "shadow": 5, "hold_s": 1}]}, "steps[0]"),
    ({"steps": [{"canary": 150, "hold_s": 1}]}, "steps[0].canary"),
    ({"steps": [{"canary": 5, "hold_s": 1}], "analysis": {"max_latency_ratio": 0.9}}, "analysis.max_latency_ratio"),
    ({"steps": [{"canary": 5, "hold_s": 1}], "analysis": {"intervall_s": 1}}, "analysis.intervall_s"),
    ({"steps": []}, "steps"),
])
def test_plan_errors_name_the_field(data, field, tmp_path):
    with pytest.raises(ConfigError) as caught:
        Plan.from_dict(data, tmp_path / "plan.yaml")
    assert caught.value.field == field and str(tmp_path / "plan.yaml") in str(caught.value)


def test_plan_round_trips_through_yaml(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("steps:\n  - {shadow: 10, requests: 100}\n  - {canary: 50, hold_s: 5}\nanalysis: {interval_s: 2}\n")
    plan = Plan.load(path)
    assert plan.steps[0].requests == 100 and plan.analysis.interval_s == 2
    assert Plan.from_dict(plan.to_dict()) == plan


# ---------------------------------------------------------------- metrics
TRITON_TEXT = """# HELP nv_inference_request_success Number of successful inference requests
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="m",version="1"} 100
nv_inference_request_success{model="m",version="2"} 50
# TYPE nv_inference_compute_infer_duration_us counter
nv_inference_compute_infer_duration_us{model="m",version="1"} 500000
nv_inference_compute_infer_duration_us{model="m",version="2"} 500000
# TYPE nv_gpu_utilization gauge
nv_gpu_utilization{gpu_uuid="x"} 0
# TYPE dspark_router_latency_seconds histogram
dspark_router_latency_seconds_bucket{model="r",tier="gold",version="2",le="0.01"} 90
dspark_router_latency_seconds_bucket{model="r",tier="gold",version="2",le="0.1"} 100
dspark_router_latency_seconds_bucket{model="r",tier="gold",version="2",le="+Inf"} 100
dspark_router_latency_seconds_count{model="r",tier="gold",version="2"} 100
dspark_router_latency_seconds_sum{model="r",tier="gold",version="2"} 1.5
"""


def snapshot(text: str, at: float = 0.0) -> Snapshot:
    snap = Snapshot(at)
    parse_text(text, "server-a", snap)
    return snap


def test_parse_reads_only_the_families_asked_for():
    snap = Snapshot(0.0)
    parse_text(TRITON_TEXT, "server-a", snap, ("nv_inference_request_success",))
    assert snap.total("nv_inference_request_success", model="m") == 150
    assert {name for name, _ in snap.values} == {"nv_inference_request_success"}
    snap = Snapshot(0.0)
    parse_text(TRITON_TEXT + '# TYPE dspark_router_config_version gauge\ndspark_router_config_version{model="r"} 3\n',
               "server-a", snap, versions=(1,))
    assert {dict(labels).get("version") for _, labels in snap.values} == {"1", None}
    assert snap.total("dspark_router_config_version") == 3, "series without a version stay"


def test_parse_keeps_our_families_with_the_instance_label():
    snap = snapshot(TRITON_TEXT)
    assert snap.total("nv_inference_request_success", model="m") == 150
    assert snap.total("nv_inference_request_success", instance="server-a", version="2") == 50
    assert not list(snap.select("nv_gpu_utilization"))


def test_counter_deltas_survive_a_reset():
    before = snapshot(TRITON_TEXT)
    after = snapshot(TRITON_TEXT.replace('version="1"} 100', 'version="1"} 130').replace('version="2"} 50', 'version="2"} 7'))
    assert delta(after, before, "nv_inference_request_success", version="1") == 30
    assert delta(after, before, "nv_inference_request_success", version="2") == 7  # reloaded: counts from zero


def test_histogram_quantile_interpolates_inside_a_bucket():
    snap = snapshot(TRITON_TEXT)
    assert histogram_quantile(0.5, snap, None, "dspark_router_latency_seconds", version="2") == pytest.approx(0.01 * 50 / 90)
    assert histogram_quantile(0.95, snap, None, "dspark_router_latency_seconds", version="2") == pytest.approx(0.055)
    assert histogram_quantile(0.5, snap, snap, "dspark_router_latency_seconds", version="2") is None  # no new data


# ---------------------------------------------------------------- analysis
def interval_text(v2_success, v2_us, v2_errors=0, v1_success=200, v1_us=1_000_000, shadow=(0, 0, 0),
                  skipped=0) -> str:
    agree, disagree, error = shadow
    return f"""# TYPE nv_inference_request_success counter
nv_inference_request_success{{model="m",version="1"}} {v1_success}
nv_inference_request_success{{model="m",version="2"}} {v2_success}
# TYPE nv_inference_compute_infer_duration_us counter
nv_inference_compute_infer_duration_us{{model="m",version="1"}} {v1_us}
nv_inference_compute_infer_duration_us{{model="m",version="2"}} {v2_us}
# TYPE dspark_router_target_errors_total counter
dspark_router_target_errors_total{{model="r",version="2"}} {v2_errors}
# TYPE dspark_router_shadow_total counter
dspark_router_shadow_total{{model="r",version="2",outcome="agree"}} {agree}
dspark_router_shadow_total{{model="r",version="2",outcome="disagree"}} {disagree}
dspark_router_shadow_total{{model="r",version="2",outcome="error"}} {error}
dspark_router_shadow_total{{model="r",version="2",outcome="skipped"}} {skipped}
"""


def interval(*args, **kwargs) -> Snapshot:
    return snapshot(interval_text(*args, **kwargs))


RULES = Analysis(min_requests=20, max_error_rate=0.05, max_latency_ratio=1.5, max_disagreement=0.1)


def verdict(after, phase="canary"):
    return judge(None, after, model="m", router="r", current=1, new=2, phase=phase, rules=RULES)


def test_healthy_version_passes():
    result = verdict(interval(100, 520_000))
    assert result.breach is None and result.new.mean_ms == pytest.approx(5.2) and result.current.mean_ms == 5.0


def test_errors_the_router_saw_count_even_when_triton_counted_successes():
    result = verdict(interval(100, 500_000, v2_errors=30))
    assert "error rate 30.0% on version 2 (30 of 100 requests) > 5%" in result.breach


def test_twice_as_slow_is_a_latency_breach():
    result = verdict(interval(100, 1_000_000))
    assert "mean latency 10.0 ms on version 2 vs 5.0 ms on version 1 (2.00x > 1.5x)" in result.breach


def test_too_few_requests_are_not_judged():
    result = verdict(interval(10, 1_000_000, v2_errors=10))
    assert result.breach is None and "not judged" in result.notes[0]


def test_shadow_disagreement_and_errors():
    result = verdict(interval(100, 500_000, shadow=(60, 30, 10)), phase="shadow")
    assert "shadow disagreement 33.3%" in result.breach and "error rate 10.0%" in result.breach


def test_skipped_shadow_copies_are_counted_and_noted():
    result = verdict(interval(100, 500_000, shadow=(60, 0, 6), skipped=34), phase="shadow")
    assert result.shadow_copied == 66 and result.shadow_skipped == 34 and result.disagreement == 0
    assert "34 of 100 sampled requests not copied to version 2 (34%)" in " ".join(result.notes)
    assert result.to_dict()["shadow_skipped"] == 34
    assert not verdict(interval(100, 500_000, shadow=(60, 0, 0)), phase="shadow").notes


def test_p99_from_the_routers_histograms_in_canary_steps():
    text = interval_text(100, 500_000) + "# TYPE dspark_router_latency_seconds histogram\n"
    for version, fast in (("1", 100), ("2", 10)):  # version 2: 90 of 100 requests over 10 ms
        for bound, count in (("0.01", fast), ("0.1", 100), ("+Inf", 100)):
            text += f'dspark_router_latency_seconds_bucket{{model="r",tier="gold",version="{version}",le="{bound}"}} {count}\n'
    rules = Analysis(min_requests=20, latency="p99", max_latency_ratio=1.5)
    canary = judge(None, snapshot(text), model="m", router="r", current=1, new=2, phase="canary", rules=rules)
    assert canary.current.p99_ms == pytest.approx(9.9) and canary.new.p99_ms == pytest.approx(10 + 90 * 89 / 90)
    assert "p99 latency 99.0 ms on version 2 vs 9.9 ms on version 1" in canary.breach
    shadow = judge(None, snapshot(text), model="m", router="r", current=1, new=2, phase="shadow", rules=rules)
    assert shadow.new.p99_ms is None and shadow.breach is None  # a shadow step is judged on the mean (equal here)


# ---------------------------------------------------------------- state and lock
def test_state_records_rollouts_events_and_commands(tmp_path):
    state = StateStore(tmp_path / "s.sqlite")
    rollout = state.create("m", "r", "1.1.0", 1, 2, {"plan": {}})
    assert state.active("m").id == rollout.id and rollout.phase == "staging"
    state.update(rollout.id, phase="step", step=1, paused=True)
    state.event(rollout.id, "route", "step 2", {"shares": {"1": 50}})
    state.send("m", "promote", "looks fine")
    reopened = StateStore(tmp_path / "s.sqlite")  # what a restarted controller sees
    assert reopened.active("m").step == 1 and reopened.active("m").paused
    assert reopened.events(rollout.id)[0]["data"] == {"shares": {"1": 50}}
    assert reopened.take_commands("m") == [("promote", "looks fine")] and reopened.take_commands("m") == []
    reopened.update(rollout.id, phase="done", outcome="promoted")
    assert reopened.active("m") is None and reopened.history("m")[0].outcome == "promoted"


def _hold_lock(path, ready, release):
    with ModelLock(Path(path), "m"):
        ready.set()
        release.wait(30)


def test_lock_refuses_a_second_controller_and_dies_with_its_holder(tmp_path):
    ready, release = multiprocessing.Event(), multiprocessing.Event()
    holder = multiprocessing.Process(target=_hold_lock, args=(str(tmp_path / "s.sqlite"), ready, release))
    holder.start()
    assert ready.wait(30)
    lock = ModelLock(tmp_path / "s.sqlite", "m")
    assert lock.held_by_other()
    with pytest.raises(UnavailableError, match=f"pid {holder.pid}"):
        lock.acquire()
    os.kill(holder.pid, 9)  # a crash: the kernel drops the lock
    holder.join()
    assert not lock.held_by_other()
    with lock:
        assert ModelLock(tmp_path / "s.sqlite", "other-model").held_by_other() is False


# ---------------------------------------------------------------- staging and endpoints
def test_heartbeat_keeps_the_lease_fresh_and_marks_the_exit(tmp_path):
    state = StateStore(tmp_path / "state.sqlite")
    assert state.lease("m") is None
    with Heartbeat(state.path, "m", interval_s=0.05):
        first = state.lease("m").beat
        time.sleep(0.3)
        lease = state.lease("m")
        assert lease.alive() and lease.beat > first and lease.holder.startswith(f"pid {os.getpid()} on ")
    beat = dt.datetime.fromisoformat(lease.beat)
    assert lease.alive(beat + dt.timedelta(seconds=0.1)) and not lease.alive(beat + dt.timedelta(seconds=0.11))
    stopped = state.lease("m")
    assert stopped.stopped and not stopped.alive()


def test_heartbeat_interval_from_the_environment(monkeypatch):
    monkeypatch.delenv(HEARTBEAT_ENV, raising=False)
    assert heartbeat_interval() == 2.0
    monkeypatch.setenv(HEARTBEAT_ENV, "0.5")
    assert heartbeat_interval() == 0.5
    monkeypatch.setenv(HEARTBEAT_ENV, "soon")
    with pytest.raises(ConfigError) as caught:
        heartbeat_interval()
    assert caught.value.field == HEARTBEAT_ENV


def test_install_folder_appears_whole_or_not_at_all(tmp_path):
    source = tmp_path / "model.py"
    source.write_text("x = 1\n")
    (tmp_path / "repo").mkdir()
    atomic.install_folder(source, tmp_path / "repo" / "3", "model.py")
    assert (tmp_path / "repo" / "3" / "model.py").read_text() == "x = 1\n"
    with pytest.raises(FileExistsError):
        atomic.install_folder(source, tmp_path / "repo" / "3", "model.py")
    (tmp_path / "repo" / ".staging-4-abc").mkdir()  # a writer killed half-way
    assert [p.name for p in atomic.remove_leftovers(tmp_path / "repo")] == [".staging-4-abc"]
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["3"]


def test_write_text_leaves_an_identical_file_alone(tmp_path):
    path = tmp_path / "config.pbtxt"
    assert atomic.write_text(path, "a")
    stamp = path.stat().st_mtime_ns
    assert not atomic.write_text(path, "a", only_if_changed=True) and path.stat().st_mtime_ns == stamp
    assert atomic.write_text(path, "b", only_if_changed=True) and path.read_text() == "b"


def test_endpoints_from_flags_and_files(tmp_path):
    assert Endpoint.parse("10.0.0.5:8000").metrics_url == "http://10.0.0.5:8002/metrics"
    text = tmp_path / "pods.txt"
    text.write_text("# pods\nhttp://10.0.0.6:8000\n10.0.0.7:9000 http://10.0.0.7:9002/metrics\n")
    listed = read_endpoints(["http://a:1"], ["http://a:3/metrics"], text)
    assert [e.url for e in listed] == ["http://a:1", "http://10.0.0.6:8000", "http://10.0.0.7:9000"]
    assert listed[2].metrics_url == "http://10.0.0.7:9002/metrics"
    as_yaml = tmp_path / "pods.yaml"
    as_yaml.write_text("- url: http://b:8000\n  metrics_url: http://b:9999/metrics\n- c:8000\n")
    assert [e.metrics_url for e in read_endpoints(servers_file=as_yaml)] == ["http://b:9999/metrics", "http://c:8002/metrics"]
    with pytest.raises(ConfigError, match="no server given"):
        read_endpoints()
    with pytest.raises(ConfigError, match="not an HTTP endpoint"):
        read_endpoints(["ftp://x"])


@pytest.mark.parametrize("option, name", [("model", "x/../../../escape"), ("model", "../escape"),
                                          ("--router", "../escape")])
def test_rollout_refuses_a_model_or_router_name_that_is_not_a_folder_name(tmp_path, option, name):
    from click.testing import CliRunner

    from dspark.cli.main import cli

    state = tmp_path / "state" / "rollout.sqlite"
    (tmp_path / "state" / "rollout.sqlite.x").mkdir(parents=True)  # lets 'x/../..' resolve
    (tmp_path / "repo").mkdir()
    artifact = tmp_path / "model.onnx"
    artifact.write_bytes(b"onnx")
    model, router = (name, []) if option == "model" else ("m", ["--router", name])
    before = sorted(tmp_path.rglob("*"))
    result = CliRunner().invoke(cli, ["rollout", "run", model, str(artifact), "--version", "1.0.0",
                                      "-r", str(tmp_path / "repo"), "-s", "http://127.0.0.1:1",
                                      "--state", str(state), *router])
    assert result.exit_code == 1
    field = "model" if option == "model" else "router"
    assert f"{field}: {name!r} is not a valid model name: use letters, digits" in result.output
    assert sorted(tmp_path.rglob("*")) == before  # no lock file, no state file, nothing elsewhere


def test_recover_with_nothing_in_progress_exits_4_and_a_failure_exits_1(tmp_path):
    """The Job starts `run` only on exit 4; exit 1 was both "nothing to recover" and every failure."""
    from click.testing import CliRunner

    from dspark.cli.main import cli
    from dspark.cli.rollout import NOTHING_IN_PROGRESS_EXIT

    state = tmp_path / "rollout.sqlite"
    result = CliRunner().invoke(cli, ["rollout", "recover", "m", "--state", str(state)])
    assert (result.exit_code, NOTHING_IN_PROGRESS_EXIT) == (4, 4)
    assert "no rollout of 'm' in progress (exit 4)" in result.output
    damaged = tmp_path / "damaged.sqlite"
    damaged.write_bytes(b"not a database" * 100)  # a failure, not "nothing in progress"
    result = CliRunner().invoke(cli, ["rollout", "recover", "m", "--state", str(damaged)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"{damaged}: state: cannot open the rollout state file: file is not a database" in result.output


def test_a_state_folder_this_user_cannot_write_is_one_line_naming_it_and_the_fix():
    """The Kubernetes Job's case: a volume whose root is root-owned 0755 and a process of another
    uid (nobody here; as a user other than root, a folder of its own made 0555). It was
    sqlite3's "unable to open database file" traceback and exit 1, read as nothing to recover."""
    import json
    import shutil
    import tempfile

    from click.testing import CliRunner

    from dspark.cli.main import cli

    base = Path(tempfile.mkdtemp(prefix="dspark-state-"))  # pytest's own folder is 0700: out of nobody's reach
    try:
        base.chmod(0o755)
        folder = base / "state"
        folder.mkdir()
        as_root = os.geteuid() == 0
        mode = 0o755 if as_root else 0o555
        folder.chmod(mode)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: another uid, then the command the Job runs first
            try:
                if as_root:
                    os.setgid(65534)
                    os.setuid(65534)
                result = CliRunner().invoke(cli, ["rollout", "recover", "rollout_demo", "--state",
                                                  str(folder / "rollout.sqlite")])
                os.write(write, json.dumps([os.geteuid(), result.exit_code, result.output]).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            uid, code, output = json.loads(pipe.read())
        os.waitpid(pid, 0)
        owner, group = folder.stat().st_uid, folder.stat().st_gid
        folder.chmod(0o755)
        contents = list(folder.iterdir())
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert code == 1 and "Traceback" not in output and len(output.strip().splitlines()) == 1, output
    assert (f"{folder}: state: the rollout state folder is not writable by uid {uid} (owner uid {owner}, "
            f"gid {group}, mode {mode:04o}): give the pod securityContext.fsGroup") in output, output
    assert contents == [], "nothing written"
