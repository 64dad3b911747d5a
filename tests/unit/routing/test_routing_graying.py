"""Hash-based traffic graying, shadow sampling and output comparison."""

import subprocess
import sys

import numpy as np
import pytest

from dspark.routing.config import ShadowPolicy
from dspark.routing.graying import BUCKETS, VersionSplitter, bucket, outputs_agree, routing_key, shadow_sampled


def test_bucket_is_stable_across_processes():
    keys = [f"user-{i}" for i in range(50)]
    here = [bucket(k, "version") for k in keys]
    code = ("from dspark.routing.graying import bucket;"
            f"print([bucket(k, 'version') for k in {keys!r}])")
    for seed in ("0", "12345"):  # Python's hash() would differ with PYTHONHASHSEED
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": seed, "PATH": ""})
        assert eval(out.stdout) == here
    # a pinned value guards against an accidental change of the hash (users would move)
    assert (bucket("alice", "version"), bucket("bob", "version")) == (3923, 4486)
    assert all(0 <= b < BUCKETS for b in here)


def test_split_proportions_and_stickiness():
    splitter = VersionSplitter({1: 90, 2: 10})
    users = [f"user-{i}" for i in range(20_000)]
    chosen = [splitter.version_for(routing_key(u, None)) for u in users]
    share2 = chosen.count(2) / len(users)
    # binomial sd = sqrt(.1*.9/20000) = 0.0021; 4 sd
    assert abs(share2 - 0.10) < 0.009
    # raising the canary only adds users: everyone on version 2 stays there
    wider = VersionSplitter({1: 70, 2: 30})
    for u, v in zip(users, chosen):
        if v == 2:
            assert wider.version_for(routing_key(u, None)) == 2
    assert VersionSplitter({1: 0, 2: 100}).version_for("u:x") == 2
    assert VersionSplitter({1: 100}).version_for("u:x") == 1
    # one version takes every key: the router needs no key (no hash, no random id) to route
    assert (VersionSplitter({1: 0, 2: 100}).only, VersionSplitter({1: 100}).only, splitter.only) == (2, 1, None)


def test_routing_key_prefers_user_then_request_id():
    assert routing_key("alice", "r1") == "u:alice"
    assert routing_key(None, "r1") == "r:r1"
    assert routing_key(None, None) != routing_key(None, None)


def test_shadow_sampling_share():
    sampled = sum(shadow_sampled(f"r:{i}", 25) for i in range(20_000))
    assert abs(sampled / 20_000 - 0.25) < 0.013
    assert not any(shadow_sampled(f"r:{i}", 0) for i in range(1000))
    assert all(shadow_sampled(f"r:{i}", 100) for i in range(1000))


def test_outputs_agree_with_tolerance():
    a = {"y": np.array([1.0, 2.0], dtype=np.float32)}
    assert outputs_agree(a, {"y": np.array([1.0, 2.0], dtype=np.float32)}) == (True, "")
    ok, why = outputs_agree(a, {"y": np.array([1.0, 2.001], dtype=np.float32)})
    assert not ok and "'y' differs by up to" in why
    assert outputs_agree(a, {"y": np.array([1.0, 2.001], dtype=np.float32)}, atol=0.01)[0]
    assert "shape" in outputs_agree(a, {"y": np.zeros(3, np.float32)})[1]
    assert "names differ" in outputs_agree(a, {"z": a["y"]})[1]
    s = {"t": np.array([b"a", b"b"], dtype=object)}
    assert outputs_agree(s, {"t": np.array([b"a", b"b"], dtype=object)})[0]
    assert not outputs_agree(s, {"t": np.array([b"a", b"c"], dtype=object)})[0]


def test_default_shadow_tolerance_accepts_rounding_and_catches_a_changed_result():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((16, 512)).astype(np.float32), rng.standard_normal((512, 64)).astype(np.float32)
    primary = {"y": x @ w}
    rounded = {"y": (x.astype(np.float64) @ w.astype(np.float64)).astype(np.float32)}  # another kernel's rounding
    assert not np.array_equal(primary["y"], rounded["y"])
    policy = ShadowPolicy()
    assert outputs_agree(primary, rounded, policy.atol, policy.rtol) == (True, "")
    for changed in (primary["y"] * 1.001, primary["y"] + 0.001):
        assert not outputs_agree(primary, {"y": changed}, policy.atol, policy.rtol)[0]
