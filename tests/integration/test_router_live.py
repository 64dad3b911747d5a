"""The QoS router on its own server with a temporary repository whose routing the tests change
live: canary split, shadow (erroring, sleeping, disagreeing), deadlines, tier priority,
reconfiguration under load through `dspark route set`."""
from __future__ import annotations

import re
import shutil
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from click.testing import CliRunner
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from tests.conftest import TEST_ROUTER_POLL_MS, serving
from dspark.cli.route import read_metrics, route
from dspark.paths import project_root
from dspark.routing.config import RoutingConfig, ShadowPolicy, TierPolicy
from dspark.routing.graying import VersionSplitter, routing_key

pytestmark = pytest.mark.integration
X = np.array([1.0, 2.0, 3.0], dtype=np.float32)
# versions of the test target: 1 normal, 2 tiny offset, 3 fails, 4 sleeps 1 s, 5 sleeps 50 ms,
# 6 hangs (3 s: far past the 300 ms timeout the test gives it)
BEHAVIOUR = {2: "offset=0.000001", 3: "error", 4: "sleep_ms=1000", 5: "sleep_ms=50", 6: "sleep_ms=3000"}
MODELS = ["router_demo_target", "router_demo"]


def set_parameter(model_dir, key, value):
    path = model_dir / "config.pbtxt"
    config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    config.parameters[key].string_value = value
    path.write_text(text_format.MessageToString(config))


@pytest.fixture(scope="module")
def live(request, tmp_path_factory):
    repo = tmp_path_factory.mktemp("router-repo")
    source = project_root() / "model_repository"
    shutil.copytree(source / "router_demo", repo / "router_demo")
    shutil.copytree(source / "router_demo_target", repo / "router_demo_target")
    for version, behaviour in BEHAVIOUR.items():
        (repo / "router_demo_target" / str(version)).mkdir(exist_ok=True)
        set_parameter(repo / "router_demo_target", f"version_{version}", behaviour)
    set_parameter(repo / "router_demo", "target_versions", ",".join(str(v) for v in [1, *BEHAVIOUR]))
    set_parameter(repo / "router_demo", "poll_interval_ms", str(TEST_ROUTER_POLL_MS))
    # explicit model control: the last test unloads and reloads the router
    with serving(request, [repo], model_control="explicit", load_models=MODELS) as server:
        server.repo = repo
        yield server


def metric(server, name, **labels):
    return sum(v for n, l, v in read_metrics(server.metrics_url, "router_demo")
               if n == name and all(l.get(k) == str(w) for k, w in labels.items()))


def eventually_metric(server, name, expected, timeout_s=5.0, **labels):
    """The metric once it reaches ``expected`` (counters are exported every 0.5 s), else its last value."""
    deadline = time.monotonic() + timeout_s
    while (value := metric(server, name, **labels)) < expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def apply(server, **changes) -> RoutingConfig:
    """Write a new routing.yaml and wait until the router reports it in effect."""
    path = server.repo / "router_demo" / "routing.yaml"
    current = RoutingConfig.load(path)
    new = replace(current, version=current.version + 1, **changes).validate()
    new.save(path)
    deadline = time.monotonic() + 10
    while metric(server, "dspark_router_config_version") != new.version:
        assert time.monotonic() < deadline, "router did not pick up the routing file"
        time.sleep(0.1)
    return new


def infer(server, protocol="http", **kwargs):
    lib = httpclient if protocol == "http" else grpcclient
    client = lib.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url)
    tensor = lib.InferInput("x", [3], "FP32")
    tensor.set_data_from_numpy(X)
    return client.infer("router_demo", [tensor], **kwargs)


def many(server, calls, workers=8):
    """Run infer(**kwargs) for each kwargs in calls concurrently; returns results or exceptions."""
    def one(kwargs):
        try:
            return infer(server, **kwargs)
        except InferenceServerException as exc:
            return exc
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, calls))


def test_canary_split_matches_the_hash_and_its_share(live):
    config = apply(live, shares={1: 80, 2: 20}, shadow=ShadowPolicy())
    users = [f"user-{i}" for i in range(2000)]
    results = many(live, [{"parameters": {"user_id": u}} for u in users])
    served = [int(r.as_numpy("version")[0]) for r in results]
    share2 = served.count(2) / len(served)
    assert abs(share2 - 0.20) < 4 * (0.2 * 0.8 / len(served)) ** 0.5  # 4 standard deviations
    # the server hashed exactly as this process does: deterministic across processes
    splitter = VersionSplitter(config.shares)
    assert served == [splitter.version_for(routing_key(u, None)) for u in users]
    # without a user id the request id decides
    ids = [f"req-{i}" for i in range(1000)]
    results = many(live, [{"request_id": r, "protocol": "grpc"} for r in ids])
    assert [int(r.as_numpy("version")[0]) for r in results] == [splitter.version_for(routing_key(None, r)) for r in ids]


