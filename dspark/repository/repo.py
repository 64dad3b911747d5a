"""A Triton model repository managed through ModelSpecs: init, add a version, validate, list, sync."""
from __future__ import annotations

import datetime as _dt
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import yaml
from tritonclient.grpc import model_config_pb2 as mc

from dspark.repository import atomic

from dspark.repository.modelspec import (
    CONFIG_FILENAME,
    FRAMEWORKS,
    SPEC_FILENAME,
    DynamicBatching,
    ModelSpec,
    SpecError,
    TensorSpec,
    VersionRecord,
    check_model_name,
    load_config,
    semver_key,
)

ARTIFACT_FRAMEWORKS = {".onnx": "onnx", ".pt": "pytorch", ".plan": "tensorrt", ".xml": "openvino",
                       ".savedmodel": "tensorflow", ".py": "python", ".pdmodel": "paddle"}
DEFAULT_ONNX_MAX_BATCH = 8


@dataclass(frozen=True)
class Problem:
    """One thing wrong in a repository: the file, the field, what and how to fix it."""

    path: Path
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.field + ': ' if self.field else ''}{self.message}"


@dataclass(frozen=True)
class ModelEntry:
    """One model folder: its spec (when it has one) and its config."""

    directory: Path
    spec: Optional[ModelSpec]
    config: Optional[mc.ModelConfig]

    @property
    def name(self) -> str:
        return self.directory.name

    def version_folders(self) -> list[int]:
        return sorted(int(p.name) for p in self.directory.iterdir() if p.is_dir() and p.name.isdigit())


def model_dirs(repository: Path) -> list[Path]:
    return sorted(p for p in Path(repository).iterdir()
                  if p.is_dir() and ((p / CONFIG_FILENAME).exists() or (p / SPEC_FILENAME).exists()))


def _check_inside(repository: Path, path: Path) -> None:
    """SpecError if ``path`` (a model folder or one of its files) is a link that leads out of
    the repository: dspark would read, or write, someone else's files through it."""
    target = Path(path).resolve()
    if not target.is_relative_to(Path(repository).resolve()):
        raise SpecError("", f"is a link to {target}, outside the repository: replace it with the model's "
                            f"{'folder' if target.is_dir() else 'file'}", path)


def init_repository(repository: Path) -> list[Path]:
    """Create the folder, and adopt each model that has a config.pbtxt but no modelspec.yaml.

    Version folder N of an adopted model is recorded as semantic version N.0.0; config.pbtxt is
    left as it is (the spec carries every field it does not model in `extra_config`).
    """
    repository = Path(repository)
    repository.mkdir(parents=True, exist_ok=True)
    written = []
    for directory in model_dirs(repository):
        _check_inside(repository, directory)
        spec_path = directory / SPEC_FILENAME
        if spec_path.exists():
            continue
        config = load_config(directory / CONFIG_FILENAME)
        if not config.name:
            config.name = directory.name
        entry = ModelEntry(directory, None, config)
        versions = [VersionRecord(semver=f"{n}.0.0", folder=n) for n in entry.version_folders()]
        ModelSpec.from_model_config(config, versions).save(spec_path)
        written.append(spec_path)
    return written


def _spec_for_new_model(name: str, artifact: Path, framework: str) -> ModelSpec:
    spec = ModelSpec(name=name, framework=framework)
    if framework == "onnx":
        from dspark.runtimes.onnx_session import read_graph_signature  # onnx only needed here

        signature = read_graph_signature(artifact)
        batched = signature.batchable()
        strip = 1 if batched else 0

        def tensors(specs) -> list[TensorSpec]:
            return [TensorSpec(t.name, t.data_type.removeprefix("TYPE_"), list(t.dims[strip:])) for t in specs]

        spec.inputs, spec.outputs = tensors(signature.inputs), tensors(signature.outputs)
        if batched:
            spec.max_batch_size = DEFAULT_ONNX_MAX_BATCH
            spec.dynamic_batching = DynamicBatching()
    return spec


