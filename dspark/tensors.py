"""Triton tensor types and request checks, without pb_utils, so adapters share them and unit-test alone."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

from dspark.errors import RequestError

# Triton config data types <-> numpy. TYPE_STRING tensors arrive as numpy object arrays of bytes.
TRITON_TO_NUMPY: dict[str, np.dtype] = {
    "TYPE_BOOL": np.dtype(np.bool_),
    "TYPE_UINT8": np.dtype(np.uint8),
    "TYPE_UINT16": np.dtype(np.uint16),
    "TYPE_UINT32": np.dtype(np.uint32),
    "TYPE_UINT64": np.dtype(np.uint64),
    "TYPE_INT8": np.dtype(np.int8),
    "TYPE_INT16": np.dtype(np.int16),
    "TYPE_INT32": np.dtype(np.int32),
    "TYPE_INT64": np.dtype(np.int64),
    "TYPE_FP16": np.dtype(np.float16),
    "TYPE_FP32": np.dtype(np.float32),
    "TYPE_FP64": np.dtype(np.float64),
    "TYPE_STRING": np.dtype(np.object_),
}
NUMPY_TO_TRITON = {dtype: name for name, dtype in TRITON_TO_NUMPY.items()}


def wire_name(data_type: str) -> str:
    """TYPE_FP32 -> FP32, the name clients use (TYPE_STRING -> BYTES)."""
    short = data_type.removeprefix("TYPE_")
    return "BYTES" if short == "STRING" else short


@dataclass(frozen=True)
class TensorSpec:
    """One input or output as the model config declares it (dims without the batch dimension)."""

    name: str
    data_type: str
    dims: tuple[int, ...]
    optional: bool = False

    @classmethod
    def from_config(cls, entry: Mapping) -> "TensorSpec":
        return cls(
            name=entry["name"],
            data_type=entry["data_type"],
            dims=tuple(int(d) for d in entry["dims"]),
            optional=bool(entry.get("optional", False)),
        )

    @property
    def numpy_dtype(self) -> np.dtype:
        return TRITON_TO_NUMPY[self.data_type]

    def expected_shape(self, batched: bool) -> list[int]:
        return ([-1] if batched else []) + list(self.dims)

    def check(self, array: Optional[np.ndarray], batched: bool) -> None:
        expected = self.expected_shape(batched)
        if array is None:
            if self.optional:
                return
            raise RequestError(
                f"input tensor '{self.name}'", f"missing: send {wire_name(self.data_type)} with shape {expected}"
            )
        if array.dtype != self.numpy_dtype and not (self.data_type == "TYPE_STRING" and array.dtype.kind in "OSU"):
            raise RequestError(
                f"input tensor '{self.name}'",
                f"has data type {wire_name(NUMPY_TO_TRITON.get(array.dtype, str(array.dtype)))}, "
                f"expected {wire_name(self.data_type)}",
            )
        if len(array.shape) != len(expected) or any(
            want != -1 and got != want for got, want in zip(array.shape, expected)
        ):
            raise RequestError(
                f"input tensor '{self.name}'", f"has shape {list(array.shape)}, expected {expected} (-1: any size)"
            )


def check_inputs(specs: Sequence[TensorSpec], arrays: Mapping[str, Optional[np.ndarray]], batched: bool) -> None:
    """Raise RequestError for the first input that is missing, unknown, of the wrong type or shape."""
    known = {spec.name for spec in specs}
    unknown = sorted(set(arrays) - known)
    if unknown:
        raise RequestError(f"input tensor '{unknown[0]}'", f"unknown: this model takes {sorted(known)}")
    for spec in specs:
        spec.check(arrays.get(spec.name), batched)


# The tensors of Triton's LLM generate API as dspark's `speculative` backend takes them (its
# auto-complete fills them in; `dspark llm import` writes them).
GENERATE_INPUTS = [
    {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "messages", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "exclude_input_in_output", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
]
GENERATE_OUTPUTS = [{"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]},
           {"name": "usage", "data_type": "TYPE_STRING", "dims": [1]},
           # JSON, when sampling_parameters.logprobs is given: the response's tokens' log-probabilities
           {"name": "logprobs", "data_type": "TYPE_STRING", "dims": [1]}]