@pytest.mark.parametrize("shadow_version, outcome", [(3, "error"), (4, None)])
def test_shadow_never_fails_or_delays_the_primary(live, shadow_version, outcome):
    apply(live, shares={1: 100}, shadow=ShadowPolicy(version=shadow_version, percent=100, max_inflight=2))
    before = {o: metric(live, "dspark_router_shadow_total", version=shadow_version, outcome=o)
              for o in ("error", "skipped", "agree")}
    start = time.monotonic()
    results = many(live, [{"parameters": {"user_id": f"s{i}"}} for i in range(100)], workers=4)
    elapsed = time.monotonic() - start
    assert not [r for r in results if isinstance(r, Exception)]
    assert all(int(r.as_numpy("version")[0]) == 1 for r in results)
    assert elapsed < 5.0  # the sleeping shadow (1 s each) would take 50 s if the primary waited
    deadline = time.monotonic() + 5
    while True:
        after = {o: metric(live, "dspark_router_shadow_total", version=shadow_version, outcome=o) - before[o]
                 for o in before}
        if sum(after.values()) >= 100 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if outcome == "error":
        assert after["error"] + after["skipped"] == 100 and after["error"] >= 2
    else:  # at most 2 sleeping shadows in flight: the rest are skipped, never queued behind
        assert after["skipped"] >= 90


def test_shadow_comparison_within_tolerance(live):
    for atol, outcome in ((0.0, "disagree"), (1e-4, "agree")):
        apply(live, shares={1: 100}, shadow=ShadowPolicy(version=2, percent=100, atol=atol, rtol=0, max_inflight=50,
                                                         ignore_outputs=("version",)))
        before = metric(live, "dspark_router_shadow_total", version=2, outcome=outcome)
        many(live, [{} for _ in range(20)], workers=2)
        deadline = time.monotonic() + 5
        while metric(live, "dspark_router_shadow_total", version=2, outcome=outcome) - before < 20:
            assert time.monotonic() < deadline, f"expected 20 shadow '{outcome}' results"
            time.sleep(0.1)


