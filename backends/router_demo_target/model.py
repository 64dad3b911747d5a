"""A demo target for the QoS router: ``y = 2x`` after ``service_time_ms`` (default 1), each
version's behaviour set by a config parameter ``version_<v>`` (``error``, ``sleep_ms=<ms>``,
``offset=<float>``); see dspark.triton.demo_target."""

from dspark.triton.demo_target import DemoTarget as TritonPythonModel  # noqa: F401
