"""A small deployment to try rollouts on (tests, the benchmark, the docs' walk-through).

``rollout_demo`` is a Python-backend model whose artifact is its ``model.py``: the demo target
(dspark.triton.demo_target, ``y = 2x`` after a service time), with knobs to make a version slow, failing or different, so a rollout has
something real to catch. ``rollout_router`` is the QoS router in front of it, allowed to route
to any version (``target_versions: "*"``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from dspark.repository import atomic
from dspark.repository.modelspec import InstanceGroup, ModelSpec, TensorSpec, VersionRecord
from dspark.routing.config import RoutingConfig, ShadowPolicy, TierPolicy
from dspark.triton.demo_target import Behaviour

MODEL = "rollout_demo"
ROUTER = "rollout_router"

MODEL_PY = '''"""{model} {semver}: y = {scale}x + {offset} after {service_ms} ms{failing}."""
import triton_python_backend_utils as pb_utils

from dspark.triton.demo_target import Behaviour, DemoTarget


class TritonPythonModel(DemoTarget):
    pb_utils = pb_utils
    behaviour = {behaviour!r}
'''


def model_artifact(path: Path, semver: str, service_ms: float = 10.0, fail_after: Optional[int] = None,
                   offset: float = 0.0, broken_where: str = "", scale: float = 2.0) -> Path:
    """Write a ``model.py`` for one version of ``rollout_demo``: the demo target
    (dspark.triton.demo_target) answering y = ``scale`` x + ``offset`` after ``service_ms`` per
    request, failing every request after ``fail_after`` answered ones, failing to load on
    servers whose environment has the variable ``broken_where``."""
    behaviour = Behaviour(service_ms=service_ms, scale=scale, offset=offset, fail_after=fail_after,
                          broken_where=broken_where)
    failing = f", failing after {fail_after} requests" if fail_after is not None else ""
    path.write_text(MODEL_PY.format(model=MODEL, semver=semver, service_ms=service_ms, scale=scale, offset=offset,
                                    failing=failing, behaviour=behaviour))
    return path


def build_repository(root: Path, service_ms: float = 10.0, instances: int = 2,
                     routing_file: Optional[Path] = None, deadline_ms: float = 1000.0,
                     model: str = MODEL, router: bool = True, poll_interval_ms: Optional[float] = None) -> Path:
    """A repository with ``model`` (``rollout_demo``) 1.0.0 in folder 1 and ``rollout_router`` in
    front of it. With a router the model serves the versions a rollout names; without one it
    serves the "latest" version (hot reload by `dspark repo add` / `publish`).

    Tier deadlines are short (``deadline_ms``) so that a version drains quickly after traffic
    leaves it. ``routing_file``: where the router reads its routing (default: next to it);
    ``poll_interval_ms``: how often the router re-reads it (default: the router's 500 ms).
    """
    root.mkdir(parents=True, exist_ok=True)
    model_dir = root / model
    model_dir.mkdir(exist_ok=True)
    spec = ModelSpec(
        name=model, framework="python",
        versions=[VersionRecord(semver="1.0.0", folder=1, artifact="model.py")],
        inputs=[TensorSpec("x", "FP32", [-1])],
        outputs=[TensorSpec("y", "FP32", [-1]), TensorSpec("version", "INT32", [1])],
        instance_groups=[InstanceGroup("CPU", instances)],
        serve_versions=["1.0.0"] if router else "latest",
    )
    (model_dir / "1").mkdir(exist_ok=True)
    model_artifact(model_dir / "1" / "model.py", "1.0.0", service_ms)
    spec.save(model_dir / "modelspec.yaml")
    atomic.write_text(model_dir / "config.pbtxt", spec.config_text())
    if not router:
        return root

    router_dir = root / ROUTER
    (router_dir / "1").mkdir(parents=True, exist_ok=True)
    config = mc.ModelConfig(name=ROUTER, backend="qos_router", max_batch_size=0)
    config.input.add(name="x", data_type=mc.TYPE_FP32, dims=[-1])
    config.output.add(name="y", data_type=mc.TYPE_FP32, dims=[-1])
    config.output.add(name="version", data_type=mc.TYPE_INT32, dims=[1])
    config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)
    routing_file = routing_file or router_dir / "routing.yaml"
    for key, value in (("target_model", MODEL), ("target_versions", "*"), ("routing_file", str(routing_file)),
                       ("poll_interval_ms", poll_interval_ms)):
        if value is not None:
            config.parameters[key].string_value = str(value)
    (router_dir / "config.pbtxt").write_text(text_format.MessageToString(config))
    # short queue deadlines (a version drains fast) but a generous call timeout: a reload on a
    # busy host can hold a call for a second, which should make it slow, not failed
    tiers = {name: TierPolicy(weight=w, deadline_ms=deadline_ms, timeout_ms=30_000) for name, w in
             (("diamond", 8), ("gold", 3), ("standard", 1))}
    RoutingConfig(tiers=tiers, shares={1: 100.0}, max_inflight=instances + 1,
                  shadow=ShadowPolicy(max_inflight=instances, ignore_outputs=("version",))
                  ).validate().save(routing_file)
    return root


class LoadGenerator:
    """Client threads calling the router on each server without pause (the load a rollout must
    not disturb). Every answer or failure is recorded with its time, server and version."""

    def __init__(self, urls: list[str], model: str = ROUTER, threads_per_server: int = 2):
        import threading
        self.urls, self.model = list(urls), model
        self.threads_per_server = threads_per_server
        self.results: list[tuple[float, str, object]] = []  # (time, url, version or error text)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(url, i), daemon=True)
                         for url in self.urls for i in range(threads_per_server)]

    def _run(self, url: str, worker: int) -> None:
        import time
        import numpy as np
        import tritonclient.http as httpclient
        from tritonclient.utils import InferenceServerException

        client = httpclient.InferenceServerClient(url, network_timeout=30)
        tensor = httpclient.InferInput("x", [3], "FP32")
        tensor.set_data_from_numpy(np.array([1.0, 2.0, 3.0], dtype=np.float32))
        sent = 0
        while not self._stop.is_set():
            sent += 1
            try:
                result = client.infer(self.model, [tensor], parameters={"user_id": f"{url}-{worker}-{sent}"})
                outcome: object = int(result.as_numpy("version")[0])
            except InferenceServerException as error:
                outcome = error.message()
            except Exception as error:  # connection trouble counts as a failed request too
                outcome = f"{type(error).__name__}: {error}"
            self.results.append((time.monotonic(), url, outcome))
        client.close()

    def start(self) -> "LoadGenerator":
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def failures(self, since: float = 0.0) -> list[tuple[float, str, object]]:
        return [r for r in self.results if r[0] >= since and isinstance(r[2], str)]

    def versions(self, since: float = 0.0) -> set[int]:
        return {r[2] for r in self.results if r[0] >= since and isinstance(r[2], int)}


def serve_s3(port: int):
    """A moto S3 server on loopback (tests and the benchmark): returns it started; ``.stop()`` it.
    Sets the dummy AWS credentials boto3 and Triton's S3 client read from the environment."""
    import os

    from moto.server import ThreadedMotoServer

    for key, value in (("AWS_ACCESS_KEY_ID", "dspark"), ("AWS_SECRET_ACCESS_KEY", "dspark"),
                       ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_REGION", "us-east-1")):
        os.environ.setdefault(key, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server


def publish_to_s3(local_repository: Path, url: str, models: tuple[str, ...] = (MODEL,)) -> None:
    """Copy models of a local repository to an S3 repository (creating the bucket)."""
    from dspark.rollout.store import S3Store

    store = S3Store(url)
    try:
        store.client.create_bucket(Bucket=store.bucket)
    except store.client.exceptions.BucketAlreadyOwnedByYou:
        pass
    for name in models:
        store.install_folder(name, local_repository / name, "")


def serve_prometheus(targets: list[str], workdir: Path, port: int, scrape_s: float = 0.5):
    """Debian's ``prometheus`` scraping ``targets`` (host:port of each /metrics) every
    ``scrape_s``, listening on loopback; returns (process, URL). The caller terminates it."""
    import shutil
    import subprocess
    import time
    import urllib.request

    import yaml

    binary = shutil.which("prometheus")
    if binary is None:
        raise FileNotFoundError("prometheus is not installed: `make prometheus` (apt-get install prometheus)")
    workdir.mkdir(parents=True, exist_ok=True)
    config = {"global": {"scrape_interval": f"{int(scrape_s * 1000)}ms", "scrape_timeout": f"{int(scrape_s * 1000)}ms"},
              "scrape_configs": [{"job_name": "triton", "static_configs": [{"targets": targets}]}]}
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    process = subprocess.Popen(
        [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=open(workdir / "prometheus.log", "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as response:
                if response.status == 200:
                    return process, url
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"prometheus did not start: see {workdir / 'prometheus.log'}")
        time.sleep(0.2)