def test_diamond_overtakes_standard_and_deadlines_explain_rejections(live):
    tiers = {"diamond": TierPolicy(weight=8, deadline_ms=5000),
             "gold": TierPolicy(weight=3, deadline_ms=5000),
             "standard": TierPolicy(weight=1, deadline_ms=700)}
    apply(live, shares={5: 100}, shadow=ShadowPolicy(), tiers=tiers, max_inflight=1)
    finished = {}

    def call(name, tier):
        try:
            infer(live, protocol="grpc", headers={"dspark-tier": tier})
            finished[name] = ("ok", time.monotonic())
        except InferenceServerException as exc:
            finished[name] = (exc, time.monotonic())

    threads = [threading.Thread(target=call, args=(f"s{i}", "standard")) for i in range(30)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    diamond = threading.Thread(target=call, args=("d", "diamond"))
    diamond.start()
    for t in threads + [diamond]:
        t.join()
    assert finished["d"][0] == "ok"
    ok_standard = sorted(t for name, (r, t) in finished.items() if name != "d" and r == "ok")
    # at 50 ms per request and one in flight, 30 standard need 1.5 s: diamond is served within a few
    assert sum(t < finished["d"][1] for t in ok_standard) <= 6
    rejected = [r for name, (r, _) in finished.items() if r != "ok"]
    assert rejected, "standard requests past their 700 ms deadline must be rejected"
    for exc in rejected:
        assert "past the tier's queue deadline of 700 ms" in exc.message()
        assert exc.status() == "StatusCode.UNAVAILABLE"
    assert eventually_metric(live, "dspark_router_rejections_total", len(rejected), tier="standard",
                             reason="deadline") >= len(rejected)


def test_reconfiguration_under_load_fails_no_request(live):
    apply(live, shares={1: 100}, shadow=ShadowPolicy(), tiers=RoutingConfig().tiers, max_inflight=2)
    stop = threading.Event()
    results = []

    def load(worker):
        i = 0
        while not stop.is_set():
            try:
                r = infer(live, protocol="grpc" if worker % 2 else "http",
                          parameters={"user_id": f"w{worker}-{i}", "tier": ("diamond", "gold", "standard")[i % 3]})
                results.append((time.monotonic(), int(r.as_numpy("version")[0])))
            except InferenceServerException as exc:
                results.append((time.monotonic(), exc))
            i += 1

    workers = [threading.Thread(target=load, args=(w,)) for w in range(4)]
    for w in workers:
        w.start()
    time.sleep(0.5)
    runner = CliRunner()
    base = ["--repository", str(live.repo), "--model", "router_demo", "--metrics-url", live.metrics_url]
    for args in (["--share", "1=50", "--share", "2=50", "--weight", "diamond=12"],
                 ["--share", "2=100", "--max-inflight", "3", "--shadow-version", "1", "--shadow-percent", "10"]):
        out = runner.invoke(route, ["set", *base, *args])
        assert out.exit_code == 0, out.output
        assert "runs config version" in out.output
        time.sleep(0.5)
    switched = time.monotonic()
    time.sleep(0.5)
    stop.set()
    for w in workers:
        w.join()
    failures = [r for _, r in results if isinstance(r, Exception)]
    assert not failures, failures[:3]
    assert len(results) > 100
    assert {v for t, v in results if t > switched + 0.1} == {2}
    shown = runner.invoke(route, ["show", *base])
    assert "v2 100%" in shown.output and re.search(r"^diamond\s+12\s", shown.output, re.M), shown.output


def test_route_set_rejects_bad_input_naming_the_field(live):
    runner = CliRunner()
    base = ["--repository", str(live.repo), "--model", "router_demo"]
    out = runner.invoke(route, ["set", *base, "--share", "1=70", "--share", "9=30"])
    assert out.exit_code != 0 and "shares: version 9 is not a routable version" in out.output
    out = runner.invoke(route, ["set", *base, "--share", "1=70"])
    assert out.exit_code != 0 and "shares: percentages must sum to 100" in out.output
    out = runner.invoke(route, ["set", *base, "--weight", "platinum=2"])
    assert out.exit_code != 0 and "unknown tier 'platinum'" in out.output


def test_fast_path_serves_an_idle_router_and_closes_for_a_slow_target(live):
    apply(live, shares={1: 100}, shadow=ShadowPolicy(), tiers=RoutingConfig().tiers, max_inflight=2)
    time.sleep(0.6)
    before = metric(live, "dspark_router_fast_path_total")
    for i in range(60):
        result = infer(live, parameters={"tier": "gold"})
        np.testing.assert_allclose(result.as_numpy("y"), 2 * X)
    time.sleep(1.0)  # the counter is exported every 0.5 s
    assert metric(live, "dspark_router_fast_path_total") - before >= 30, \
        "sequential requests to an idle router in front of a fast target take the fast path"

    # a 1 s target: after one call the fast path closes, so execute never holds a slow standard
    # request while a diamond one waits in Triton's queue: both run at once (max_inflight 2)
    apply(live, shares={4: 100})
    infer(live, parameters={"tier": "standard"})
    time.sleep(0.6)
    before = metric(live, "dspark_router_fast_path_total")
    latency = {}

    def call(tier):
        t = time.monotonic()
        infer(live, parameters={"tier": tier})
        latency[tier] = time.monotonic() - t

    standard = threading.Thread(target=call, args=("standard",))
    standard.start()
    time.sleep(0.1)
    call("diamond")
    standard.join()
    # both run at once: diamond, sent 0.1 s later, ends about when standard does, not a whole
    # 1 s call later (a comparison of the two requests, not a band on this machine's speed)
    assert latency["diamond"] < latency["standard"] + 0.5, latency
    time.sleep(1.0)
    assert metric(live, "dspark_router_fast_path_total") == before


def rejected_lines(server):
    return server.log_text().count("routing file rejected")


@pytest.mark.parametrize("garbage", [b"- 1\n- 2\n", b"just text\n", b"{1: 2, version: 3}\n", b"\xff\xfe\x00 binary",
                                     b"tiers: {gold: {weight: .inf, deadline_ms: 5}}\n", b"",
                                     b"# Routing of router_demo (re-read on ch",  # cut short while written
                                     b"tiers: {standard: {weight: 1, deadline_ms: 5000, timeout_ms: 1.0e+308}}\n",
                                     b"tiers: {standard: {weight: 1.0e+308, deadline_ms: 5000}}\n",
                                     b"version: 1\n" + b"# padding\n" * 1_000_000],
                         ids=["list", "scalar", "mixed-keys", "binary", "inf", "empty", "truncated", "huge-timeout",
                              "huge-weight", "10MB"])
def test_a_garbage_routing_file_is_ignored_and_route_set_still_works(live, garbage):
    good = apply(live, shares={1: 100}, shadow=ShadowPolicy(), tiers=RoutingConfig().tiers, max_inflight="auto")
    path = live.repo / "router_demo" / "routing.yaml"
    before = rejected_lines(live)
    path.write_bytes(garbage)
    deadline = time.monotonic() + 5
    while rejected_lines(live) == before:
        assert time.monotonic() < deadline, "the router never reported the bad file"
        time.sleep(0.1)
    assert metric(live, "dspark_router_config_version") == good.version, "the last good config stays"
    assert int(infer(live).as_numpy("version")[0]) == 1
    good.save(path)  # a valid file again: `route set` reads it and the router applies the change
    out = CliRunner().invoke(route, ["set", "--repository", str(live.repo), "--model", "router_demo",
                                     "--metrics-url", live.metrics_url, "--share", "2=100"])
    assert out.exit_code == 0 and f"runs config version {good.version + 1}" in out.output, out.output
    assert int(infer(live, parameters={"user_id": "u1"}).as_numpy("version")[0]) == 2


def test_queue_full_is_unavailable_end_to_end(live):
    tiers = {**RoutingConfig().tiers, "standard": TierPolicy(weight=1, deadline_ms=5000, max_queue=1)}
    apply(live, shares={4: 100}, shadow=ShadowPolicy(), tiers=tiers, max_inflight=1, top_tier_headroom=0,
          inline_max_ms=0)
    start = time.monotonic()
    results = many(live, [{"parameters": {"tier": "standard"}} for _ in range(5)], workers=5)
    full = [r for r in results if isinstance(r, InferenceServerException)]
    assert len(full) == 3 and len(results) - len(full) == 2  # one running, one queued
    for exc in full:
        assert exc.status() == "400" or exc.status() == "UNAVAILABLE" or "503" in str(exc.status())
        assert "router 'router_demo': tier 'standard' queue is full (1 waiting, max_queue 1)" in exc.message()
    assert time.monotonic() - start < 4.0
    assert eventually_metric(live, "dspark_router_rejections_total", 3, tier="standard", reason="queue_full") >= 3


def test_a_cancelled_grpc_request_is_not_sent_to_the_target(live):
    apply(live, shares={4: 100}, shadow=ShadowPolicy(), tiers=RoutingConfig().tiers, max_inflight=1,
          top_tier_headroom=0, inline_max_ms=0, cancel_check_ms=100)
    time.sleep(1.1)  # counters of earlier tests exported
    sent_before = metric(live, "dspark_router_requests_total", version=4)
    cancelled_before = metric(live, "dspark_router_rejections_total", reason="cancelled")
    client = grpcclient.InferenceServerClient(live.grpc_url)
    tensor = grpcclient.InferInput("x", [3], "FP32")
    tensor.set_data_from_numpy(X)
    done = {}
    client.async_infer("router_demo", [tensor], callback=lambda result, error: done.setdefault("running", (result, error)))
    time.sleep(0.1)
    queued = client.async_infer("router_demo", [tensor], callback=lambda result, error: done.setdefault("queued", (result, error)))
    time.sleep(0.05)
    queued.cancel()  # Triton takes a few hundred ms to mark it; it waits ~0.9 s for the running call
    deadline = time.monotonic() + 5
    while metric(live, "dspark_router_rejections_total", reason="cancelled") == cancelled_before or "running" not in done:
        assert time.monotonic() < deadline, f"the router never noticed the cancelled request: {done}"
        time.sleep(0.1)
    assert done["running"][1] is None and done["running"][0].as_numpy("y").tolist() == (2 * X).tolist()
    time.sleep(1.1)
    assert metric(live, "dspark_router_requests_total", version=4) == sent_before + 1, "only the first was sent"
    assert "cancelled" in str(done["queued"][1]).lower()


def test_a_hanging_target_answers_unavailable_naming_the_timeout(live):
    tiers = {**RoutingConfig().tiers, "standard": TierPolicy(weight=1, deadline_ms=5000, timeout_ms=300)}
    apply(live, shares={6: 100}, shadow=ShadowPolicy(), tiers=tiers, max_inflight="auto", top_tier_headroom=1,
          inline_max_ms=5)
    for path in ("fast path", "queued path"):  # the first call finds the router idle, the second does not
        start = time.monotonic()
        with pytest.raises(InferenceServerException) as info:
            infer(live, parameters={"tier": "standard"})
        assert time.monotonic() - start < 2.0, path
        assert ("router 'router_demo': target 'router_demo_target' version 6 did not answer within 300 ms "
                "(the 'standard' tier's timeout)") in info.value.message(), path
        assert "UNAVAILABLE" in str(info.value.status()) or info.value.status() == "503", info.value.status()
    # both target instances are still busy with the hung calls: a diamond request uses the headroom
    apply(live, shares={1: 100})
    start = time.monotonic()
    assert int(infer(live, parameters={"tier": "diamond"}).as_numpy("version")[0]) == 1
    assert time.monotonic() - start < 1.5
    assert eventually_metric(live, "dspark_router_rejections_total", 2, tier="standard", reason="target_timeout") == 2
    time.sleep(3.0)  # the hung calls return (and are dropped): the next test starts clean


def router_stubs(server):
    """Python backend stub processes of router_demo under this server."""
    model = f"{server.repo}/router_demo/1/model.py".encode()
    count = 0
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) > 1 and argv[0].endswith(b"triton_python_backend_stub") and argv[1] == model:
            count += 1
    return count