def add_version(repository: Path, name: str, artifact: Path, semver: str,
                framework: Optional[str] = None, source: Optional[str] = None) -> VersionRecord:
    """Copy an artifact into the next version folder and record its semantic version (and where
    it came from: ``source``, default the artifact's path)."""
    check_model_name(name)
    artifact = Path(artifact)
    if not artifact.exists():
        raise SpecError("artifact", f"{artifact} does not exist")
    semver_key(semver)
    directory = Path(repository) / name
    _check_inside(repository, directory)
    spec_path = directory / SPEC_FILENAME
    if spec_path.exists():
        spec = ModelSpec.load(spec_path)
        if framework and framework != spec.framework:
            raise SpecError("framework", f"{name} is a {spec.framework} model, not {framework}", spec_path)
        newest = spec.version
        if newest is not None and semver_key(semver) <= semver_key(newest):
            raise SpecError("versions", f"{semver} is not newer than the recorded {newest}; "
                                        "give a higher semantic version", spec_path)
    else:
        if (directory / CONFIG_FILENAME).exists():
            raise SpecError("", f"{name} has a config.pbtxt but no {SPEC_FILENAME}: run `dspark repo init` first",
                            directory)
        framework = framework or ARTIFACT_FRAMEWORKS.get(artifact.suffix)
        if framework is None:
            raise SpecError("framework", f"cannot tell the framework of {artifact.name}: pass --framework "
                                         f"({', '.join(sorted(FRAMEWORKS))})")
        spec = _spec_for_new_model(name, artifact, framework)
    record = VersionRecord(semver=semver, folder=spec.next_folder(), artifact=spec.artifact_name,
                           source=source or str(artifact.resolve()),
                           added=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    # the folder appears complete in one rename and an unchanged config.pbtxt keeps its time
    # stamp: a server polling the repository never loads half a version (docs/rollout.md)
    directory.mkdir(parents=True, exist_ok=True)
    if artifact.is_dir():
        staged = Path(tempfile.mkdtemp(prefix=".staging-", dir=directory))
        try:
            shutil.copytree(artifact, staged / spec.artifact_name)
            atomic.install_folder(staged, directory / str(record.folder))
        finally:
            shutil.rmtree(staged, ignore_errors=True)
    else:
        atomic.install_folder(artifact, directory / str(record.folder), spec.artifact_name)
    spec.versions.append(record)
    atomic.write_text(spec_path, yaml.safe_dump(spec.to_dict(), sort_keys=False))
    atomic.write_text(directory / CONFIG_FILENAME, spec.config_text(), only_if_changed=True)
    return record


def sync(repository: Path, names: Sequence[str] = ()) -> list[Path]:
    """Write config.pbtxt from modelspec.yaml for the named models (all when none are named)."""
    written = []
    for directory in model_dirs(repository):
        if names and directory.name not in names:
            continue
        _check_inside(repository, directory)
        spec_path = directory / SPEC_FILENAME
        if spec_path.exists():
            (directory / CONFIG_FILENAME).write_text(ModelSpec.load(spec_path).config_text())
            written.append(directory / CONFIG_FILENAME)
    return written


def load_entries(repositories: Iterable[Path]) -> tuple[list[ModelEntry], list[Problem]]:
    entries, problems = [], []
    for repository in repositories:
        if not Path(repository).is_dir():
            problems.append(Problem(Path(repository), "", "repository folder does not exist"))
            continue
        for directory in model_dirs(repository):
            try:
                _check_inside(repository, directory)
            except SpecError as error:
                problems.append(Problem(error.path, error.field, error.reason + " (not read)"))
                continue
            spec = config = None
            try:
                if (directory / SPEC_FILENAME).exists():
                    _check_inside(repository, directory / SPEC_FILENAME)
                    spec = ModelSpec.load(directory / SPEC_FILENAME)
            except SpecError as error:
                problems.append(Problem(error.path or directory, error.field, error.reason))
            config_path = directory / CONFIG_FILENAME
            try:
                if config_path.exists():
                    _check_inside(repository, config_path)
                    config = load_config(config_path)
                elif spec is not None:
                    problems.append(Problem(config_path, "", "missing: run `dspark repo sync` to write it"))
            except SpecError as error:
                problems.append(Problem(config_path, error.field, error.reason))
            entries.append(ModelEntry(directory, spec, config))
    return entries, problems


def validate(repositories: Sequence[Path]) -> list[Problem]:
    """Every problem Triton would refuse to load, or that makes a spec and its config disagree."""
    entries, problems = load_entries(repositories)
    by_name = {entry.name: entry for entry in entries}
    for entry in entries:
        if entry.config is not None:
            problems += _check_config(entry, by_name)
        if entry.spec is not None and entry.config is not None:
            problems += _check_spec(entry)
    return problems


def _expected_artifact(entry: ModelEntry) -> Optional[str]:
    config = entry.config
    if config.default_model_filename:
        return config.default_model_filename
    for info in FRAMEWORKS.values():
        if info.backend and info.backend == config.backend:
            return info.artifact
    return None  # a Python-based backend (ours or the user's) needs no file in the version folder


def _check_config(entry: ModelEntry, models: dict[str, ModelEntry]) -> list[Problem]:
    config, path = entry.config, entry.directory / CONFIG_FILENAME
    found: list[Problem] = []

    def problem(field: str, message: str) -> None:
        found.append(Problem(path, field, message))

    if config.name and config.name != entry.name:
        problem("name", f"{config.name!r} differs from the folder name {entry.name!r}; Triton requires them equal")
    if not config.backend and not config.platform:
        problem("backend", "neither backend nor platform is set; set backend (e.g. \"onnx\") or platform")
    for kind, tensors in (("input", config.input), ("output", config.output)):
        seen = set()
        for i, tensor in enumerate(tensors):
            if tensor.name in seen:
                problem(f"{kind}[{i}].name", f"duplicate tensor name {tensor.name!r}")
            seen.add(tensor.name)
            if tensor.data_type == mc.TYPE_INVALID:
                problem(f"{kind}[{i}].data_type", f"tensor {tensor.name!r} has no data_type")
            if any(d < -1 or d == 0 for d in tensor.dims):
                problem(f"{kind}[{i}].dims", f"tensor {tensor.name!r} has dims {list(tensor.dims)}; "
                                             "each must be positive or -1")
    if config.HasField("dynamic_batching"):
        batching = config.dynamic_batching
        if config.max_batch_size == 0:
            problem("dynamic_batching", "needs max_batch_size > 0 (set max_batch_size or drop dynamic_batching)")
        for size in batching.preferred_batch_size:
            if config.max_batch_size and size > config.max_batch_size:
                problem("dynamic_batching.preferred_batch_size",
                        f"{size} exceeds max_batch_size {config.max_batch_size}")
        if batching.priority_levels and not 1 <= batching.default_priority_level <= batching.priority_levels:
            problem("dynamic_batching.default_priority_level",
                    f"must be between 1 and priority_levels ({batching.priority_levels}), "
                    f"got {batching.default_priority_level}")
    if not entry.version_folders():
        problem("", "no version folder (e.g. 1/): add one with `dspark repo add`")
    if config.platform == "ensemble":
        found += _check_ensemble(config, path, models)
    else:
        folders = entry.version_folders()
        artifact = _expected_artifact(entry)
        for folder in folders:
            if artifact and not (entry.directory / str(folder) / artifact).exists():
                found.append(Problem(entry.directory / str(folder), "",
                                     f"missing {artifact} (build the demo models with `make setup`, "
                                     "or add it with `dspark repo add`)"))
    return found


def _check_ensemble(config: mc.ModelConfig, path: Path, models: dict[str, ModelEntry]) -> list[Problem]:
    found = []
    available = {t.name for t in config.input}
    for i, step in enumerate(config.ensemble_scheduling.step):
        field = f"ensemble_scheduling.step[{i}]"
        target = models.get(step.model_name)
        if target is None:
            found.append(Problem(path, f"{field}.model_name", f"no model {step.model_name!r} in the repositories"))
            continue
        for model_input, tensor in step.input_map.items():
            if tensor not in available:
                found.append(Problem(path, f"{field}.input_map", f"{tensor!r} is neither an ensemble input nor "
                                                                 "an output of an earlier step"))
            if target.config is not None and model_input not in {t.name for t in target.config.input}:
                found.append(Problem(path, f"{field}.input_map", f"{step.model_name} has no input {model_input!r}"))
        for model_output, tensor in step.output_map.items():
            if target.config is not None and model_output not in {t.name for t in target.config.output}:
                found.append(Problem(path, f"{field}.output_map", f"{step.model_name} has no output {model_output!r}"))
            available.add(tensor)
    for i, tensor in enumerate(config.output):
        if tensor.name not in available:
            found.append(Problem(path, f"output[{i}]", f"ensemble output {tensor.name!r} is produced by no step"))
    return found


def _check_spec(entry: ModelEntry) -> list[Problem]:
    spec, spec_path = entry.spec, entry.directory / SPEC_FILENAME
    found = []
    folders = set(entry.version_folders())
    for i, record in enumerate(spec.versions):
        if record.folder not in folders:
            found.append(Problem(spec_path, f"versions[{i}].folder",
                                 f"{record.semver} is recorded in folder {record.folder}, which does not exist"))
    semvers = [r.semver for r in spec.versions]
    if len(set(semvers)) != len(semvers):
        found.append(Problem(spec_path, "versions", "a semantic version is recorded twice"))
    try:
        expected = spec.to_model_config()
    except SpecError as error:
        return found + [Problem(spec_path, error.field, error.reason)]
    actual = entry.config
    for descriptor in expected.DESCRIPTOR.fields:
        if getattr(expected, descriptor.name) != getattr(actual, descriptor.name):
            found.append(Problem(entry.directory / CONFIG_FILENAME, descriptor.name,
                                 f"differs from {SPEC_FILENAME}: run `dspark repo sync {entry.name}` "
                                 f"(or edit {SPEC_FILENAME} to match)"))
    return found
