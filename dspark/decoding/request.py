"""Parse a generate request's ``sampling_parameters`` JSON (Triton's LLM-backend convention)
with pydantic: an error names the field (``temperature``, ``speculative.method``)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Annotated, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.errors import RequestError, field_path, from_validation_error


@dataclass
class GenerateOptions:
    """A request's parameters besides the prompt: how to sample and speculate, and whether the
    prompt goes through the chat template."""
    sampling: SamplingParams
    spec: SpeculativeParams
    chat: bool = False


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _object(raw, field: str) -> dict:
    if raw in (None, b"", ""):
        return {}
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except UnicodeDecodeError as error:
        raise RequestError(field, f"is not UTF-8 ({error.reason} at byte {error.start})") from None
    except ValueError as error:
        raise RequestError(field, f"not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise RequestError(field, "must be a JSON object")
    return data


def parse_generate_options(raw: "str | bytes | None", default_spec: SpeculativeParams,
                           methods: Optional[tuple[str, ...]] = None) -> GenerateOptions:
    """Validated options; RequestError names the bad field. ``speculative`` overrides the
    model's defaults field by field; ``methods``: the model's methods, when known."""
    data = _object(raw, "sampling_parameters")
    spec_data = data.pop("speculative", None) or {}
    if not isinstance(spec_data, dict):
        raise RequestError("speculative", "must be a JSON object")
    chat = data.pop("chat", False)
    if not isinstance(chat, bool):
        raise RequestError("chat", f"must be true or false, got {json.dumps(chat)}")
    try:
        sampling = SamplingParams(**{k: v for k, v in data.items() if v is not None})
    except ValidationError as error:
        raise from_validation_error(error) from None
    except TypeError as error:  # not keyword-able (a non-string key cannot come from JSON)
        raise RequestError("sampling_parameters", str(error)) from None
    try:
        spec = SpeculativeParams(**{**asdict(default_spec), **spec_data})
    except ValidationError as error:
        raise from_validation_error(error, prefix="speculative") from None
    if methods is not None and spec.method not in methods:
        raise RequestError("speculative.method", f"{spec.method!r} is not one of this model's "
                                                 f"methods {methods}")
    return GenerateOptions(sampling, spec, chat)


def parse_sampling_parameters(raw: "str | bytes | None", default_spec: SpeculativeParams,
                              methods: Optional[tuple[str, ...]] = None,
                              ) -> tuple[SamplingParams, SpeculativeParams]:
    options = parse_generate_options(raw, default_spec, methods)
    return options.sampling, options.spec


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant"]
    content: str


_MESSAGES = TypeAdapter(Annotated[list[ChatMessage], Field(min_length=1)])


def parse_messages(raw: "str | bytes | None") -> Optional[list[dict]]:
    """The optional ``messages`` input: a JSON list of {"role", "content"} objects."""
    if raw in (None, b"", ""):
        return None
    try:
        data = json.loads(raw)
    except UnicodeDecodeError as error:
        raise RequestError("messages", f"is not UTF-8 ({error.reason} at byte {error.start})") from None
    except ValueError as error:
        raise RequestError("messages", f"not valid JSON ({error})") from None
    try:
        return [m.model_dump() for m in _MESSAGES.validate_python(data)]
    except ValidationError as error:
        first = error.errors()[0]
        raise RequestError(field_path(("messages", *first["loc"])), first["msg"]) from None
