"""What a model bench sends: inputs generated from the model's config, or read from a JSON file in
perf_analyzer's input-data format.

Generated data (seeded): floats standard normal, integers in [0, 8) (valid ids for any table of
8+ rows), BOOL random, BYTES short ASCII strings; a variable dimension (-1) is 1 unless
``--shape NAME:d1,d2`` sets it. Optional inputs are left out.

The JSON file (perf_analyzer's "Real Input Data"): ``{"data": [entry, ...]}`` with each entry
mapping input names to a list of values (flattened row-major or nested), to
``{"content": [...], "shape": [...]}``, or to ``{"b64": "..."}`` (little-endian raw bytes).
As in perf_analyzer an entry holds one batch element of a batching model; a request of batch B
takes B consecutive entries, and entries are used round-robin. Sequence streams (a list of lists)
are flattened into one list.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from dspark.bench.jsonfile import read_json
from dspark.errors import ConfigError
from dspark.tensors import TRITON_TO_NUMPY, wire_name


@dataclass(frozen=True)
class InputSpec:
    name: str
    data_type: str  # config name, TYPE_FP32
    dims: tuple[int, ...]  # without the batch dimension
    optional: bool = False

    @property
    def wire_type(self) -> str:
        return wire_name(self.data_type)

    @property
    def dtype(self) -> np.dtype:
        return TRITON_TO_NUMPY[self.data_type]


@dataclass(frozen=True)
class ModelInfo:
    """The parts of a model's config a load generator needs (from either client's JSON)."""

    name: str
    max_batch_size: int
    inputs: tuple[InputSpec, ...]
    outputs: tuple[str, ...]
    decoupled: bool

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "ModelInfo":
        inputs = tuple(InputSpec(e["name"], e.get("data_type", "TYPE_FP32"), tuple(int(d) for d in e.get("dims", [])),
                                 bool(e.get("optional", False))) for e in config.get("input", []))
        return cls(name=config.get("name", "?"), max_batch_size=int(config.get("max_batch_size", 0) or 0),
                   inputs=inputs, outputs=tuple(o["name"] for o in config.get("output", [])),
                   decoupled=bool(config.get("model_transaction_policy", {}).get("decoupled", False)))

    @property
    def batched(self) -> bool:
        return self.max_batch_size > 0


def parse_shapes(texts: Sequence[str]) -> dict[str, list[int]]:
    """``NAME:d1,d2`` (perf_analyzer's --shape) -> {NAME: [d1, d2]}."""
    shapes = {}
    for text in texts:
        name, _, dims = text.rpartition(":")
        try:
            shapes[name] = [int(d) for d in dims.split(",")]
        except ValueError:
            name = ""
        if not name:
            raise ConfigError("shape", f"{text!r}: expected NAME:d1,d2,... e.g. INPUT_IDS:16")
    return shapes


def element_shape(spec: InputSpec, shapes: Mapping[str, Sequence[int]]) -> list[int]:
    if spec.name in shapes:
        given = list(shapes[spec.name])
        if len(given) != len(spec.dims) or any(d != -1 and d != g for d, g in zip(spec.dims, given)):
            raise ConfigError("shape", f"{spec.name}:{','.join(map(str, given))} does not fit the config's dims "
                              f"{list(spec.dims)}")
        return given
    return [1 if d == -1 else d for d in spec.dims]


def generated(info: ModelInfo, batch: int, shapes: Mapping[str, Sequence[int]] | None = None,
              seed: int = 0) -> list[dict[str, np.ndarray]]:
    """One request's arrays per input (a single request, reused: like perf_analyzer's random mode)."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for spec in info.inputs:
        if spec.optional:
            continue
        shape = ([batch] if info.batched else []) + element_shape(spec, shapes or {})
        kind = spec.dtype.kind
        if kind == "f":
            arrays[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        elif kind in "iu":
            arrays[spec.name] = rng.integers(0, 8, size=shape).astype(spec.dtype)
        elif kind == "b":
            arrays[spec.name] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            words = np.array([f"dspark bench {i}".encode() for i in range(int(np.prod(shape)))], dtype=np.object_)
            arrays[spec.name] = words.reshape(shape)
    return [arrays]


def _element(spec: InputSpec, value: Any, shapes: Mapping[str, Sequence[int]], where: str) -> np.ndarray:
    shape = None
    if isinstance(value, dict) and "b64" in value:
        raw = base64.b64decode(value["b64"])
        if spec.dtype.kind == "O":
            return np.array([raw], dtype=np.object_).reshape(element_shape(spec, shapes) or [1])
        array = np.frombuffer(raw, dtype=spec.dtype.newbyteorder("<")).astype(spec.dtype)
    else:
        if isinstance(value, dict):
            if "content" not in value:
                raise ConfigError(where, "expected a list, {\"content\": [...], \"shape\": [...]} or {\"b64\": ...}")
            shape = value.get("shape")
            value = value["content"]
        if spec.dtype.kind == "O":
            flat = np.array(value, dtype=np.object_).reshape(-1)
            array = np.array([v.encode() if isinstance(v, str) else
                              json.dumps(v).encode() if not isinstance(v, bytes) else v for v in flat], dtype=np.object_)
        else:
            try:
                array = np.array(value, dtype=spec.dtype)
            except (TypeError, ValueError) as error:
                raise ConfigError(where, f"not {spec.wire_type} data: {error}") from None
    shape = list(shape) if shape is not None else element_shape(spec, shapes)
    if array.size != int(np.prod(shape)):
        raise ConfigError(where, f"{array.size} values do not fill shape {shape} (give \"shape\" or --shape)")
    return array.reshape(shape)


def from_file(path: Path, info: ModelInfo, batch: int,
              shapes: Mapping[str, Sequence[int]] | None = None) -> list[dict[str, np.ndarray]]:
    """The requests a perf_analyzer input-data file describes, each ready to send."""
    document = read_json(path, "input-data")
    entries = document.get("data") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError("data", "expected {\"data\": [ {input: values, ...}, ... ]} with at least one entry", path)
    entries = [e for item in entries for e in (item if isinstance(item, list) else [item])]
    names = {spec.name: spec for spec in info.inputs}
    elements = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ConfigError(f"data[{i}]", "expected an object mapping input names to data", path)
        unknown = set(entry) - set(names)
        if unknown:
            raise ConfigError(f"data[{i}]", f"model {info.name} has no input {sorted(unknown)[0]!r}; its inputs: "
                              f"{', '.join(names)}", path)
        missing = [s.name for s in info.inputs if not s.optional and s.name not in entry]
        if missing:
            raise ConfigError(f"data[{i}]", f"input {missing[0]!r} is missing", path)
        try:
            elements.append({name: _element(names[name], value, shapes or {}, f"data[{i}].{name}")
                             for name, value in entry.items()})
        except ConfigError as error:
            raise ConfigError(error.field, error.reason, path) from None
    if not info.batched:
        return elements
    requests = []
    for start in range(0, len(elements), batch) if len(elements) >= batch else [0]:
        group = [elements[(start + j) % len(elements)] for j in range(batch)]
        try:
            requests.append({name: np.stack([g[name] for g in group]) for name in group[0]})
        except ValueError as error:
            raise ConfigError("data", f"entries {start}..{start + batch - 1} cannot form a batch: {error}", path) from None
    return requests
