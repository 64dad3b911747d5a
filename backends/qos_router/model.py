"""QoS router backend: fronts one target model with tiers, traffic graying and shadow traffic.

Design (see docs/router.md): the model is *not* decoupled, so plain HTTP/gRPC ``/infer`` calls
work, but ``execute`` does not answer a queued request inline: it hands the request with its
response sender to ``RouterCore`` and returns None at once. The core's lane threads dispatch by
tier with blocking BLS calls (as many in flight as the target has instances, plus headroom for
the top tier) and send exactly one final response per request.

Fast path: a request that finds the router idle (nothing queued, a slot free, the target
recently faster than ``inline_max_ms``) is answered by ``execute`` returning the response (the
call runs on a pool thread so a hung target costs the client only the tier's timeout): the
response sender costs ~0.3-0.5 ms per request in the Python backend.

Config parameters: ``target_model`` (required), ``target_versions`` (comma-separated versions the
router may route to, default "1"), ``routing_file`` (default ``routing.yaml`` in the model
directory, re-read on change). The target's instance count comes from its config.pbtxt in the
same repository (``max_inflight: auto``).
"""

import gc
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from dspark.errors import ConfigError, RequestError
from dspark.routing.config import ConfigWatcher, router_parameters, target_instances
from dspark.routing.request import parse_parameters
from dspark.routing.runtime import Job, RouterCore, RouterMetrics, StageTimes
from dspark.params import config_parameters
from dspark.triton.adapter import triton_error

LATENCY_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0,
                   5.0, 10.0]
STAGES_ENV = "DSPARK_ROUTER_STAGES"  # a folder: per-stage timings of recent requests, as JSON


class _TritonLogHandler(logging.Handler):
    def emit(self, record):
        message = self.format(record)
        if record.levelno >= logging.ERROR:
            pb_utils.Logger.log_error(message)
        elif record.levelno >= logging.WARNING:
            pb_utils.Logger.log_warn(message)
        else:
            pb_utils.Logger.log_info(message)


class _TritonMetrics(RouterMetrics):
    """RouterMetrics on Triton's /metrics through pb_utils.MetricFamily."""

    def __init__(self, model: str):
        self.model = model
        fam = pb_utils.MetricFamily
        self.families = {
            "requests": fam("dspark_router_requests_total", "Requests dispatched to the target, by tier and version", fam.COUNTER),
            "rejections": fam("dspark_router_rejections_total", "Requests answered with an error, by tier and reason", fam.COUNTER),
            "target_errors": fam("dspark_router_target_errors_total",
                                 "Client requests whose target call failed or timed out, by version", fam.COUNTER),
            "queue": fam("dspark_router_queue_seconds", "Time spent in the router's tier queue", fam.HISTOGRAM),
            "latency": fam("dspark_router_latency_seconds", "End-to-end latency through the router, by tier and version", fam.HISTOGRAM),
            "shadow": fam("dspark_router_shadow_total", "Shadow calls by outcome (agree, disagree, error, skipped)", fam.COUNTER),
            "shadow_latency": fam("dspark_router_shadow_latency_seconds", "Latency of shadow calls", fam.HISTOGRAM),
            "weight": fam("dspark_router_tier_weight", "Current effective weight base*(1+f) per tier", fam.GAUGE),
            "factor": fam("dspark_router_fluctuation_factor", "Current QPS fluctuation factor f per tier", fam.GAUGE),
            "config": fam("dspark_router_config_version", "Version number of the routing config in effect", fam.GAUGE),
            "fast_path": fam("dspark_router_fast_path_total",
                             "Requests forwarded by execute itself (router idle, target fast)", fam.COUNTER),
        }
        self._metrics = {}

    def _get(self, family, histogram=False, **labels):
        key = (family, tuple(sorted(labels.items())))
        metric = self._metrics.get(key)
        if metric is None:
            labels = {"model": self.model, **labels}
            fam = self.families[family]
            metric = fam.Metric(labels=labels, buckets=LATENCY_BUCKETS) if histogram else fam.Metric(labels=labels)
            self._metrics[key] = metric
        return metric

    def request(self, tier, version, count=1):
        self._get("requests", tier=tier, version=str(version)).increment(count)

    def rejection(self, tier, reason, count=1):
        self._get("rejections", tier=tier, reason=reason).increment(count)

    def target_error(self, version, count=1):
        self._get("target_errors", version=str(version)).increment(count)

    def queue_time(self, tier, seconds):
        self._get("queue", True, tier=tier).observe(seconds)

    def latency(self, tier, version, seconds):
        self._get("latency", True, tier=tier, version=str(version)).observe(seconds)

    def shadow(self, version, outcome, seconds):
        self._get("shadow", version=str(version), outcome=outcome).increment(1)
        if seconds is not None:
            self._get("shadow_latency", True, version=str(version)).observe(seconds)

    def weights(self, tier, weight, factor):
        self._get("weight", tier=tier).set(weight)
        self._get("factor", tier=tier).set(factor)

    def config_version(self, version):
        self._get("config").set(version)

    def fast_path(self, count):
        self._get("fast_path").increment(count)

    def close(self):
        """Remove this router's series from /metrics (a stub that exits leaves them there):
        each metric first, then the families, as Triton requires."""
        self._metrics.clear()
        self.families.clear()
        gc.collect()


