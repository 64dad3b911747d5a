"""``response_format`` on chat completions becomes the speculative backend's ``guided``."""
from __future__ import annotations

import json

import pytest

from dspark.openai.protocol import ChatCompletionRequest, OpenAIError, parse

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _guided(response_format):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": response_format}
    params = json.loads(parse(ChatCompletionRequest, body).backend_inputs()["sampling_parameters"])
    return params.get("guided")


def test_each_type_maps_onto_guided():
    assert _guided({"type": "text"}) is None
    assert _guided({"type": "json_object"}) == {"json_object": True}
    for strict in (True, False, None):
        form = {"name": "city", "schema": SCHEMA, **({} if strict is None else {"strict": strict})}
        assert _guided({"type": "json_schema", "json_schema": form}) == {"json_schema": SCHEMA}
    assert _guided({"type": "json_schema", "json_schema": {"name": "any"}}) == {"json_schema": {}}


@pytest.mark.parametrize("response_format, param", [
    ({"type": "json_schema", "json_schema": {"name": "has space", "schema": SCHEMA}},
     "response_format.json_schema.name"),
    ({"type": "json_schema"}, "response_format"),
    ({"type": "json_object", "json_schema": {"name": "x"}}, "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
])
def test_a_bad_response_format_is_a_400_naming_the_field(response_format, param):
    with pytest.raises(OpenAIError) as caught:
        _guided(response_format)
    assert caught.value.status == 400 and caught.value.param == param
