"""The one demo target: ``y = scale·x + offset`` after a service time, with an output
``version`` saying which version answered. Two models run it:

- ``backends/router_demo_target`` (the router's demo and benchmark target) reads its behaviour
  from config parameters: ``service_time_ms`` (default 1) and ``version_<v>``: ``error``,
  ``sleep_ms=<ms>`` or ``offset=<float>`` (a shadow comparison then sees a difference).
- ``rollout_demo``'s artifacts (dspark.rollout.demo.model_artifact) are a ``model.py`` whose
  class sets ``behaviour``: each version is one file, so a rollout has something to deploy.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np


@dataclass(frozen=True)
class Behaviour:
    """How one version answers. ``fail_after``: requests answered before every request fails
    (None: never; 0: fails at once); ``broken_where``: an environment variable on whose servers
    the version fails to load."""

    service_ms: float = 1.0
    scale: float = 2.0
    offset: float = 0.0
    fail_after: Optional[int] = None
    broken_where: str = ""

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], version: int) -> "Behaviour":
        """``service_time_ms`` and ``version_<version>`` (``error``, ``sleep_ms=``, ``offset=``)."""
        service_ms = float(params.get("service_time_ms", "1"))
        rule = params.get(f"version_{version}", "")
        name, _, value = rule.partition("=")
        return cls(service_ms=float(value) if name == "sleep_ms" else service_ms,
                   offset=float(value) if name == "offset" else 0.0,
                   fail_after=0 if rule == "error" else None)


class DemoTarget:
    """A Triton Python model. The ``model.py`` that subclasses it sets ``pb_utils`` (the stub's
    module: only ``model.py`` files import it); ``behaviour`` None: read from the config
    parameters."""

    pb_utils: Any = None
    behaviour: Optional[Behaviour] = None

    def initialize(self, args):
        from dspark.params import config_parameters

        config = json.loads(args["model_config"])
        self.name = config.get("name", "demo target")
        self.version = int(args["model_version"])
        behaviour = self.behaviour or Behaviour.from_parameters(config_parameters(config), self.version)
        if behaviour.broken_where and os.environ.get(behaviour.broken_where):
            raise RuntimeError(f"{self.name} cannot load on this server ({behaviour.broken_where} is set)")
        self.behaviour = behaviour
        self.served = 0
        self.pb_utils.Logger.log_info(f"{self.name}: {behaviour} loaded as version {self.version}")

    def execute(self, requests):
        pb_utils, behaviour, responses = self.pb_utils, self.behaviour, []
        for request in requests:
            time.sleep(behaviour.service_ms / 1000.0)
            self.served += 1
            if behaviour.fail_after is not None and self.served > behaviour.fail_after:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"{self.name} version {self.version} is configured to fail")))
                continue
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("y", (behaviour.scale * x + behaviour.offset).astype(np.float32)),
                pb_utils.Tensor("version", np.array([self.version], dtype=np.int32)),
            ]))
        return responses
