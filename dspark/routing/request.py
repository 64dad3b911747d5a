"""What a client request tells the router: its tier and user id, from the request's parameters.

Triton hands a model the request's parameters as JSON: the client's own (``tier``, ``user_id``)
and the forwarded headers (``dspark-tier``, ``dspark-user-id``, see docs/router.md), named as the
client spelled them: header names are matched in any case (``Dspark-Tier``). A parameter wins over
a header; an empty value counts as absent. Parsed by pydantic, so a bad value is a
``RequestError`` naming it (``parameters.tier: Input should be a valid string (got 5)``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError

from dspark.errors import RequestError, from_validation_error


def _id_text(value: Any) -> Any:
    """User ids may be sent as numbers; they are hashed as text."""
    return str(value) if type(value) is int else value


Name = Annotated[str, Strict()]
UserId = Annotated[str, BeforeValidator(_id_text), Strict()]


class RequestRouteParameters(BaseModel):
    """The request parameters the router reads; everything else is left to the target. (The
    router's config parameters are dspark.triton.params.RouterParameters.)"""

    model_config = ConfigDict(extra="ignore", frozen=True)
    tier: Optional[Name] = None
    tier_header: Optional[Name] = Field(None, alias="dspark-tier")
    user_id: Optional[UserId] = None
    user_header: Optional[UserId] = Field(None, alias="dspark-user-id")


HEADERS = ("dspark-tier", "dspark-user-id")
_KEYS = ("tier", "user_id", *HEADERS)  # what the router reads of a request's parameters


@dataclass(frozen=True)
class RouteFields:
    tier: Optional[str]
    user_id: Optional[str]


def route_fields(raw: Union[str, dict, None]) -> RouteFields:
    """The tier and user id of a request from its parameters (Triton's JSON text or a dict)."""
    try:
        data = json.loads(raw) if isinstance(raw, str) and raw else raw
    except ValueError as exc:
        raise RequestError("parameters", f"not valid JSON: {exc}") from None
    if not data:
        return RouteFields(None, None)
    if isinstance(data, dict):
        data = {key.lower() if isinstance(key, str) and key.lower() in HEADERS else key: value
                for key, value in data.items()}
        given = {key: data[key] for key in _KEYS if key in data}
        if all(type(value) is str for value in given.values()):  # the usual request: no validation to do
            return RouteFields(given.get("tier") or given.get("dspark-tier") or None,
                               given.get("user_id") or given.get("dspark-user-id") or None)
    try:
        parsed = RequestRouteParameters.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, RequestError, prefix="parameters") from None
    return RouteFields(parsed.tier or parsed.tier_header or None, parsed.user_id or parsed.user_header or None)
