"""dspark's one error model: what went wrong, which field, file or tensor, and what Triton code it maps to.

Library code raises these and never imports pb_utils; a backend's model.py turns any exception into
a Triton error with `dspark.triton.adapter.triton_error`, the one place where the mapping lives.

- `RequestError`: a request the model cannot serve as sent (INVALID_ARG). Names the field/tensor.
- `ConfigError`: a configuration (config.pbtxt parameter, modelspec.yaml, routing.yaml, a graph
  file) the code cannot use. Names the field and, where there is one, the file. Raised at load
  time it fails the load; a reloadable file keeps its last good value.
- `UnavailableError`: a well-formed request the server cannot serve now (UNAVAILABLE): a queue
  full, a deadline passed, a target that failed or timed out, a shutdown. ``reason`` is a short
  label for metrics.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

# Triton error code names (pb_utils.TritonError.<name>, tritonclient's status).
INVALID_ARG = "INVALID_ARG"
UNAVAILABLE = "UNAVAILABLE"
INTERNAL = "INTERNAL"
CANCELLED = "CANCELLED"


class DsparkError(Exception):
    """Base of dspark's errors; ``code`` is the Triton error code name it maps to."""

    code: str = INTERNAL


def _describe(field: str, reason: str) -> str:
    return f"{field}: {reason}" if field else reason


class RequestError(DsparkError, ValueError):
    """A bad request; ``field`` names the input tensor or request parameter (e.g. ``temperature``,
    ``speculative.method``, ``input tensor 'features'``)."""

    code = INVALID_ARG

    def __init__(self, field: str, reason: str):
        super().__init__(_describe(field, reason))
        self.field, self.reason = field, reason


class ConfigError(DsparkError, ValueError):
    """A configuration the code cannot use; names the field and, where known, the file."""

    code = INVALID_ARG

    def __init__(self, field: str, reason: str, path: Optional[Union[str, Path]] = None):
        where = f"{path}: " if path else ""
        super().__init__(f"{where}{_describe(field, reason)}")
        self.field, self.reason, self.path = field, reason, (Path(path) if path else None)


class UnavailableError(DsparkError):
    """The server cannot serve this request now; ``reason`` is the metric label (deadline,
    queue_full, target_error, target_timeout, busy, shutdown)."""

    code = UNAVAILABLE

    def __init__(self, message: str, reason: str = "unavailable"):
        super().__init__(message)
        self.reason = reason


class CancelledError(DsparkError):
    """The client cancelled the request."""

    code = CANCELLED


def error_code(error: BaseException) -> str:
    """The Triton error code name for any exception: dspark's own carry it, the rest are INTERNAL."""
    return getattr(error, "code", INTERNAL) if isinstance(error, DsparkError) else INTERNAL


def field_path(loc: tuple) -> str:
    """pydantic's error location ('inputs', 0, 'dtype') as a field path: inputs[0].dtype."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def from_validation_error(error, kind: type = RequestError, prefix: str = "", **extra) -> DsparkError:
    """The first problem of a pydantic ValidationError as a RequestError or ConfigError naming its
    field path (``prefix`` is prepended, e.g. ``sampling_parameters``)."""
    first = error.errors()[0]
    path = field_path(tuple(first.get("loc", ())))
    if prefix:
        path = f"{prefix}.{path}" if path else prefix
    message = first.get("msg", "invalid value")
    if "input" in first and first.get("type") not in ("missing",):
        message = f"{message} (got {first['input']!r})"
    return kind(path, message, **extra)
