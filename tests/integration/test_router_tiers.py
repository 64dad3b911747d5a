"""The demo QoS router (router_demo) on the session server: a client calls it as it would the target."""
from __future__ import annotations

import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from dspark.cli.route import read_metrics

pytestmark = pytest.mark.integration
X = np.array([1.0, 2.0, 3.0], dtype=np.float32)


def http_call(server, model, **kwargs):
    client = httpclient.InferenceServerClient(server.http_url)
    tensor = httpclient.InferInput("x", [3], "FP32")
    tensor.set_data_from_numpy(X)
    return client.infer(model, [tensor], **kwargs)


def grpc_call(server, model, **kwargs):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    tensor = grpcclient.InferInput("x", [3], "FP32")
    tensor.set_data_from_numpy(X)
    return client.infer(model, [tensor], **kwargs)


def dispatched(server, tier, expected=None, settle_s=0.7, timeout_s=10.0):
    """The tier's dispatch count: at once when it reaches ``expected``, else once it has stopped
    changing for ``settle_s``. The router exports its counts every 0.5 s, all of a tick's at once,
    so a count can land on /metrics after the client already has its answer (seen as a flake in CI)."""
    last, since = None, time.monotonic()
    deadline = since + timeout_s
    while time.monotonic() < deadline:
        value = sum(v for n, labels, v in read_metrics(server.metrics_url, "router_demo")
                    if n == "dspark_router_requests_total" and labels["tier"] == tier)
        if expected is not None and value >= expected:
            return value
        if value != last:
            last, since = value, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            break
        time.sleep(0.05)
    return last


def test_router_answers_like_the_target_over_http_and_grpc(triton_server):
    direct = http_call(triton_server, "router_demo_target").as_numpy("y")
    for call in (http_call, grpc_call):
        result = call(triton_server, "router_demo")
        np.testing.assert_allclose(result.as_numpy("y"), direct, atol=1e-5)
        assert result.as_numpy("version")[0] in (1, 2)


@pytest.mark.parametrize("call, how", [
    (http_call, "parameters"), (http_call, "headers"), (grpc_call, "parameters"), (grpc_call, "headers")])
def test_tier_from_parameters_and_forwarded_headers(triton_server, call, how):
    before = dispatched(triton_server, "diamond")
    kwargs = {"parameters": {"tier": "diamond"}} if how == "parameters" else {"headers": {"dspark-tier": "diamond"}}
    call(triton_server, "router_demo", **kwargs)
    assert dispatched(triton_server, "diamond", before + 1) == before + 1


def test_default_tier_and_unknown_tier(triton_server):
    before = dispatched(triton_server, "standard")
    answer = http_call(triton_server, "router_demo").as_numpy("y")
    assert dispatched(triton_server, "standard", before + 1) == before + 1
    with pytest.raises(InferenceServerException, match="parameter 'tier': unknown tier 'platinum'"):
        http_call(triton_server, "router_demo", headers={"dspark-tier": "platinum"})
    # the router keeps serving, with the same answer as before the bad request (within the
    # 1e-6 by which the target's two versions differ: the split may pick either)
    np.testing.assert_allclose(http_call(triton_server, "router_demo").as_numpy("y"), answer, rtol=1e-5)


def test_same_user_same_version_across_protocols(triton_server):
    for user in ("alice", "bob", "carol", "dave"):
        versions = {int(http_call(triton_server, "router_demo", parameters={"user_id": user}).as_numpy("version")[0]),
                    int(grpc_call(triton_server, "router_demo", headers={"dspark-user-id": user}).as_numpy("version")[0]),
                    int(http_call(triton_server, "router_demo", headers={"dspark-user-id": user}).as_numpy("version")[0])}
        assert len(versions) == 1, f"user {user} saw versions {versions}"


def test_tier_and_user_headers_are_matched_whatever_their_case(triton_server):
    """Over HTTP/1.1 a header name keeps the client's case (gRPC metadata names are lower case)."""
    call = http_call
    before = dispatched(triton_server, "diamond")
    call(triton_server, "router_demo", headers={"Dspark-Tier": "diamond"})
    call(triton_server, "router_demo", headers={"DSPARK-TIER": "diamond"})
    assert dispatched(triton_server, "diamond", before + 2) == before + 2
    with pytest.raises(InferenceServerException, match="parameter 'tier': unknown tier 'platinum'"):
        call(triton_server, "router_demo", headers={"Dspark-Tier": "platinum"})
    for user in ("alice", "bob", "carol", "dave"):
        versions = {int(call(triton_server, "router_demo", headers={name: user}).as_numpy("version")[0])
                    for name in ("dspark-user-id", "Dspark-User-Id", "DSPARK-USER-ID")}
        assert len(versions) == 1, f"user {user} saw versions {versions}"
