"""ModelSpec: a model's description as YAML next to it, and its Triton `config.pbtxt`.

A ModelSpec (name, semantic version, framework) extended with what Triton needs. The
config is produced and read through Triton's own protobuf schema, never by hand, and the YAML
records which semantic version lives in which integer version folder.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

import pydantic
import yaml
from google.protobuf import text_format
from pydantic import ConfigDict, Field, TypeAdapter
from tritonclient.grpc import model_config_pb2 as mc

from dspark.errors import ConfigError, field_path

SPEC_FILENAME = "modelspec.yaml"
CONFIG_FILENAME = "config.pbtxt"
SEMVER_PATTERN = r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-([0-9A-Za-z.-]+))?(?:\+[0-9A-Za-z.-]+)?$"
DataType = Literal["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
                   "FP16", "FP32", "FP64", "BF16", "STRING"]
SemVer = Annotated[str, Field(pattern=SEMVER_PATTERN)]
# A model name is a folder in the repository and a segment of Triton's URLs (/v2/models/<name>):
# letters, digits, _ - and dots, not starting with a dot (so never '.', '..' or a hidden folder),
# no path separators; at most 128 characters.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$"
ModelName = Annotated[str, Field(pattern=MODEL_NAME_PATTERN)]
STRICT = ConfigDict(extra="forbid")
# A spec or config is a few kB; parsing is pure Python (a 50 MB modelspec took 48 s and 185 MB),
# and every nesting level of YAML is a Python call, so both are capped before and while parsing
MAX_FILE_BYTES = 256 * 1024
MAX_NESTING = 64


@dataclass(frozen=True)
class Framework:
    backend: str  # Triton backend (or "" for a platform)
    artifact: str  # the file name Triton looks for in a version folder
    platform: str = ""


# Frameworks a ModelSpec may name; `onnx` runs on dspark's ONNX Runtime backend.
FRAMEWORKS: dict[str, Framework] = {
    "onnx": Framework("onnx", "model.onnx"),
    "onnxruntime": Framework("onnxruntime", "model.onnx"),
    "pytorch": Framework("pytorch", "model.pt"),
    "tensorflow": Framework("tensorflow", "model.savedmodel"),
    "tensorrt": Framework("tensorrt", "model.plan"),
    "openvino": Framework("openvino", "model.xml"),
    "paddle": Framework("paddle", "model.pdmodel"),
    "python": Framework("python", "model.py"),
    "ensemble": Framework("", "", platform="ensemble"),
}


@dataclass
class TensorSpec:
    __pydantic_config__ = STRICT
    name: str
    dtype: DataType
    dims: list[Annotated[int, Field(ge=-1)]]
    optional: bool = False


@dataclass
class InstanceGroup:
    __pydantic_config__ = STRICT
    kind: Literal["CPU", "GPU", "AUTO"] = "CPU"
    count: Annotated[int, Field(ge=1)] = 1
    gpus: list[int] = field(default_factory=list)


@dataclass
class DynamicBatching:
    __pydantic_config__ = STRICT
    max_queue_delay_microseconds: Annotated[int, Field(ge=0)] = 0
    preferred_batch_sizes: list[Annotated[int, Field(ge=1)]] = field(default_factory=list)
    priority_levels: Annotated[int, Field(ge=0)] = 0
    default_priority_level: Annotated[int, Field(ge=0)] = 0


@dataclass
class EnsembleStep:
    __pydantic_config__ = STRICT
    model: str
    input_map: dict[str, str]  # the step model's input -> ensemble tensor
    output_map: dict[str, str]  # the step model's output -> ensemble tensor
    version: int = -1


@dataclass
class ExecutionProvider:
    """One entry of a model's ordered execution-provider preference (dspark.runtimes.accel.providers)."""

    __pydantic_config__ = STRICT
    name: str  # CUDA, TensorRT, CPU, ... or a plugin provider's name
    options: dict[str, Union[str, int, float, bool]] = field(default_factory=dict)
    library: str = ""  # a plugin provider's shared library


@dataclass
class VersionRecord:
    """One semantic version and the Triton version folder that holds it."""

    __pydantic_config__ = STRICT
    semver: SemVer
    folder: Annotated[int, Field(ge=1)]
    artifact: str = ""
    source: str = ""
    added: str = ""


