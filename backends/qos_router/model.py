"""QoS router backend: fronts one target model with tiers, traffic graying and shadow traffic
(dspark.routing; its Triton side is dspark.triton.router; docs/router.md).

Not decoupled, so plain HTTP/gRPC ``/infer`` calls work. ``execute`` hands a queued request with
its response sender to ``RouterCore`` and returns None at once; the core's lane threads call the
target by tier and send exactly one final response per request. A request that finds the router
idle and the target fast takes the fast path: ``execute`` returns its response (no response
sender, ~0.3-0.5 ms less).

Config parameters (dspark.triton.params.RouterParameters): ``target_model`` (required),
``target_versions`` (default "1"; "*" for any), ``routing_file`` (default ``routing.yaml`` in
the model folder, re-read on change), ``poll_interval_ms`` (default 500: how often the file is
checked and the counters exported). The target's instance count comes from its config.pbtxt in
the same repository (``max_inflight: auto``).
"""
import json
import logging
import os
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils

from dspark.errors import DsparkError, RequestError
from dspark.params import parse_parameters
from dspark.routing.config import ConfigWatcher, target_instances
from dspark.routing.metrics import STAGES_ENV, StageTimes
from dspark.routing.request import route_fields
from dspark.routing.runtime import Job, RouterCore
from dspark.triton.adapter import triton_error
from dspark.triton.params import RouterParameters
from dspark.triton.router import BlsTarget, TritonLogHandler, TritonRouterMetrics, responder

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = config["name"]
        model_dir = Path(args["model_repository"])
        self.output_names = [o["name"] for o in config.get("output", [])]
        log = logging.getLogger("dspark.routing")
        if not any(isinstance(h, TritonLogHandler) for h in log.handlers):
            log.addHandler(TritonLogHandler(pb_utils))
        log.setLevel(logging.INFO)
        try:
            params = parse_parameters(RouterParameters, config, path=model_dir / "config.pbtxt")
            watcher = ConfigWatcher(params.routing_path(model_dir), params.versions())
        except DsparkError as exc:
            raise pb_utils.TritonModelException(f"router '{self.name}': {exc}") from None
        instances = target_instances(model_dir.parent, params.target_model)
        if instances is None:
            log.warning("router '%s': no config.pbtxt of '%s' next to the router; max_inflight 'auto' means 1 "
                        "call in flight: set max_inflight in %s", self.name, params.target_model, watcher.path)
        if sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) > 1:
            log.warning("router '%s': its instances schedule independently, each with its own queues and calls "
                        "in flight; one instance serves a few hundred requests/s or more (docs/router.md)", self.name)
        stages_dir = os.environ.get(STAGES_ENV)
        self.stages = StageTimes(Path(stages_dir) / f"{self.name}.json") if stages_dir else None
        self.metrics = TritonRouterMetrics(pb_utils, self.name)
        self.core = RouterCore(watcher, BlsTarget(pb_utils, params.target_model), self.metrics, name=self.name,
                               target_name=params.target_model, target_instances=instances, stage_times=self.stages,
                               poll_interval_s=params.poll_interval_ms / 1000)
        self.core.start()

    def _fields(self, request):
        """(tier, user id, request id, output names) of a client request; RequestError if bad."""
        fields = route_fields(request.parameters())
        return (fields.tier, fields.user_id, request.request_id() or None,
                list(request.requested_output_names() or self.output_names))

    def execute(self, requests):
        started = time.monotonic()
        if len(requests) == 1:
            request = requests[0]
            try:
                fields = self._fields(request)
            except RequestError as exc:
                return [pb_utils.InferenceResponse(error=triton_error(pb_utils, exc))]
            ticket = self.core.try_inline(*fields[:3])
            if ticket is None:
                self._submit(request, fields)
            else:
                try:
                    tensors = self.core.run_inline(ticket, (request.inputs(), fields[3], request))
                except Exception as exc:
                    return [pb_utils.InferenceResponse(error=triton_error(pb_utils, exc, f"router '{self.name}'"))]
                return [pb_utils.InferenceResponse(tensors)]
        else:
            for request in requests:
                try:
                    fields = self._fields(request)
                except RequestError as exc:
                    request.get_response_sender().send(pb_utils.InferenceResponse(error=triton_error(pb_utils, exc)),
                                                       flags=FINAL)
                    continue
                self._submit(request, fields)
        if self.stages is not None:
            self.stages.add("queued: execute", (time.monotonic() - started) / len(requests))
        return None

    def _submit(self, request, fields):
        tier, user_id, request_id, outputs = fields
        self.core.submit(Job(payload=(request.inputs(), outputs, request),
                             respond=responder(pb_utils, request.get_response_sender()), tier=tier, user_id=user_id,
                             request_id=request_id, is_cancelled=request.is_cancelled))

    def finalize(self):
        self.core.stop()
        self.metrics.close()
