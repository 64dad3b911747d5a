"""TensorRT engines built from a model's ONNX file, cached on disk, run with CuPy buffers.

Used by the `onnx` backend when a model says `engine: tensorrt`; where `tensorrt` does not import
or no NVIDIA GPU is present, `probe()` says why and the backend applies the model's fallback policy
(ONNX Runtime with its provider preference, with a warning and a metric, or a failed load under
`disable_cpu_ep_fallback`). ONNX Runtime's own TensorRT execution provider is the other route
(`execution_providers: TensorRT,CUDA,CPU` with `trt_*` options, dspark.runtimes.accel.providers).

The cache key is the model, its version, the GPU (name and compute capability), the TensorRT
version and a hash of the ONNX bytes and build settings: a plan is only ever loaded on the GPU and
TensorRT it was built for, and a changed model or setting builds a new one.
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping, Optional, Sequence

import numpy as np
from pydantic import Field

from dspark.runtimes.accel import devices
from dspark.errors import ConfigError
from dspark.params import ConfigParameters, parse_parameters
from dspark.runtimes.accel.providers import Probe, ProviderChoice

ENGINE = "TensorRT engine"  # the name this route carries in provider choices, logs and metrics


def probe() -> Probe:
    """Usable = `tensorrt` and CuPy import and an NVIDIA GPU is present."""
    try:
        import tensorrt
    except ImportError:
        return Probe(ENGINE, False, "the tensorrt Python package is not installed (pip install tensorrt)")
    gpu = devices.nvidia_gpus()
    if not gpu.present:
        return Probe(ENGINE, False, f"no device: {gpu.detail}")
    try:
        import cupy  # noqa: F401  (device buffers)
    except ImportError:
        return Probe(ENGINE, False, "CuPy is not installed (it holds the engine's device buffers)")
    return Probe(ENGINE, True, f"TensorRT {tensorrt.__version__} on {gpu.detail}")


@dataclass(frozen=True)
class BuildSettings:
    fp16: bool = False
    workspace_bytes: int = 1 << 30
    max_batch: int = 8  # the largest size of a dynamic first axis
    max_dynamic: int = 128  # the largest size of any other dynamic axis


def gpu_identity() -> str:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return f"{name} sm{props['major']}{props['minor']}"


def engine_path(cache_dir: Path, model: str, version: str, onnx_path: Path, settings: BuildSettings,
                gpu: str, trt_version: str) -> Path:
    digest = hashlib.sha256(Path(onnx_path).read_bytes())
    digest.update(json.dumps(settings.__dict__, sort_keys=True).encode())
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", gpu).strip("-")
    return Path(cache_dir) / model / str(version) / f"{slug}_trt{trt_version}_{digest.hexdigest()[:16]}.plan"


def build_engine(onnx_path: Path, settings: BuildSettings) -> bytes:
    """A serialized TensorRT engine (plan) for the ONNX model, with one optimization profile
    covering its dynamic axes (1 .. max_batch for the first, 1 .. max_dynamic for the others)."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(Path(onnx_path).read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, settings.workspace_bytes)
    if settings.fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for index in range(network.num_inputs):
        tensor = network.get_input(index)
        shape = list(tensor.shape)
        limits = [settings.max_batch if axis == 0 else settings.max_dynamic for axis in range(len(shape))]
        low = [1 if d < 0 else d for d in shape]
        high = [limit if d < 0 else d for d, limit in zip(shape, limits)]
        middle = [max(1, h // 2) if d < 0 else d for d, h in zip(shape, high)]
        profile.set_shape(tensor.name, low, middle, high)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT could not build an engine for {onnx_path} (see its log above)")
    return bytes(plan)


class TensorRTRunner:
    """One engine and execution context; `run` takes and returns host arrays by tensor name."""

    def __init__(self, onnx_path: Path, model: str, version: str, cache_dir: Path,
                 settings: BuildSettings = BuildSettings()) -> None:
        import cupy
        import tensorrt as trt

        self.cupy = cupy
        self.plan_path = engine_path(cache_dir, model, version, onnx_path, settings, gpu_identity(), trt.__version__)
        self.cache_hit = self.plan_path.is_file()
        start = time.perf_counter()
        if self.cache_hit:
            plan = self.plan_path.read_bytes()
        else:
            plan = build_engine(onnx_path, settings)
            self.plan_path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.plan_path.with_suffix(".partial")
            partial.write_bytes(plan)
            partial.replace(self.plan_path)  # never a half-written plan under the cached name
        self.load_seconds = time.perf_counter() - start
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(plan)
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.dtypes = {n: np.dtype(trt.nptype(self.engine.get_tensor_dtype(n))) for n in names}
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.choice = ProviderChoice(providers=[(ENGINE, {})], skipped={}, requested=(ENGINE,), strict=False)

    def describe(self) -> str:
        how = "cache hit" if self.cache_hit else "built"
        return f"{ENGINE} {self.plan_path.name} ({how} in {self.load_seconds:.1f} s)"

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        cp = self.cupy
        keep = []
        with self.stream:
            for name in self.inputs:
                array = cp.ascontiguousarray(cp.asarray(feeds[name], dtype=self.dtypes[name]))
                keep.append(array)
                self.context.set_input_shape(name, array.shape)
                self.context.set_tensor_address(name, array.data.ptr)
            outputs = {}
            for name in self.outputs:
                outputs[name] = cp.empty(tuple(self.context.get_tensor_shape(name)), self.dtypes[name])
                self.context.set_tensor_address(name, outputs[name].data.ptr)
            if not self.context.execute_async_v3(self.stream.ptr):
                raise RuntimeError("TensorRT execution failed")
            self.stream.synchronize()
        return {name: cp.asnumpy(array) for name, array in outputs.items()}

    def run_batched(self, requests: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        from dspark.runtimes.onnx_session import OnnxRunner

        return OnnxRunner.run_batched(self, requests)  # concatenates along axis 0, calls self.run, splits


def open_runner(onnx_path: Path, model: str, version: str, cache_dir: Optional[Path] = None,
                settings: BuildSettings = BuildSettings()) -> tuple[Optional[TensorRTRunner], Probe]:
    """A TensorRTRunner when TensorRT can run here, else None and the probe saying why not."""
    result = probe()
    if not result.usable:
        return None, result
    cache = cache_dir or Path.home() / ".cache" / "dspark" / "tensorrt"
    return TensorRTRunner(onnx_path, model, version, cache, settings), result


class TensorRTParameters(ConfigParameters):
    """The config parameters of an `onnx` model that choose and build a TensorRT engine."""

    engine: Literal["onnxruntime", "tensorrt"] = "onnxruntime"
    trt_cache_dir: Optional[Path] = None
    trt_fp16: bool = False
    trt_max_batch: int = Field(8, ge=1)
    trt_max_dynamic: int = Field(128, ge=1)


def open_model_runner(params: Mapping[str, str], model: str, version: str, onnx_path: Path, onnx_runtime):
    """The runner a model's config parameters ask for. `engine: tensorrt` gets a TensorRTRunner
    (`trt_cache_dir`, `trt_fp16`, `trt_max_batch`, `trt_max_dynamic`) where TensorRT can run;
    otherwise, and for `engine: onnxruntime` (the default), `onnx_runtime()` builds the ONNX
    Runtime runner, whose choice then records why TensorRT was skipped, or, under
    disable_cpu_ep_fallback, the load fails naming it."""
    import dataclasses

    from dspark.runtimes.accel.providers import PARAM_STRICT, ProviderRequest

    own = parse_parameters(TensorRTParameters, {k: v for k, v in params.items() if k in TensorRTParameters.model_fields})
    if own.engine == "onnxruntime":
        return onnx_runtime()
    settings = BuildSettings(fp16=own.trt_fp16, max_batch=own.trt_max_batch, max_dynamic=own.trt_max_dynamic)
    runner, result = open_runner(onnx_path, model, version, own.trt_cache_dir, settings)
    if runner is not None:
        return runner
    if ProviderRequest.from_parameters(params).disable_cpu_ep_fallback:
        raise ConfigError("parameter 'engine'", f"tensorrt is not usable here: {result.reason}; {PARAM_STRICT} is set, "
                                                "so the model does not fall back to ONNX Runtime")
    runner = onnx_runtime()
    runner.choice = dataclasses.replace(runner.choice, skipped={ENGINE: result.reason, **runner.choice.skipped},
                                        requested=(ENGINE, *runner.choice.requested))
    return runner
