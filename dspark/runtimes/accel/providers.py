"""ONNX Runtime execution providers: which exist, whose they are, what options they take, whether
one is really usable here, and which one a model gets.

ONNX Runtime itself drops a provider that is missing from its build (or fails to start) with a
log line most users never see and runs the model on CPU. Here a model states an ordered
preference (`execution_providers`), every option is checked against the provider's documented
names before ONNX Runtime sees it, each provider is probed (in this onnxruntime build, AND a device
of its vendor present, AND its libraries loadable), and the choice is either a logged fallback to
the next usable provider or, with `disable_cpu_ep_fallback`, a load that fails naming the provider
that is missing. The session ONNX Runtime made is checked against the choice afterwards, so a
provider that ORT dropped while creating the session is caught too.

Option names are ONNX Runtime's, from its execution-provider documentation and provider sources
(see docs/accelerators.md for the list per provider and ORT version notes).
"""
from __future__ import annotations

import ctypes
import difflib
import functools
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence, Union

import pydantic

from dspark.runtimes.accel import devices
from dspark.errors import ConfigError
from dspark.params import ConfigParameters, parse_parameters

CPU = "CPUExecutionProvider"
OptionValue = Union[str, int, float, bool]

# Config parameter names (config.pbtxt `parameters`, and ModelSpec's fields of the same meaning).
PARAM_PROVIDERS = "execution_providers"
PARAM_OPTIONS = "execution_provider_options"
PARAM_STRICT = "disable_cpu_ep_fallback"
PARAM_PLUGINS = "ep_plugin_libraries"


@dataclass(frozen=True)
class ProviderInfo:
    """One execution provider as ONNX Runtime names it, and how to tell that it can run here."""

    name: str  # ONNX Runtime's name, e.g. CUDAExecutionProvider
    short: str  # what users write: CUDA
    vendor: str
    family: str  # cpu | gpu | npu | any (OpenVINO, DirectML pick a device by option)
    device: str  # key of devices.PROBES
    options: frozenset[str]
    package: str  # where a build with this provider comes from
    libraries: tuple[str, ...] = ()  # shared libraries it needs besides ORT's own (any one of them)
    removed_in: Optional[tuple[int, int]] = None  # first ORT version without it
    aliases: tuple[str, ...] = ()


def _options(text: str) -> frozenset[str]:
    return frozenset(text.split())


CUDA_OPTIONS = _options("""
    device_id has_user_compute_stream user_compute_stream do_copy_in_default_stream use_ep_level_unified_stream
    gpu_mem_limit arena_extend_strategy cudnn_conv_algo_search cudnn_conv_use_max_workspace cudnn_conv1d_pad_to_nc1d
    enable_cuda_graph enable_skip_layer_norm_strict_mode prefer_nhwc use_tf32 sdpa_kernel fuse_conv_bias
    gpu_external_alloc gpu_external_free gpu_external_empty_cache
    tunable_op_enable tunable_op_tuning_enable tunable_op_max_tuning_duration_ms""")
TENSORRT_OPTIONS = _options("""
    device_id has_user_compute_stream user_compute_stream trt_max_partition_iterations trt_min_subgraph_size
    trt_max_workspace_size trt_fp16_enable trt_bf16_enable trt_int8_enable trt_int8_calibration_table_name
    trt_int8_use_native_calibration_table trt_dla_enable trt_dla_core trt_dump_subgraphs trt_engine_cache_enable
    trt_engine_cache_path trt_engine_cache_prefix trt_weight_stripped_engine_enable trt_onnx_model_folder_path
    trt_engine_decryption_enable trt_engine_decryption_lib_path trt_force_sequential_engine_build
    trt_context_memory_sharing_enable trt_layer_norm_fp32_fallback trt_timing_cache_enable trt_timing_cache_path
    trt_force_timing_cache trt_detailed_build_log trt_build_heuristics_enable trt_sparsity_enable
    trt_builder_optimization_level trt_auxiliary_streams trt_tactic_sources trt_extra_plugin_lib_paths
    trt_profile_min_shapes trt_profile_max_shapes trt_profile_opt_shapes trt_cuda_graph_enable
    trt_dump_ep_context_model trt_ep_context_file_path trt_ep_context_embed_mode trt_engine_hw_compatible
    trt_onnx_bytestream trt_onnx_bytestream_size trt_external_data_bytestream trt_external_data_bytestream_size
    trt_op_types_to_exclude""")
