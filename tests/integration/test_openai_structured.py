"""Structured output through the OpenAI-compatible API and /generate on the real server's demo
LLMs (SmolLM2 `spec_lm`, Gemma 3 270M `gemma_lm`), as apps ask for it: `response_format` with the
real `openai` SDK, `instructor` and LangChain's `with_structured_output`, and
`sampling_parameters.guided` on Triton's generate endpoint."""
from __future__ import annotations

import json
from typing import Literal

import instructor
import jsonschema
import openai
import pytest
import requests
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


MODELS = ["spec_lm", "gemma_lm"]
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "none"]}},
          "required": ["name", "age", "pet"]}
ASK = "Ann is 31 and has a dog. Give her name, age and pet as JSON."


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    pet: Literal["cat", "dog", "none"]


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


@pytest.mark.parametrize("model", MODELS)
def test_json_schema_replies_follow_the_schema_greedy_sampled_and_streamed(client, model):
    messages = [{"role": "user", "content": ASK}]
    greedy = client.chat.completions.create(model=model, messages=messages, max_tokens=80, temperature=0,
                                            response_format=_json_schema(PERSON))
    jsonschema.validate(json.loads(greedy.choices[0].message.content), PERSON)
    assert greedy.choices[0].finish_reason == "stop"
    sampled = client.chat.completions.create(model=model, messages=messages, max_tokens=80, temperature=1.0,
                                             seed=3, response_format=_json_schema(PERSON))
    jsonschema.validate(json.loads(sampled.choices[0].message.content), PERSON)
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=80, temperature=0,
                                            response_format=_json_schema(PERSON), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == greedy.choices[0].message.content


def test_json_object_and_text_formats_on_chat_and_completions(client):
    reply = client.chat.completions.create(
        model="spec_lm", max_tokens=60, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Reply with a JSON object with keys name and age for Ann, 31."}])
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    text = client.chat.completions.create(model="spec_lm", max_tokens=8, temperature=0, response_format={"type": "text"},
                                          messages=[{"role": "user", "content": "Hi"}])
    plain = client.chat.completions.create(model="spec_lm", max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "Hi"}])
    assert text.choices[0].message.content == plain.choices[0].message.content
    completion = client.completions.create(model="gemma_lm", prompt="Ann, 31, has a dog. As JSON:", max_tokens=60,
                                           temperature=0, extra_body={"response_format": _json_schema(PERSON)})
    jsonschema.validate(json.loads(completion.choices[0].text), PERSON)


def test_a_schema_that_cannot_be_compiled_is_a_400_naming_response_format(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="spec_lm", max_tokens=8, messages=[{"role": "user", "content": "Hi"}],
                                       response_format=_json_schema({"type": "nonsense"}))
    assert error.value.body["param"] == "response_format"
    assert "cannot be compiled" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        client.chat.completions.create(model="spec_lm", max_tokens=8, messages=[{"role": "user", "content": "Hi"}],
                                       response_format={"type": "json_schema"})
    assert client.chat.completions.create(model="spec_lm", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])


def _generate(triton_server, model: str, params: dict):
    body = {"text_input": "The answer, in one word:", "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(params)}
    return requests.post(f"http://{triton_server.http_url}/v2/models/{model}/generate", json=body, timeout=120)


@pytest.mark.parametrize("method", ["none", "suffix", "dspark", "hybrid"])
def test_generate_follows_a_regex_and_a_choice_for_every_method(triton_server, method):
    spec = {"method": method}
    reply = _generate(triton_server, "spec_lm", {"max_tokens": 20, "guided": {"regex": "[0-9]{3}-[0-9]{4}"},
                                                 "speculative": spec})
    assert reply.status_code == 200, reply.text
    text = reply.json()["text_output"]
    assert len(text) == 8 and text[3] == "-" and (text[:3] + text[4:]).isdigit()
    choice = _generate(triton_server, "spec_lm", {"max_tokens": 20, "guided": {"choice": ["yes", "no", "maybe"]},
                                                  "speculative": spec})
    assert choice.json()["text_output"] in ("yes", "no", "maybe")


def test_generate_refuses_a_bad_guided_spec_naming_it(triton_server):
    reply = _generate(triton_server, "spec_lm", {"max_tokens": 4, "guided": {"regex": "(("}})
    assert reply.status_code == 400 and "guided.regex: cannot be compiled" in reply.json()["error"]
    reply = _generate(triton_server, "spec_lm", {"max_tokens": 4, "guided": {"regex": "a", "choice": ["b"]}})
    assert reply.status_code == 400 and "exactly one" in reply.json()["error"]


def test_instructor_returns_a_parsed_model(client):
    structured = instructor.from_openai(client, mode=instructor.Mode.JSON_SCHEMA)
    person = structured.chat.completions.create(model="spec_lm", response_model=Person, max_retries=0,
                                                max_tokens=80, temperature=0,
                                                messages=[{"role": "user", "content": ASK}])
    assert isinstance(person, Person)


@pytest.mark.parametrize("model", MODELS)
def test_langchain_with_structured_output_json_schema(api, model):
    chat = ChatOpenAI(model=model, base_url=api.url, api_key="unused", temperature=0, max_tokens=80, max_retries=0)
    person = chat.with_structured_output(Person, method="json_schema").invoke(ASK)
    assert isinstance(person, Person)
