"""deploy/k8s: the manifests are valid Kubernetes objects (the schemas of kubernetes-validate,
offline), probe model readiness, and wire the router, its synced routing file and the
controller together as dspark expects; the routing sidecar's sync against an S3 (moto) bucket."""
from __future__ import annotations

import shlex

import boto3
import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner
from moto import mock_aws

from dspark.cli.rollout import rollout as rollout_cli
from dspark.paths import project_root
from dspark.repository.modelspec import parse_config_text
from dspark.rollout.store import sync_file

K8S = project_root() / "deploy" / "k8s"
VERSION = kubernetes_validate.latest_version()


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


@pytest.mark.parametrize("name", ["triton-fleet.yaml", "rollout-job.yaml"])
def test_manifests_validate_against_the_kubernetes_schemas(name):
    docs = documents(name)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, VERSION, strict=True)  # raises naming the bad field


def test_a_broken_manifest_is_caught():
    deployment = next(d for d in documents("triton-fleet.yaml") if d["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSION, strict=True)


def test_fleet_probes_model_readiness_and_syncs_the_routers_routing_file():
    docs = {d["kind"] + "/" + d["metadata"]["name"]: d for d in documents("triton-fleet.yaml")}
    pod = docs["Deployment/triton-fleet"]["spec"]["template"]["spec"]
    triton, sidecar = pod["containers"]
    env = {e["name"]: e.get("value") for e in triton["env"]}
    loaded = env["LOAD_MODELS"].split(",")
    assert env["MODEL_REPOSITORY"].startswith("s3://")
    for probe in ("readinessProbe", "startupProbe"):
        path = triton[probe]["httpGet"]["path"]
        assert path.startswith("/v2/models/") and path.endswith("/ready") and path.split("/")[3] in loaded
    config = parse_config_text(docs["ConfigMap/dspark-router"]["data"]["config.pbtxt"])
    parameters = {k: v.string_value for k, v in config.parameters.items()}
    assert config.backend == "qos_router" and parameters["target_versions"] == "*"
    assert parameters["target_model"] in loaded and config.name in loaded
    routing_mount = next(m["mountPath"] for m in triton["volumeMounts"] if m["name"] == "routing")
    assert parameters["routing_file"].startswith(routing_mount + "/")
    assert sidecar["command"][:3] == ["dspark", "rollout", "sync-routing"]
    assert sidecar["command"][4] == parameters["routing_file"]
    headless = docs["Service/triton-fleet-pods"]
    assert headless["spec"]["clusterIP"] == "None"
    # the controller Job writes the object the sidecars read and finds the pods through DNS
    job = next(d for d in documents("rollout-job.yaml") if d["kind"] == "Job")
    script = job["spec"]["template"]["spec"]["containers"][0]["command"][2]
    run = shlex.split(script.split("exec ", 1)[1])
    assert run[run.index("--routing-file") + 1] == sidecar["command"][3]
    assert run[run.index("--servers-dns") + 1] == f"{headless['metadata']['name']}:8000"
    assert run[run.index("--repository") + 1] == env["MODEL_REPOSITORY"]
    options = CliRunner().invoke(rollout_cli, ["run", "--help"]).output
    assert all(word in options for word in run if word.startswith("--"))


@mock_aws
def test_sync_routing_copies_the_object_only_when_it_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="models")
    s3.put_object(Bucket="models", Key="routing/r.yaml", Body=b"version: 1\n")
    target = tmp_path / "routing.yaml"
    sync_file("s3://models/routing/r.yaml", target, once=True)
    assert target.read_text() == "version: 1\n"
    stamp = target.stat().st_mtime_ns
    sync_file("s3://models/routing/r.yaml", target, once=True)
    assert target.stat().st_mtime_ns == stamp  # unchanged: the router is not made to re-read it
    s3.put_object(Bucket="models", Key="routing/r.yaml", Body=b"version: 2\n")
    sync_file("s3://models/routing/r.yaml", target, once=True)
    assert target.read_text() == "version: 2\n"
