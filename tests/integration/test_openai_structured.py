"""Structured output on the real server's two demo LLMs (spec_lm: SmolLM2, gemma_lm: Gemma 3):
``response_format`` through the real `openai` SDK, instructor and LangChain return JSON that
validates; /generate's ``guided`` regex and choice hold; a bad schema is a 400 naming its
field and the server keeps serving."""
from __future__ import annotations

import json
import re

import instructor
import jsonschema
import openai
import pytest
import requests
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field

from tests.integration.test_openai_endpoint import api, client  # noqa: F401 - the fixtures

MODELS = ("spec_lm", "gemma_lm")
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["admin", "user"]}, "maxItems": 2}}}
USER = "Describe a user of a web shop as JSON: name, age and tags."
ANSWER = 'Reply with a JSON object with a key "answer" whose value is the capital of France.'


class AnyObject(BaseModel):
    """What JSON mode (``json_object``) guarantees: an object, whatever its keys (a schema's keys
    and types need ``json_schema``: a 135M model does not reliably follow one given in a prompt)."""
    model_config = ConfigDict(extra="allow")


class City(BaseModel):
    city: str = Field(max_length=40)
    country: str = Field(max_length=40)


def _chat(client, model: str, prompt: str, **extra):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=80, temperature=0, **extra)


@pytest.mark.parametrize("model", MODELS)
def test_json_schema_and_json_object_validate_on_both_models(client, model):
    for strict in (True, False):
        reply = _chat(client, model, USER, response_format={
            "type": "json_schema", "json_schema": {"name": "user", "schema": PERSON, "strict": strict}})
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
        assert reply.choices[0].finish_reason == "stop"
    sampled = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": USER}], max_tokens=80, temperature=1.0, seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": PERSON}})
    jsonschema.validate(json.loads(sampled.choices[0].message.content), PERSON)
    reply = _chat(client, model, ANSWER, response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    assert reply.choices[0].finish_reason == "stop"
    # text: no constraint, the same reply as without response_format
    assert _chat(client, model, ANSWER, response_format={"type": "text"}).choices[0].message.content == \
        _chat(client, model, ANSWER).choices[0].message.content


def test_streamed_json_schema_reply_is_the_whole_reply(client):
    form = {"type": "json_schema", "json_schema": {"name": "user", "schema": PERSON}}
    whole = _chat(client, "spec_lm", USER, response_format=form).choices[0].message.content
    chunks = _chat(client, "spec_lm", USER, response_format=form, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


def _generate(triton_server, model: str, params: dict) -> requests.Response:
    body = {"text_input": "Name a colour and a number.", "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"max_tokens": 40, **params})}
    return requests.post(f"http://{triton_server.http_url}/v2/models/{model}/generate", json=body, timeout=120)


@pytest.mark.parametrize("model", MODELS)
def test_generate_with_guided_regex_and_choice(triton_server, model):
    pattern = "(red|green|blue) [0-9]{1,3}"
    for params in ({}, {"temperature": 0.9, "seed": 3}, {"speculative": {"method": "ngram"}}):
        reply = _generate(triton_server, model, {"guided": {"regex": pattern}, **params})
        assert reply.status_code == 200, reply.text
        assert re.fullmatch(pattern, reply.json()["text_output"]), reply.json()
        reply = _generate(triton_server, model, {"guided": {"choice": ["yes", "no", "maybe so"]}, **params})
        assert reply.status_code == 200, reply.text
        assert reply.json()["text_output"] in ("yes", "no", "maybe so")


def test_a_bad_schema_is_a_400_naming_the_field_and_the_server_keeps_serving(client, triton_server):
    reply = _generate(triton_server, "spec_lm", {"guided": {"json_schema": {"type": "nope"}}})
    assert reply.status_code == 400 and "guided.json_schema" in reply.json()["error"], reply.text
    reply = _generate(triton_server, "spec_lm", {"guided": {"regex": "(("}})
    assert reply.status_code == 400 and "guided.regex" in reply.json()["error"], reply.text
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, "spec_lm", USER, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nope"}}})
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, "spec_lm", USER, response_format={"type": "json_schema"})
    assert caught.value.body["param"] == "response_format"
    assert _generate(triton_server, "spec_lm", {"guided": {"choice": ["ok"]}}).json()["text_output"] == "ok"


@pytest.mark.parametrize("model", MODELS)
def test_instructor_returns_a_parsed_object(api, model):  # noqa: F811 - the fixture
    for mode, prompt, response_model in ((instructor.Mode.JSON, ANSWER, AnyObject),
                                         (instructor.Mode.JSON_SCHEMA, "Name a city and its country.", City)):
        patched = instructor.from_openai(openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0,
                                                       timeout=120), mode=mode)
        result = patched.chat.completions.create(model=model, response_model=response_model, max_retries=0,
                                                 messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=80, temperature=0)
        assert isinstance(result, response_model), mode


@pytest.mark.parametrize("model", MODELS)
def test_langchain_structured_output_returns_a_parsed_object(api, model):  # noqa: F811 - the fixture
    chat = ChatOpenAI(model=model, base_url=api.url, api_key="unused", temperature=0, max_tokens=80,
                      max_retries=0, timeout=120)
    result = chat.with_structured_output(City, method="json_schema").invoke("Name a city and its country.")
    assert isinstance(result, City) and result.city and result.country