def wait_for(condition, what, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_unload_load_reload_with_requests_in_flight(live):
    apply(live, shares={5: 100}, shadow=ShadowPolicy(), tiers=RoutingConfig().tiers, max_inflight="auto",
          top_tier_headroom=1, inline_max_ms=5)
    headers = getattr(live, "repository_headers", {})
    control = httpclient.InferenceServerClient(live.http_url)
    stop = threading.Event()
    outcomes = []  # (protocol, "ok" | what went wrong)

    def load(worker):
        protocol = "grpc" if worker % 2 else "http"
        i = 0
        while not stop.is_set():
            try:
                infer(live, protocol, parameters={"tier": ("diamond", "gold", "standard")[i % 3]},
                      **({"client_timeout": 20} if protocol == "grpc" else {}))
                outcomes.append((protocol, "ok"))
            except InferenceServerException as exc:
                outcomes.append((protocol, exc.message()))
            except Exception as exc:  # a dropped connection or a timeout: what this test must not see
                outcomes.append((protocol, f"{type(exc).__name__}: {exc}"))
            i += 1

    workers = [threading.Thread(target=load, args=(w,)) for w in range(4)]
    for w in workers:
        w.start()
    try:
        time.sleep(0.5)
        control.unload_model("router_demo", headers=headers)
        wait_for(lambda: router_stubs(live) == 0, "the router's stub did not exit after the unload")
        assert not control.is_model_ready("router_demo")
        samples = read_metrics(live.metrics_url, "router_demo")
        assert samples == [], f"metric families left behind by the unloaded router: {samples[:3]}"
        control.load_model("router_demo", headers=headers)
        time.sleep(0.5)
        control.load_model("router_demo", headers=headers)  # a reload with requests in flight
        time.sleep(0.5)
    finally:
        stop.set()
        for w in workers:
            w.join(30)
    assert not any(w.is_alive() for w in workers), "a request was never answered"
    wait_for(lambda: router_stubs(live) == 1, "one stub for the one router instance after the reload")
    versions = [s for s in read_metrics(live.metrics_url, "router_demo") if s[0] == "dspark_router_config_version"]
    assert len(versions) == 1, versions
    errors = Counter(message for _, message in outcomes if message != "ok")
    explained = re.compile(r"is shutting down|unknown model|is not found|not ready|no available version|unavailable",
                           re.IGNORECASE)
    assert all(explained.search(m) for m in errors), errors
    assert len(outcomes) > 20 and sum(m == "ok" for _, m in outcomes) > 10
    # the reloaded router's metrics are live (the old instance's cleanup did not take them along)
    time.sleep(1.0)
    before = metric(live, "dspark_router_requests_total")
    results = many(live, [{} for _ in range(20)], workers=2)
    assert {int(r.as_numpy("version")[0]) for r in results} == {5}
    wait_for(lambda: metric(live, "dspark_router_requests_total") == before + 20, "requests were not counted", 5)
