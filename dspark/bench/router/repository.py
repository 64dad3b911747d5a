"""The router bench's repository and server: a sleep-based target, the routers in front of it
(the default routing and any ``Variant``), and for the overhead at low load a 1 ms target, bare
BLS forwarders (the floors of the router's two paths) and a zero-time target for one router's
ceiling."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Sequence

from dspark.bench.router.scenarios import ROUTER_CEILING_INSTANCES, RouterBenchSettings, Variant
from dspark.routing.config import RoutingConfig
from dspark.routing.metrics import STAGES_ENV

def model_config(name: str, backend: str, instances: int, parameters: dict[str, str]) -> str:
    """config.pbtxt of a bench model (x -> y, version), through Triton's own schema."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = model_config_pb2.ModelConfig(name=name, backend=backend, max_batch_size=0)
    config.input.add(name="x", data_type=model_config_pb2.TYPE_FP32, dims=[-1])
    config.output.add(name="y", data_type=model_config_pb2.TYPE_FP32, dims=[-1])
    config.output.add(name="version", data_type=model_config_pb2.TYPE_INT32, dims=[1])
    config.instance_group.add(count=instances, kind=model_config_pb2.ModelInstanceGroup.KIND_CPU)
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return text_format.MessageToString(config)


# Bare BLS forwarders: the floors of the router's two paths (nothing but the BLS hop)
FORWARD_RETURN = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    # the fast path's floor: call the target in execute and return its response
    def execute(self, requests):
        return [pb_utils.InferenceResponse(pb_utils.InferenceRequest(
            model_name="{target}", inputs=r.inputs(), requested_output_names=["y", "version"]
        ).exec().output_tensors()) for r in requests]
"""

FORWARD_SENDER = """
import queue
import threading

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    # any queued path's floor: execute returns at once, a worker thread calls the target and
    # answers through the response sender
    def initialize(self, args):
        self.jobs = queue.SimpleQueue()
        threading.Thread(target=self.work, daemon=True).start()

    def work(self):
        while True:
            request, sender = self.jobs.get()
            response = pb_utils.InferenceRequest(
                model_name="{target}", inputs=request.inputs(), requested_output_names=["y", "version"]).exec()
            sender.send(pb_utils.InferenceResponse(response.output_tensors()),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def execute(self, requests):
        for request in requests:
            self.jobs.put((request, request.get_response_sender()))
        return None
"""


def build_repository(root: Path, service_ms: float, instances: int, variants: Sequence[Variant],
                     overhead: bool = True) -> None:
    """The bench's models; without ``overhead`` only the target and the routers in front of it."""
    def add(name: str, backend: str, count: int, parameters: dict[str, str], model_py: str | None = None) -> None:
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(model_config(name, backend, count, parameters))
        if model_py is not None:
            (root / name / "1" / "model.py").write_text(model_py)

    default = replace(RoutingConfig(), shares={1: 100.0})  # the demo's routing: shares 100, no shadow
    routers = {variant.model: replace(default, max_inflight=variant.max_inflight, top_tier_headroom=variant.headroom,
                                      handoff_lead_ms=variant.lead_ms)
               for variant in [Variant(), *variants]}
    add("bench_target", "router_demo_target", instances, {"service_time_ms": f"{service_ms:g}"})
    if overhead:
        add("bench_t1", "router_demo_target", instances, {"service_time_ms": "1"})
        for target in ("bench_target", "bench_t1"):
            add(f"fwd_return_{target}", "python", 1, {}, FORWARD_RETURN.format(target=target))
            add(f"fwd_sender_{target}", "python", 1, {}, FORWARD_SENDER.format(target=target))
        # the router's own ceiling: a zero-time target with more instances than the CPU has cores
        add("bench_t0", "router_demo_target", ROUTER_CEILING_INSTANCES, {"service_time_ms": "0"})
        routers.update(router_t1=default, router_t0=default, router_t1_queued=replace(default, inline_max_ms=0.0))
    for name, routing in routers.items():
        target = "bench_t1" if name.startswith("router_t1") else "bench_t0" if name == "router_t0" else "bench_target"
        add(name, "qos_router", 1, {"target_model": target, "target_versions": "1"})
        routing.save(root / name / "routing.yaml")


@contextlib.contextmanager
def bench_server(settings: RouterBenchSettings) -> Iterator[tuple[object, Path]]:
    """A server on free loopback ports serving the bench's repository (removed afterwards), the
    routers writing their stage timings into the folder yielded beside it."""
    from dspark.server.launcher import TritonServer

    root = Path(tempfile.mkdtemp(prefix="dspark-bench-router-"))
    previous = os.environ.get(STAGES_ENV)
    server = None
    try:
        build_repository(root / "repo", settings.service_ms, settings.instances, settings.variants, settings.overhead)
        (root / "stages").mkdir()
        os.environ[STAGES_ENV] = str(root / "stages")
        server = TritonServer([root / "repo"])
        server.start()
        yield server, root / "stages"
    finally:
        if server is not None:
            server.stop()
        if previous is None:
            os.environ.pop(STAGES_ENV, None)
        else:
            os.environ[STAGES_ENV] = previous
        shutil.rmtree(root, ignore_errors=True)

