"""The QoS router's Triton side (``pb_utils`` is passed in, so this module imports no Triton
code): the target through BLS, the router's metrics on Triton's /metrics, answers through a
request's response sender, and log lines in Triton's log. backends/qos_router/model.py wires
them to ``dspark.routing.runtime.RouterCore``."""
from __future__ import annotations

import gc
import logging
from typing import Any, Callable, Optional

import numpy as np

from dspark.errors import DsparkError
from dspark.routing.metrics import RouterMetrics
from dspark.triton.adapter import triton_error

LATENCY_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0,
                   5.0, 10.0]
# key: (kind, name after dspark_router_, help)
ROUTER_METRICS = {
    "requests": ("COUNTER", "requests_total", "Requests dispatched to the target, by tier and version"),
    "rejections": ("COUNTER", "rejections_total", "Requests answered with an error, by tier and reason"),
    "target_errors": ("COUNTER", "target_errors_total", "Client requests whose target call failed or timed out, by version"),
    "queue": ("HISTOGRAM", "queue_seconds", "Time spent in the router's tier queue"),
    "latency": ("HISTOGRAM", "latency_seconds", "End-to-end latency through the router, by tier and version"),
    "shadow": ("COUNTER", "shadow_total", "Shadow calls by outcome (agree, disagree, error, skipped)"),
    "shadow_latency": ("HISTOGRAM", "shadow_latency_seconds", "Latency of shadow calls"),
    "weight": ("GAUGE", "tier_weight", "Current effective weight base*(1+f) per tier"),
    "factor": ("GAUGE", "fluctuation_factor", "Current QPS fluctuation factor f per tier"),
    "config": ("GAUGE", "config_version", "Version number of the routing config in effect"),
    "fast_path": ("COUNTER", "fast_path_total", "Requests forwarded by execute itself (router idle, target fast)"),
}


class TritonRouterMetrics(RouterMetrics):
    """RouterMetrics as ``dspark_router_*`` series of one router model."""

    def __init__(self, pb_utils: Any, model: str):
        self.model = model
        family = pb_utils.MetricFamily
        self.families = {key: family(f"dspark_router_{name}", description, getattr(family, kind))
                         for key, (kind, name, description) in ROUTER_METRICS.items()}
        self._metrics: dict = {}

    def _get(self, key: str, **labels: str) -> Any:
        series = (key, tuple(sorted(labels.items())))
        metric = self._metrics.get(series)
        if metric is None:
            family, full = self.families[key], {"model": self.model, **labels}
            metric = (family.Metric(labels=full, buckets=LATENCY_BUCKETS) if ROUTER_METRICS[key][0] == "HISTOGRAM"
                      else family.Metric(labels=full))
            self._metrics[series] = metric
        return metric

    def request(self, tier, version, count=1):
        self._get("requests", tier=tier, version=str(version)).increment(count)

    def rejection(self, tier, reason, count=1):
        self._get("rejections", tier=tier, reason=reason).increment(count)

    def target_error(self, version, count=1):
        self._get("target_errors", version=str(version)).increment(count)

    def queue_time(self, tier, seconds):
        self._get("queue", tier=tier).observe(seconds)

    def latency(self, tier, version, seconds):
        self._get("latency", tier=tier, version=str(version)).observe(seconds)

    def shadow(self, version, outcome, seconds):
        self._get("shadow", version=str(version), outcome=outcome).increment(1)
        if seconds is not None:
            self._get("shadow_latency", version=str(version)).observe(seconds)

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


class BlsTarget:
    """The target model through BLS. A payload is (input tensors, output names, the client's
    request, kept alive while its tensors are in use); outputs are the BLS response's tensors."""

    def __init__(self, pb_utils: Any, model: str):
        self.pb_utils = pb_utils
        self.model = model

    def call(self, payload, version, timeout_s):
        inputs, outputs, _request = payload
        if isinstance(inputs, dict):
            inputs = [self.pb_utils.Tensor(name, array) for name, array in inputs.items()]
        # the timeout also applies in the target's own queue where its queue policy allows it
        response = self.pb_utils.InferenceRequest(
            model_name=self.model, model_version=version, inputs=inputs,
            requested_output_names=outputs, timeout=max(1, int(timeout_s * 1e6)),
        ).exec()
        if response.has_error():
            raise RuntimeError(response.error().message())
        return response.output_tensors()

    def detach(self, payload):
        inputs, outputs, _request = payload
        return copies(inputs), outputs, None

    def arrays(self, outputs):
        return copies(outputs)


def copies(tensors) -> dict[str, np.ndarray]:
    """name -> copied array: a request's or BLS response's memory is released with its object."""
    if isinstance(tensors, dict):
        return {name: np.array(array, copy=True) for name, array in tensors.items()}
    return {t.name(): np.array(t.as_numpy(), copy=True) for t in tensors}


def responder(pb_utils: Any, sender: Any) -> Callable[[Any, Optional[DsparkError]], None]:
    """A job's ``respond``: its one final answer (outputs or the error) through the request's
    response sender."""
    def respond(outputs, error):
        response = (pb_utils.InferenceResponse(error=triton_error(pb_utils, error)) if error is not None
                    else pb_utils.InferenceResponse(outputs))
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    return respond


class TritonLogHandler(logging.Handler):
    """Records of ``dspark.routing`` as lines of Triton's log, at their level."""

    def __init__(self, pb_utils: Any):
        super().__init__()
        self.logger = pb_utils.Logger

    def emit(self, record):
        message = self.format(record)
        if record.levelno >= logging.ERROR:
            self.logger.log_error(message)
        elif record.levelno >= logging.WARNING:
            self.logger.log_warn(message)
        else:
            self.logger.log_info(message)
