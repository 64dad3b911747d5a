"""A demo target for the QoS router: ``y = 2x`` after a configurable service time.

Config parameters (all optional):
  service_time_ms   time each request takes (sleep), default 1
  version_<v>       behaviour of version <v>: "error", "sleep_ms=<ms>", or "offset=<float>"
                    (adds the offset to y, so a shadow comparison sees a difference)
The output ``version`` says which version answered, so clients can see the canary split.
"""

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from dspark.params import config_parameters


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = config_parameters(config)
        self.version = int(args["model_version"])
        self.service_s = float(params.get("service_time_ms", "1")) / 1000.0
        behaviour = params.get(f"version_{self.version}", "")
        self.fail = behaviour == "error"
        self.offset = float(behaviour.split("=", 1)[1]) if behaviour.startswith("offset=") else 0.0
        if behaviour.startswith("sleep_ms="):
            self.service_s = float(behaviour.split("=", 1)[1]) / 1000.0

    def execute(self, requests):
        responses = []
        for request in requests:
            time.sleep(self.service_s)
            if self.fail:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"router_demo_target version {self.version} is configured to fail")))
                continue
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            y = (x * 2 + self.offset).astype(np.float32)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("y", y),
                pb_utils.Tensor("version", np.array([self.version], dtype=np.int32)),
            ]))
        return responses