MIGRAPHX_OPTIONS = _options("""
    device_id migraphx_fp16_enable migraphx_bf16_enable migraphx_fp8_enable migraphx_int8_enable
    migraphx_use_native_calibration_table migraphx_int8_calibration_table_name migraphx_save_compiled_model
    migraphx_save_model_path migraphx_load_compiled_model migraphx_load_model_path migraphx_exhaustive_tune
    migraphx_mem_limit migraphx_arena_extend_strategy migraphx_model_cache_dir
    migraphx_external_alloc migraphx_external_free migraphx_external_empty_cache""")
ROCM_OPTIONS = _options("""
    device_id has_user_compute_stream user_compute_stream do_copy_in_default_stream gpu_mem_limit
    arena_extend_strategy miopen_conv_exhaustive_search miopen_conv_use_max_workspace enable_hip_graph
    gpu_external_alloc gpu_external_free gpu_external_empty_cache
    tunable_op_enable tunable_op_tuning_enable tunable_op_max_tuning_duration_ms""")
CANN_OPTIONS = _options("""
    device_id npu_mem_limit arena_extend_strategy enable_cann_graph dump_graphs dump_om_model
    precision_mode op_select_impl_mode optypelist_for_implmode""")
OPENVINO_OPTIONS = _options("""
    device_type precision num_of_threads num_streams cache_dir load_config context enable_opencl_throttling
    enable_qdq_optimizer disable_dynamic_shapes model_priority reshape_input layout enable_causallm
    device_id enable_npu_fast_compile""")
DIRECTML_OPTIONS = _options("device_id performance_preference device_filter disable_metacommands enable_graph_capture")
QNN_OPTIONS = _options("""
    backend_type backend_path profiling_level profiling_file_path rpc_control_latency vtcm_mb htp_performance_mode
    qnn_saver_path qnn_context_priority htp_graph_finalization_optimization_mode soc_model htp_arch device_id
    enable_htp_fp16_precision offload_graph_io_quantization enable_htp_spill_fill_buffer
    enable_htp_shared_memory_allocator dump_json_qnn_graph json_qnn_graph_dir""")
COREML_OPTIONS = _options("""
    ModelFormat MLComputeUnits RequireStaticInputShapes EnableOnSubgraphs SpecializationStrategy
    ProfileComputePlan AllowLowPrecisionAccumulationOnGPU ModelCacheDirectory""")

REGISTRY: tuple[ProviderInfo, ...] = (
    ProviderInfo("TensorrtExecutionProvider", "TensorRT", "NVIDIA", "gpu", "nvidia", TENSORRT_OPTIONS,
                 "onnxruntime-gpu + tensorrt", libraries=("libnvinfer.so.10", "libnvinfer.so.8", "nvinfer_10.dll"),
                 aliases=("trt",)),
    ProviderInfo("CUDAExecutionProvider", "CUDA", "NVIDIA", "gpu", "nvidia", CUDA_OPTIONS, "onnxruntime-gpu"),
    ProviderInfo("MIGraphXExecutionProvider", "MIGraphX", "AMD", "gpu", "amd", MIGRAPHX_OPTIONS,
                 "onnxruntime-migraphx"),
    ProviderInfo("ROCMExecutionProvider", "ROCm", "AMD", "gpu", "amd", ROCM_OPTIONS, "onnxruntime-rocm (ORT < 1.23)",
                 removed_in=(1, 23)),
    ProviderInfo("CANNExecutionProvider", "CANN", "Huawei Ascend", "npu", "ascend", CANN_OPTIONS, "onnxruntime-cann"),
    ProviderInfo("OpenVINOExecutionProvider", "OpenVINO", "Intel", "any", "cpu", OPENVINO_OPTIONS,
                 "onnxruntime-openvino"),
    ProviderInfo("DmlExecutionProvider", "DirectML", "Microsoft (any DirectX 12 GPU)", "gpu", "windows",
                 DIRECTML_OPTIONS, "onnxruntime-directml", aliases=("Dml",)),
    ProviderInfo("QNNExecutionProvider", "QNN", "Qualcomm", "npu", "qualcomm", QNN_OPTIONS, "onnxruntime-qnn"),
    ProviderInfo("CoreMLExecutionProvider", "CoreML", "Apple", "any", "apple", COREML_OPTIONS, "onnxruntime (macOS)"),
    ProviderInfo(CPU, "CPU", "ONNX Runtime (MLAS)", "cpu", "cpu", frozenset(), "onnxruntime"),
)


def _key(name: str) -> str:
    return name.lower().removesuffix("executionprovider")


_BY_KEY = {_key(alias): info for info in REGISTRY for alias in (info.name, info.short, *info.aliases)}


