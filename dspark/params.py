"""The one way a backend reads its config.pbtxt ``parameters``: pydantic models.

Values arrive as strings; pydantic converts them (ints, floats, true/false/yes/no/on/off/1/0,
JSON where a field says so); a parameter left empty takes its default. A model's parameters may
be read by several schemas (the ``onnx`` backend's session options and its execution-provider
preference); a parameter that none of them knows is refused with the names it could have meant,
so a typo never goes unnoticed. Errors name the parameter, what it must be and what it got, e.g.
``parameter 'graph_optimization_level': Input should be 'disable', 'basic', 'extended' or 'all'
(got 'fast')``; raised in ``initialize``, they fail the load.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Mapping, Optional, TypeVar

import pydantic
from pydantic.functional_validators import BeforeValidator

from dspark.errors import ConfigError, from_validation_error


def config_parameters(model_config: Mapping) -> dict[str, str]:
    """`parameters { key: "k" value { string_value: "v" } }` as a plain {k: v} dict."""
    return {key: value.get("string_value", "") for key, value in model_config.get("parameters", {}).items()}


def _comma_separated(value: Any) -> Any:
    return tuple(item.strip() for item in value.split(",") if item.strip()) if isinstance(value, str) else value


# A config parameter holding a comma separated list ("CUDAExecutionProvider, CPUExecutionProvider").
CommaList = Annotated[tuple[str, ...], BeforeValidator(_comma_separated)]


# Parameters the Python backend itself reads from any model's config (python_backend's README).
TRITON_PARAMETERS = frozenset({"EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS"})


class ConfigParameters(pydantic.BaseModel):
    """Base of a backend's config parameters: fields with types, defaults and bounds."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")


P = TypeVar("P", bound=ConfigParameters)


def _given(source: Mapping) -> dict[str, str]:
    """The non-empty parameters of a model config (its dict form) or of a {name: value} dict."""
    params = config_parameters(source) if isinstance(source.get("parameters"), Mapping) else source
    return {key: value for key, value in params.items() if str(value).strip() != ""}


def parse_parameters(schema: type[P], source: Mapping, *others: type[ConfigParameters],
                     path: Optional[Path] = None) -> P:
    """``source``'s parameters validated by ``schema``; ``others`` are schemas that read the rest
    of the same parameters (they are only checked for names here). ``path``: the config file, for
    the error message."""
    given = _given(source)
    known = set(schema.model_fields).union(*(other.model_fields for other in others))
    for name in sorted(set(given) - known - TRITON_PARAMETERS):
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else f"; known parameters: {', '.join(sorted(known))}"
        raise ConfigError(f"parameter '{name}'", f"is not a parameter of this backend{hint}", path)
    try:
        return schema.model_validate({key: value for key, value in given.items() if key in schema.model_fields})
    except pydantic.ValidationError as error:
        named = from_validation_error(error, ConfigError)
        raise ConfigError(f"parameter '{named.field}'", named.reason, path) from None