class _BlsTarget:
    """The target model through BLS. A payload is (input tensors, output names, the client's
    request, kept alive while its tensors are in use); outputs are the BLS response's tensors."""

    def __init__(self, model):
        self.model = model

    def call(self, payload, version, timeout_s):
        inputs, outputs, _request = payload
        if isinstance(inputs, dict):
            inputs = [pb_utils.Tensor(name, array) for name, array in inputs.items()]
        # the timeout also applies in the target's own queue where its queue policy allows it
        response = pb_utils.InferenceRequest(
            model_name=self.model, model_version=version, inputs=inputs,
            requested_output_names=outputs, timeout=max(1, int(timeout_s * 1e6)),
        ).exec()
        if response.has_error():
            raise RuntimeError(response.error().message())
        return response.output_tensors()

    def detach(self, payload):
        inputs, outputs, _request = payload
        return _copies(inputs), outputs, None

    def arrays(self, outputs):
        return _copies(outputs)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = config["name"]
        params = config_parameters(config)
        self.target = params.get("target_model")
        if not self.target:
            raise pb_utils.TritonModelException(
                f"router '{self.name}': config parameter 'target_model' is required (the model to front)")
        model_dir = Path(args["model_repository"])
        self.output_names = [o["name"] for o in config.get("output", [])]

        log = logging.getLogger("dspark.routing")
        if not any(isinstance(h, _TritonLogHandler) for h in log.handlers):
            log.addHandler(_TritonLogHandler())
        log.setLevel(logging.INFO)
        try:
            routing_file, versions = router_parameters(params, model_dir)
            watcher = ConfigWatcher(routing_file, versions)
        except ConfigError as exc:
            raise pb_utils.TritonModelException(f"router '{self.name}': {exc}") from None
        instances = target_instances(model_dir.parent, self.target)
        if instances is None:
            log.warning("router '%s': no config.pbtxt of '%s' next to the router; max_inflight 'auto' means 1 "
                        "call in flight: set max_inflight in %s", self.name, self.target, routing_file)
        router_count = sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1
        if router_count > 1:
            log.warning("router '%s': %d instances schedule independently, each with its own queues and "
                        "calls in flight; one instance serves a few hundred requests/s or more (docs/router.md)",
                        self.name, router_count)
        stages_dir = os.environ.get(STAGES_ENV)
        self.stages = StageTimes(Path(stages_dir) / f"{self.name}.json") if stages_dir else None
        self.metrics = _TritonMetrics(self.name)
        self.core = RouterCore(watcher, _BlsTarget(self.target), self.metrics, name=self.name,
                               target_name=self.target, target_instances=instances, stage_times=self.stages)
        self.core.start()

    def _fields(self, request):
        """(tier, user id, request id, output names) of a client request; RequestError if bad."""
        fields = parse_parameters(request.parameters())
        return (fields.tier, fields.user_id, request.request_id() or None,
                list(request.requested_output_names() or self.output_names))

    def execute(self, requests):
        started = time.monotonic()
        if len(requests) == 1:
            request = requests[0]
            try:
                tier, user_id, request_id, outputs = self._fields(request)
            except RequestError as exc:
                return [pb_utils.InferenceResponse(error=triton_error(pb_utils, exc))]
            ticket = self.core.try_inline(tier, user_id, request_id)
            if ticket is not None:
                try:
                    tensors = self.core.run_inline(ticket, (request.inputs(), outputs, request))
                except Exception as exc:
                    return [pb_utils.InferenceResponse(error=triton_error(pb_utils, exc, f"router '{self.name}'"))]
                return [pb_utils.InferenceResponse(tensors)]
        for request in requests:
            sender = request.get_response_sender()
            try:
                tier, user_id, request_id, outputs = self._fields(request)
            except RequestError as exc:
                sender.send(pb_utils.InferenceResponse(error=triton_error(pb_utils, exc)),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            self.core.submit(Job(payload=(request.inputs(), outputs, request), respond=_responder(sender),
                                 tier=tier, user_id=user_id, request_id=request_id,
                                 is_cancelled=request.is_cancelled))
        if self.stages is not None:
            self.stages.add("queued: execute", (time.monotonic() - started) / len(requests))
        return None

    def finalize(self):
        self.core.stop()
        self.metrics.close()


def _copies(tensors):
    """name -> copied array: a request's or BLS response's memory is released with its object."""
    if isinstance(tensors, dict):
        return {name: np.array(array, copy=True) for name, array in tensors.items()}
    return {t.name(): np.array(t.as_numpy(), copy=True) for t in tensors}


def _responder(sender):
    def respond(outputs, error):
        response = (pb_utils.InferenceResponse(error=triton_error(pb_utils, error)) if error is not None
                    else pb_utils.InferenceResponse(outputs))
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    return respond