def known_names() -> list[str]:
    return [info.short for info in REGISTRY]


def lookup(name: str, plugins: Mapping[str, str] = (), field_name: str = PARAM_PROVIDERS) -> Optional[ProviderInfo]:
    """The registry entry for a name users write (CUDA, cuda, CUDAExecutionProvider, trt, ...);
    None for a plugin provider named in ``plugins``; a ConfigError naming the known ones otherwise."""
    info = _BY_KEY.get(_key(name))
    if info is not None:
        return info
    if name in dict(plugins):
        return None
    close = difflib.get_close_matches(name, [n for i in REGISTRY for n in (i.short, i.name)], n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ConfigError(field_name, f"unknown execution provider {name!r}{hint}; known: {', '.join(known_names())}, "
                                  f"or a plugin provider named in {PARAM_PLUGINS}")


def check_options(info: ProviderInfo, options: Mapping[str, OptionValue], field_name: str) -> dict[str, str]:
    """The options as the strings ORT takes; an unknown name is a ConfigError listing the known ones."""
    checked = {}
    for option, value in options.items():
        if option not in info.options:
            close = difflib.get_close_matches(option, sorted(info.options), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            known = ", ".join(sorted(info.options)) or "none (it takes no options)"
            raise ConfigError(f"{field_name}.{option}",
                              f"{info.name} has no option {option!r}{hint}; known options: {known}")
        if not isinstance(value, (str, int, float, bool)):
            raise ConfigError(f"{field_name}.{option}", f"must be a string, number or boolean, got {value!r}")
        checked[option] = str(int(value)) if isinstance(value, bool) else str(value)
    return checked


# --- the request: a model's ordered preference, from config parameters or a ModelSpec -----------
class ProviderParameters(ConfigParameters):
    """The config parameters, as strings in config.pbtxt (JSON for the two objects)."""

    execution_providers: str = CPU
    execution_provider_options: pydantic.Json[dict[str, dict[str, OptionValue]]] = {}
    disable_cpu_ep_fallback: bool = False
    ep_plugin_libraries: pydantic.Json[dict[str, str]] = {}


@dataclass(frozen=True)
class ProviderRequest:
    """An ordered preference list with per-provider options and the fallback policy."""

    providers: tuple[str, ...] = (CPU,)
    options: Mapping[str, Mapping[str, OptionValue]] = field(default_factory=dict)  # provider -> options
    disable_cpu_ep_fallback: bool = False
    plugin_libraries: Mapping[str, str] = field(default_factory=dict)  # plugin provider name -> library path

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> "ProviderRequest":
        """From config.pbtxt parameters: execution_providers (comma list), execution_provider_options
        (JSON object: provider -> {option: value}), disable_cpu_ep_fallback (bool), ep_plugin_libraries
        (JSON object: provider name -> shared library path)."""
        parsed = parse_parameters(ProviderParameters, {key: value for key, value in params.items()
                                                       if key in ProviderParameters.model_fields})
        providers = tuple(p.strip() for p in parsed.execution_providers.split(",") if p.strip())
        request = cls(providers=providers or (CPU,), options=parsed.execution_provider_options,
                      disable_cpu_ep_fallback=parsed.disable_cpu_ep_fallback,
                      plugin_libraries=parsed.ep_plugin_libraries)
        request.validate()
        return request

    def to_parameters(self) -> dict[str, str]:
        params = {PARAM_PROVIDERS: ",".join(self.providers)}
        if self.options:
            params[PARAM_OPTIONS] = json.dumps({k: dict(v) for k, v in self.options.items()})
        if self.disable_cpu_ep_fallback:
            params[PARAM_STRICT] = "true"
        if self.plugin_libraries:
            params[PARAM_PLUGINS] = json.dumps(dict(self.plugin_libraries))
        return params

    def validate(self) -> list[tuple[Optional[ProviderInfo], str, dict[str, str]]]:
        """(registry entry or None for a plugin, name, checked options) per preference, in order."""
        resolved, seen = [], set()
        for index, name in enumerate(self.providers):
            info = lookup(name, self.plugin_libraries, f"{PARAM_PROVIDERS}[{index}]")
            canonical = info.name if info else name
            if canonical in seen:
                raise ConfigError(f"{PARAM_PROVIDERS}[{index}]", f"{canonical} is listed twice")
            seen.add(canonical)
            resolved.append((info, canonical, {}))
        by_name = {canonical: i for i, (_, canonical, _) in enumerate(resolved)}
        for name, options in self.options.items():
            info = lookup(name, self.plugin_libraries, PARAM_OPTIONS)
            canonical = info.name if info else name
            if canonical not in by_name:
                raise ConfigError(f"{PARAM_OPTIONS}.{name}", f"options for {canonical}, which is not in "
                                                             f"{PARAM_PROVIDERS} ({', '.join(self.providers)})")
            if not isinstance(options, Mapping):
                raise ConfigError(f"{PARAM_OPTIONS}.{name}", f"must be an object of option: value, got {options!r}")
            field_name = f"{PARAM_OPTIONS}.{name}"
            # A plugin provider defines its own options; ORT passes them on and the plugin checks them.
            checked = check_options(info, options, field_name) if info else {k: str(v) for k, v in options.items()}
            position = by_name[canonical]
            resolved[position] = (info, canonical, checked)
        return resolved


# --- probing ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Probe:
    provider: str
    usable: bool
    reason: str  # why not, or what it will run on


def ort_version() -> tuple[int, int]:
    import onnxruntime

    major, minor = onnxruntime.__version__.split(".")[:2]
    return int(major), int(minor)


def available_providers() -> list[str]:
    import onnxruntime

    return list(onnxruntime.get_available_providers())


@functools.lru_cache(maxsize=None)
def _library_found(names: tuple[str, ...]) -> bool:
    """Any of the shared libraries loads, from the loader path or a pip wheel that ships it
    (tensorrt_libs for TensorRT)."""
    search = [""]
    spec = importlib.util.find_spec("tensorrt_libs")
    if spec is not None and spec.submodule_search_locations:
        search += [f"{location}/" for location in spec.submodule_search_locations]
    for prefix in search:
        for name in names:
            try:
                ctypes.CDLL(prefix + name)
                return True
            except OSError:
                continue
    return False


def probe(info: ProviderInfo, available: Optional[Sequence[str]] = None,
          device_probes: Optional[Mapping[str, Callable[[], devices.DeviceProbe]]] = None,
          version: Optional[tuple[int, int]] = None,
          library_found: Callable[[tuple[str, ...]], bool] = None) -> Probe:
    """Usable = in this onnxruntime build, a device of its vendor present, its libraries loadable.
    ``available``, ``device_probes``, ``version`` and ``library_found`` default to this machine
    (tests pass others)."""
    available = available_providers() if available is None else list(available)
    version = ort_version() if version is None else version
    if info.removed_in is not None and version >= info.removed_in:
        removed = ".".join(map(str, info.removed_in))
        return Probe(info.name, False, f"removed from ONNX Runtime in {removed} (this is {version[0]}.{version[1]}); "
                                       "use MIGraphXExecutionProvider on AMD GPUs")
    if info.name not in available:
        return Probe(info.name, False, f"not in this onnxruntime build (it has {', '.join(available)}); "
                                       f"it comes with {info.package}")
    device = (device_probes or devices.PROBES)[info.device]()
    if not device.present:
        return Probe(info.name, False, f"no device: {device.detail}")
    if info.libraries and not (library_found or _library_found)(info.libraries):
        return Probe(info.name, False, f"{device.detail}, but none of {', '.join(info.libraries)} loads")
    return Probe(info.name, True, device.detail)


def register_plugin(name: str, library: str) -> list:
    """Register a plugin provider's library with ORT (once per process) and return its devices."""
    import onnxruntime as ort

    if not hasattr(ort, "register_execution_provider_library"):
        raise ConfigError(PARAM_PLUGINS, f"plugin providers need onnxruntime >= 1.22 (this is {ort.__version__})")
    if name not in _registered_plugins:
        ort.register_execution_provider_library(name, library)
        _registered_plugins[name] = library
    return [device for device in ort.get_ep_devices() if device.ep_name == name]


_registered_plugins: dict[str, str] = {}


def probe_plugin(name: str, library: str) -> tuple[Probe, list]:
    if not Path(library).is_file():
        return Probe(name, False, f"plugin library {library} does not exist"), []
    try:
        found = register_plugin(name, library)
    except ConfigError:
        raise
    except Exception as error:  # ORT's registration failure: the library is not a provider library
        return Probe(name, False, f"plugin library {library} did not register: {error}"), []
    if not found:
        return Probe(name, False, f"plugin {library} registered but reports no device for {name}"), []
    kinds = sorted({str(d.device.type).rsplit(".", 1)[-1] for d in found})
    return Probe(name, True, f"{len(found)} device(s) ({', '.join(kinds)}) from plugin {library}"), found


# --- the choice --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProviderChoice:
    """What ORT is given, in order, and why. ``providers[0]`` is the one the model runs on; the rest
    take the nodes it cannot run (ORT's partitioning)."""

    providers: list[tuple[str, dict[str, str]]]
    skipped: dict[str, str]  # requested provider -> why it is not used
    requested: tuple[str, ...]
    strict: bool
    plugin_devices: dict[str, list] = field(default_factory=dict)

    @property
    def chosen(self) -> str:
        return self.providers[0][0]

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.providers]

    @property
    def fell_back(self) -> bool:
        return bool(self.skipped)

    @property
    def reason(self) -> str:
        """One phrase: first preference, or the fallback and what caused it."""
        if not self.skipped:
            return "first preference"
        why = "; ".join(f"{name} not usable: {reason}" for name, reason in self.skipped.items())
        return f"fallback ({why})"

    def describe(self) -> str:
        return f"{self.chosen} ({self.reason})"


def choose(request: ProviderRequest, probe_one: Optional[Callable[[ProviderInfo], Probe]] = None) -> ProviderChoice:
    """The providers for a session: the usable ones of the preference in order, CPU last unless the
    policy is strict. Strict (disable_cpu_ep_fallback): any listed provider that is not usable fails
    the load with a ConfigError naming it and why."""
    probe_one = probe_one or probe
    chosen, skipped, plugin_devices = [], {}, {}
    for info, name, options in request.validate():
        if info is None:
            result, found = probe_plugin(name, request.plugin_libraries[name])
            plugin_devices[name] = found
        else:
            result = probe_one(info)
        if result.usable:
            chosen.append((name, options))
        else:
            skipped[name] = result.reason
    if request.disable_cpu_ep_fallback and skipped:
        name, reason = next(iter(skipped.items()))
        raise ConfigError(f"parameter '{PARAM_PROVIDERS}'",
                          f"{name} is not usable here: {reason}; {PARAM_STRICT} is set, so the model does not "
                          f"fall back to another provider")
    if not request.disable_cpu_ep_fallback and CPU not in [name for name, _ in chosen]:
        chosen.append((CPU, {}))
    if not chosen:
        raise ConfigError(f"parameter '{PARAM_PROVIDERS}'", "no provider left to run the model")
    return ProviderChoice(providers=chosen, skipped=skipped, requested=tuple(request.providers),
                          strict=request.disable_cpu_ep_fallback, plugin_devices=plugin_devices)


def create_session(model_path: Union[str, os.PathLike], options, choice: ProviderChoice):
    """An ORT InferenceSession on the chosen providers (plugin providers through their devices)."""
    import onnxruntime as ort

    if choice.strict and CPU not in choice.names:
        # ORT's own switch: fail instead of placing nodes the chosen provider cannot run on CPU.
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    builtin = [(name, opts) for name, opts in choice.providers if name not in choice.plugin_devices]
    for name, opts in choice.providers:
        if name in choice.plugin_devices:
            options.add_provider_for_devices(choice.plugin_devices[name], opts)
    if choice.plugin_devices:
        for name, opts in builtin:
            if name != CPU:
                options.add_provider(name, opts)
        session = ort.InferenceSession(str(model_path), sess_options=options)
    else:
        session = ort.InferenceSession(str(model_path), sess_options=options,
                                       providers=[name for name, _ in builtin],
                                       provider_options=[opts for _, opts in builtin])
    return session


def verify_session(choice: ProviderChoice, actual: Sequence[str]) -> ProviderChoice:
    """The choice as ORT actually applied it: a provider ORT dropped while creating the session
    (missing CUDA/cuDNN/TensorRT libraries, say) becomes a skip, or an error when strict."""
    dropped = {name: "ONNX Runtime could not start it (see its log for the missing library)"
               for name in choice.names if name not in actual}
    if not dropped:
        return choice
    if choice.strict:
        name = next(iter(dropped))
        raise ConfigError(f"parameter '{PARAM_PROVIDERS}'", f"{name} is not usable here: {dropped[name]}; "
                                                            f"{PARAM_STRICT} is set")
    kept = [(name, opts) for name, opts in choice.providers if name in actual] or [(CPU, {})]
    return ProviderChoice(providers=kept, skipped={**choice.skipped, **dropped}, requested=choice.requested,
                          strict=choice.strict, plugin_devices=choice.plugin_devices)


def probe_all() -> list[tuple[ProviderInfo, Probe]]:
    """Every registered provider and whether it is usable here (for `dspark info`)."""
    return [(info, probe(info)) for info in REGISTRY]

