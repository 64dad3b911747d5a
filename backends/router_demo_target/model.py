"""A demo target for the QoS router: ``y = 2x`` after ``service_time_ms`` (default 1), each
version's behaviour set by a config parameter ``version_<v>`` (``error``, ``sleep_ms=<ms>``,
``offset=<float>``); see dspark.triton.demo_target."""

import triton_python_backend_utils as pb_utils

from dspark.triton.demo_target import DemoTarget


class TritonPythonModel(DemoTarget):
    pb_utils = pb_utils
