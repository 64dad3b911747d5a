"""Helpers for backends/*/model.py that need no pb_utils: model config parameters, stub facts."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Mapping, Optional, TypeVar

import pydantic
from pydantic.functional_validators import BeforeValidator

from dspark.errors import ConfigError, error_code, from_validation_error


def triton_error(pb_utils: Any, error: BaseException, context: str = "") -> Any:
    """Any exception as a `pb_utils.TritonError` with the code dspark's error model gives it
    (dspark.errors); the one place where that mapping happens. ``pb_utils`` is passed in so this
    module imports no Triton code. ``context`` prefixes the message of unexpected (INTERNAL) errors."""
    code = error_code(error)
    message = str(error) or type(error).__name__
    if code == "INTERNAL" and context:
        message = f"{context}: {message}"
    return pb_utils.TritonError(message, getattr(pb_utils.TritonError, code, pb_utils.TritonError.INTERNAL))


def config_parameters(model_config: Mapping) -> dict[str, str]:
    """`parameters { key: "k" value { string_value: "v" } }` as a plain {k: v} dict."""
    return {key: value.get("string_value", "") for key, value in model_config.get("parameters", {}).items()}


def _comma_separated(value: Any) -> Any:
    return tuple(item.strip() for item in value.split(",") if item.strip()) if isinstance(value, str) else value


# A config parameter holding a comma separated list ("CUDAExecutionProvider, CPUExecutionProvider").
CommaList = Annotated[tuple[str, ...], BeforeValidator(_comma_separated)]


class ConfigParameters(pydantic.BaseModel):
    """Base of a backend's config parameters: fields with types, defaults and bounds. Values arrive
    as strings and pydantic converts them (ints, floats, true/false/yes/no/on/off/1/0); a parameter
    left empty takes its default; parameters the backend does not know are ignored."""

    model_config = pydantic.ConfigDict(frozen=True, extra="ignore")


P = TypeVar("P", bound=ConfigParameters)


def _config_error(error: pydantic.ValidationError, name: Optional[str] = None) -> ConfigError:
    """A failed parameter as ConfigError("parameter 'name'", reason)."""
    named = from_validation_error(error, ConfigError)
    return ConfigError(f"parameter '{name or named.field}'", named.reason)


def parse_parameters(schema: type[P], model_config: Mapping) -> P:
    """The model config's parameters validated by ``schema``; a bad value is a ConfigError naming
    the parameter, what it must be and what it got (raised in initialize, it fails the load)."""
    given = {key: value for key, value in config_parameters(model_config).items() if value.strip() != ""}
    try:
        return schema.model_validate(given)
    except pydantic.ValidationError as error:
        raise _config_error(error) from None


def _parameter(params: Mapping[str, str], name: str, annotation: Any, default: Any) -> Any:
    raw = params.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return pydantic.TypeAdapter(annotation).validate_python(raw)
    except pydantic.ValidationError as error:
        raise _config_error(error, name) from None


def parameter_int(params: Mapping[str, str], name: str, default: int, minimum: int = 0) -> int:
    return _parameter(params, name, Annotated[int, pydantic.Field(ge=minimum)], default)


def parameter_bool(params: Mapping[str, str], name: str, default: bool) -> bool:
    return _parameter(params, name, bool, default)


def parameter_list(params: Mapping[str, str], name: str, default: tuple[str, ...] = ()) -> list[str]:
    return list(_parameter(params, name, CommaList, default))


def stub_version_dir() -> Optional[Path]:
    """The version folder being loaded, as the Python backend stub was told on its command line.

    `auto_complete_config` gets no model path from Triton; the stub's argv[1] is
    `<repository>/<model>/<version>/model.py`. None where /proc is not available.
    """
    try:
        argv = Path("/proc/self/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    if len(argv) < 2 or not argv[1]:
        return None
    return Path(argv[1].decode()).parent


def server_http_url(argv: Optional[list[str]] = None) -> Optional[str]:
    """``host:port`` of the HTTP endpoint of the tritonserver this stub belongs to, from the
    server's command line (the stub's parent; ``argv`` for tests), or None when HTTP is off.

    A Python model learns of its unload only through finalize, after its last request ended; a
    model with long requests in flight asks the server's health endpoints instead (the stub's
    own model-readiness call can block while the server stops)."""
    if argv is None:
        try:
            argv = [a.decode() for a in Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            return None
    options: dict[str, str] = {}
    for arg, following in zip(argv[1:], [*argv[2:], ""]):
        if arg.startswith("--"):
            key, _, value = arg[2:].partition("=")
            options[key] = value if "=" in arg else following
    if options.get("allow-http", "true").lower() in ("false", "0", "no"):
        return None
    host = options.get("http-address", "0.0.0.0")
    host = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
    return f"{host}:{options.get('http-port', '8000')}"