@dataclass
class ModelSpec:
    __pydantic_config__ = STRICT
    name: ModelName
    framework: str
    versions: list[VersionRecord] = field(default_factory=list)
    backend: str = ""
    max_batch_size: Annotated[int, Field(ge=0)] = 0
    inputs: list[TensorSpec] = field(default_factory=list)
    outputs: list[TensorSpec] = field(default_factory=list)
    instance_groups: list[InstanceGroup] = field(default_factory=list)
    dynamic_batching: Optional[DynamicBatching] = None
    parameters: dict[str, str] = field(default_factory=dict)
    decoupled: bool = False
    ensemble: list[EnsembleStep] = field(default_factory=list)
    # "latest", "all", or the semantic versions to serve
    serve_versions: Union[Literal["latest", "all"], list[SemVer]] = "latest"
    default_model_filename: str = ""
    # config.pbtxt text for Triton fields this spec does not model (optimization, sequence_batching, ...)
    extra_config: str = ""
    # ONNX Runtime providers in order of preference; written to the config's parameters
    execution_providers: list[ExecutionProvider] = field(default_factory=list)
    disable_cpu_ep_fallback: bool = False

    def provider_request(self):
        """The preference as dspark.runtimes.accel.providers.ProviderRequest (validated), or None if unset."""
        from dspark.runtimes.accel.providers import ProviderRequest

        if not self.execution_providers:
            return None
        entries = self.execution_providers
        return ProviderRequest(providers=tuple(e.name for e in entries),
                               options={e.name: e.options for e in entries if e.options},
                               disable_cpu_ep_fallback=self.disable_cpu_ep_fallback,
                               plugin_libraries={e.name: e.library for e in entries if e.library})

    @property
    def version(self) -> Optional[str]:
        """The newest semantic version (the spec's `version` field)."""
        return max((r.semver for r in self.versions), key=semver_key, default=None)

    @property
    def framework_info(self) -> Framework:
        if self.framework not in FRAMEWORKS:
            raise SpecError("framework", f"unknown framework {self.framework!r}; one of {sorted(FRAMEWORKS)}")
        return FRAMEWORKS[self.framework]

    @property
    def triton_backend(self) -> str:
        return self.backend or self.framework_info.backend

    @property
    def artifact_name(self) -> str:
        return self.default_model_filename or self.framework_info.artifact

    def folder_of(self, semver: str) -> int:
        for record in self.versions:
            if record.semver == semver:
                return record.folder
        raise SpecError("serve_versions", f"version {semver} is not recorded; recorded: {[r.semver for r in self.versions]}")

    def next_folder(self) -> int:
        return max((r.folder for r in self.versions), default=0) + 1

    # --- YAML -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict) -> "ModelSpec":
        try:
            spec = TypeAdapter(cls).validate_python(data)
        except pydantic.ValidationError as error:
            first = error.errors()[0]
            raise SpecError(field_path(first["loc"]), first["msg"]) from None
        spec.framework_info  # noqa: B018  (raises SpecError for an unknown framework)
        try:
            request = spec.provider_request()
            if request is not None:
                request.validate()
        except ConfigError as error:
            raise SpecError(error.field, error.reason) from None
        return spec

    @classmethod
    def load(cls, path: Path) -> "ModelSpec":
        try:
            data = yaml.load(read_text(path), Loader=_BoundedLoader)  # noqa: S506 (a SafeLoader)
        except _TooDeep as error:
            raise SpecError("", str(error), path) from None
        except yaml.YAMLError as error:
            raise SpecError("", f"not valid YAML: {one_line(str(error))}", path) from None
        if not isinstance(data, dict):
            raise SpecError("", "must be a mapping of ModelSpec fields", path)
        try:
            return cls.from_dict(data)
        except SpecError as error:
            raise SpecError(error.field, error.reason, path) from None

    def to_dict(self) -> dict:
        """The YAML form: fields left at their defaults are omitted, except name, framework, versions."""
        data = _without_defaults(self)
        return {"name": self.name, "framework": self.framework, "versions": data.pop("versions", []), **data}

    def save(self, path: Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    # --- config.pbtxt ------------------------------------------------------------------------
    def to_model_config(self) -> mc.ModelConfig:
        framework = self.framework_info
        config = mc.ModelConfig(name=self.name, max_batch_size=self.max_batch_size)
        if framework.platform:
            config.platform = framework.platform
        else:
            config.backend = self.triton_backend
        if self.default_model_filename:
            config.default_model_filename = self.default_model_filename
        for tensor in self.inputs:
            config.input.add(name=tensor.name, data_type=mc.DataType.Value(f"TYPE_{tensor.dtype}"),
                             dims=tensor.dims, optional=tensor.optional)
        for tensor in self.outputs:
            config.output.add(name=tensor.name, data_type=mc.DataType.Value(f"TYPE_{tensor.dtype}"), dims=tensor.dims)
        for group in self.instance_groups:
            config.instance_group.add(kind=mc.ModelInstanceGroup.Kind.Value(f"KIND_{group.kind}"),
                                      count=group.count, gpus=group.gpus)
        if self.dynamic_batching is not None:
            batching = self.dynamic_batching
            config.dynamic_batching.SetInParent()
            config.dynamic_batching.max_queue_delay_microseconds = batching.max_queue_delay_microseconds
            config.dynamic_batching.preferred_batch_size.extend(batching.preferred_batch_sizes)
            config.dynamic_batching.priority_levels = batching.priority_levels
            config.dynamic_batching.default_priority_level = batching.default_priority_level
        for key, value in self.parameters.items():
            config.parameters[key].string_value = str(value)
        request = self.provider_request()
        for key, value in (request.to_parameters() if request else {}).items():
            config.parameters[key].string_value = value
        if self.decoupled:
            config.model_transaction_policy.decoupled = True
        for step in self.ensemble:
            config.ensemble_scheduling.step.add(model_name=step.model, model_version=step.version,
                                                input_map=step.input_map, output_map=step.output_map)
        if self.serve_versions == "all":
            config.version_policy.all.SetInParent()
        elif isinstance(self.serve_versions, list):
            config.version_policy.specific.versions.extend(sorted(self.folder_of(v) for v in self.serve_versions))
        if self.extra_config:
            try:
                text_format.Merge(self.extra_config, config)
            except text_format.ParseError as error:
                raise SpecError("extra_config", str(error)) from None
        return config

    def config_text(self) -> str:
        header = f"# Generated from {SPEC_FILENAME} by `dspark repo sync`; edit that file, not this one.\n"
        return header + text_format.MessageToString(self.to_model_config())

    @classmethod
    def from_model_config(cls, config: mc.ModelConfig, versions: list[VersionRecord]) -> "ModelSpec":
        """A ModelSpec for an existing Triton model (used by `repo init` to adopt a repository)."""
        if config.platform == "ensemble":
            framework, backend = "ensemble", ""
        else:
            framework = next((name for name, info in FRAMEWORKS.items() if info.backend == config.backend), "python")
            backend = "" if FRAMEWORKS[framework].backend == config.backend else config.backend
        batching = None
        if config.HasField("dynamic_batching"):
            b = config.dynamic_batching
            batching = DynamicBatching(b.max_queue_delay_microseconds, list(b.preferred_batch_size),
                                       b.priority_levels, b.default_priority_level)

        def tensors(entries, with_optional: bool) -> list[TensorSpec]:
            return [TensorSpec(t.name, mc.DataType.Name(t.data_type).removeprefix("TYPE_"), list(t.dims),
                               t.optional if with_optional else False) for t in entries]

        parameters = {k: v.string_value for k, v in config.parameters.items()}
        providers = _providers_from_parameters(parameters)
        rest = mc.ModelConfig()
        rest.CopyFrom(config)
        policy = config.version_policy
        by_folder = {record.folder: record.semver for record in versions}
        serve_versions: Union[str, list[str]] = "latest"
        if policy.HasField("all"):
            serve_versions = "all"
        elif policy.HasField("specific") and all(v in by_folder for v in policy.specific.versions):
            serve_versions = [by_folder[v] for v in policy.specific.versions]
        elif policy.HasField("specific") or policy.latest.num_versions > 1:
            serve_versions = ""  # not expressible here: keep the policy verbatim in extra_config
        for modeled in MODELED_CONFIG_FIELDS:
            if not (modeled == "version_policy" and serve_versions == ""):
                rest.ClearField(modeled)
        return cls(
            name=config.name,
            framework=framework,
            backend=backend,
            versions=versions,
            max_batch_size=config.max_batch_size,
            inputs=tensors(config.input, True),
            outputs=tensors(config.output, False),
            instance_groups=[InstanceGroup(mc.ModelInstanceGroup.Kind.Name(g.kind).removeprefix("KIND_"),
                                           g.count or 1, list(g.gpus)) for g in config.instance_group],
            dynamic_batching=batching,
            parameters=parameters,
            decoupled=config.model_transaction_policy.decoupled,
            ensemble=[EnsembleStep(s.model_name, dict(s.input_map), dict(s.output_map), s.model_version)
                      for s in config.ensemble_scheduling.step],
            serve_versions=serve_versions or "latest",
            default_model_filename=config.default_model_filename,
            extra_config=text_format.MessageToString(rest),
            **providers,
        )


# ModelConfig fields a ModelSpec carries itself; anything else travels in extra_config.
MODELED_CONFIG_FIELDS = ("name", "platform", "backend", "max_batch_size", "input", "output", "instance_group",
                         "dynamic_batching", "parameters", "model_transaction_policy", "ensemble_scheduling",
                         "version_policy", "default_model_filename")


class SpecError(ConfigError):
    """A problem in a model's files (modelspec.yaml, config.pbtxt, the artifact), naming the file and the field."""


def _providers_from_parameters(parameters: dict[str, str]) -> dict:
    """ModelSpec's provider fields from (and removed out of) a config's parameters."""
    from dspark.runtimes.accel.providers import PARAM_OPTIONS, PARAM_PLUGINS, PARAM_PROVIDERS, PARAM_STRICT, ProviderRequest

    if PARAM_PROVIDERS not in parameters:
        return {}
    try:
        request = ProviderRequest.from_parameters(parameters)
    except ConfigError as error:
        raise SpecError(error.field, error.reason) from None
    for key in (PARAM_PROVIDERS, PARAM_OPTIONS, PARAM_STRICT, PARAM_PLUGINS):
        parameters.pop(key, None)
    return {"execution_providers": [ExecutionProvider(name, dict(request.options.get(name, {})),
                                                      request.plugin_libraries.get(name, ""))
                                    for name in request.providers],
            "disable_cpu_ep_fallback": request.disable_cpu_ep_fallback}


def _without_defaults(value):
    if dataclasses.is_dataclass(value):
        result = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if default is dataclasses.MISSING or item != default:
                result[f.name] = _without_defaults(item)
        return result or {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, list):
        return [_without_defaults(item) for item in value]
    if isinstance(value, dict):
        return {key: _without_defaults(item) for key, item in value.items()}
    return value


def semver_key(version: str) -> tuple:
    """Order semantic versions: numeric parts, a pre-release sorts before its release."""
    match = re.match(SEMVER_PATTERN, version)
    if not match:
        raise SpecError("semver", f"{version!r} is not a semantic version like 1.2.3")
    major, minor, patch, pre = match.groups()
    return (int(major), int(minor), int(patch), pre is None, pre or "")


def parse_config_text(text: str, path: Optional[Path] = None) -> mc.ModelConfig:
    """Parse config.pbtxt with Triton's schema; errors name the file, line and field."""
    config = mc.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as error:
        raise SpecError("", one_line(str(error)), path) from None
    return config


def load_config(path: Path) -> mc.ModelConfig:
    return parse_config_text(read_text(path), path)


def one_line(message: str, limit: int = 300) -> str:
    """A parser's message as one line of at most about ``limit`` characters (protobuf quotes the
    whole offending line, which may be the whole file)."""
    message = " ".join(message.split())
    return message if len(message) <= limit else f"{message[:limit - 60]} ... {message[-50:]}"


class _TooDeep(Exception):
    pass


class _BoundedLoader(yaml.SafeLoader):
    """safe_load's loader, refusing nesting deeper than MAX_NESTING (100,000 nested brackets
    were a RecursionError)."""

    _depth = 0

    def compose_node(self, parent, index):
        if self._depth >= MAX_NESTING:
            mark = self.peek_event().start_mark
            raise _TooDeep(f"nests lists or mappings deeper than {MAX_NESTING} levels (line {mark.line + 1}, "
                           f"column {mark.column + 1}): a model spec needs a few")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def read_text(path: Path) -> str:
    """A repository file's text; SpecError naming the file if it is larger than MAX_FILE_BYTES,
    or the first bad byte if it is not UTF-8."""
    with Path(path).open("rb") as handle:
        data = handle.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise SpecError("", f"is larger than {MAX_FILE_BYTES // 1024} KiB, the most a model's spec or config "
                            "may be (they are a few kB; weights belong in the version folders)", path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise SpecError("", f"is not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}): "
                            "save it as UTF-8", path) from None


def check_model_name(name: str, field: str = "name") -> str:
    """The name, or SpecError (naming ``field``) saying which characters a model name may use."""
    if not re.fullmatch(MODEL_NAME_PATTERN, name):
        raise SpecError(field, f"{name!r} is not a valid model name: use letters, digits, '_', '-' and '.', "
                                "not starting with '.', no '/' (at most 128 characters)")
    return name
