"""Tool calls through the OpenAI-compatible API on the real server, for both demo LLMs (SmolLM2 and
Gemma 3 270M), called with the real clients: the `openai` SDK (tool_choice required, named, auto
and none; a streamed reply assembled by the SDK's stream helper; a second turn with the tool's
result), LangChain's ChatOpenAI (bind_tools, with_structured_output by function calling) and
instructor (Mode.TOOLS). Small models choose their calls badly: the tests check what the API
guarantees, that every call names an offered function and its arguments follow its schema."""
from __future__ import annotations

from typing import Literal

import instructor
import openai
import pytest
from langchain_core.messages import AIMessageChunk
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field


MODELS = ["spec_lm", "gemma_lm"]
QUESTION = "What is the weather in Paris, in celsius?"
MAX_TOKENS = 160


class Weather(BaseModel):
    """The weather in a city."""
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=30)
    unit: Literal["celsius", "fahrenheit"]


class Clock(BaseModel):
    """The time in a time zone."""
    model_config = ConfigDict(extra="forbid")
    zone: str = Field(max_length=20)


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")
    street: str = Field(max_length=30)
    number: int = Field(ge=1, le=999)


class Person(BaseModel):
    """A person and where they live."""
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)
    address: Address  # a nested model: its schema is a $ref into $defs


ARGUMENTS = {"get_weather": Weather, "get_time": Clock}
TOOLS = [{"type": "function", "function": {"name": name, "description": model.__doc__,
                                           "parameters": model.model_json_schema()}}
         for name, model in ARGUMENTS.items()]


def ask(client, model, **fields):
    fields = {"max_tokens": MAX_TOKENS, "temperature": 0, **fields}
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                          tools=TOOLS, **fields)


def assert_valid_calls(message, names=tuple(ARGUMENTS)):
    """Every call names an offered function, has an id, and its arguments follow its schema."""
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        ARGUMENTS[call.function.name].model_validate_json(call.function.arguments)
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)


@pytest.mark.parametrize("model", MODELS)
def test_required_makes_one_call_that_follows_the_schema(client, model):
    reply = ask(client, model, tool_choice="required", parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message)


@pytest.mark.parametrize("model", MODELS)
def test_a_named_choice_calls_that_function(client, model):
    reply = ask(client, model, tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message, names=("get_time",))


@pytest.mark.parametrize("model", MODELS)
def test_auto_answers_in_text_or_in_valid_calls(client, model):
    choice = ask(client, model).choices[0]  # tool_choice's default with tools: auto
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert_valid_calls(choice.message)
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content


@pytest.mark.parametrize("model", MODELS)
def test_none_answers_in_text(client, model):
    choice = ask(client, model, tool_choice="none", max_tokens=24).choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize("model", MODELS)
def test_streamed_calls_assemble_to_the_whole_reply(client, model):
    fields = dict(model=model, messages=[{"role": "user", "content": QUESTION}], tools=TOOLS,
                  tool_choice="required", parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=0)
    whole = client.chat.completions.create(**fields).choices[0]
    with client.chat.completions.stream(**fields) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_completion().choices[0]
    assert kinds.count("tool_calls.function.arguments.delta") > 1  # the arguments came in pieces
    assert streamed.finish_reason == "tool_calls"
    assert_valid_calls(streamed.message)
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]  # greedy: the same


@pytest.mark.parametrize("model", MODELS)
def test_a_streamed_auto_reply_is_the_whole_reply(client, model):
    fields = dict(model=model, messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS,
                  max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**fields).choices[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(**fields, stream=True) if c.choices]
    assert chunks[0].delta.role == "assistant" and chunks[-1].finish_reason == whole.finish_reason
    text = "".join(c.delta.content or "" for c in chunks)
    calls: dict[int, list[str]] = {}
    for piece in (p for c in chunks for p in c.delta.tool_calls or []):
        name, arguments = calls.setdefault(piece.index, ["", ""])
        calls[piece.index] = [name + (piece.function.name or ""), arguments + (piece.function.arguments or "")]
    assert (text or None) == whole.message.content  # text, or None with calls
    assert list(map(tuple, calls.values())) == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]


@pytest.mark.parametrize("model", MODELS)
def test_a_second_turn_takes_the_tools_result(client, model):
    first = ask(client, model, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = [{"role": "user", "content": QUESTION},
                first.choices[0].message.model_dump(exclude_none=True),  # content None: left out
                {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    assert "content" not in messages[1]
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=32, temperature=0).choices[0]
    assert second.message.content and not second.message.tool_calls
    # the same history with the assistant's content given as null is accepted too
    messages[1]["content"] = None
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0)
    assert again.choices[0].message.content == second.message.content


def test_inconsistent_tool_requests_are_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODELS[0], max_tokens=8, messages=[
            {"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_x", "content": "1"}])
    assert error.value.body["param"] == "messages[1].tool_call_id"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODELS[0], max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                       tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert error.value.body["param"] == "tool_choice.function.name"
    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "format": "no-such-format"}}}}}]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODELS[0], max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                       tools=bad, tool_choice="required")
    assert error.value.body["param"] == "tools" and "guided.grammar" in error.value.body["message"]


def chat_model(api, model) -> ChatOpenAI:
    return ChatOpenAI(model=model, base_url=api.url, api_key="unused", temperature=0, max_tokens=MAX_TOKENS,
                      max_retries=0, timeout=120)


@pytest.mark.parametrize("model", MODELS)
def test_langchain_bind_tools_returns_tool_calls(api, model):
    llm = chat_model(api, model).bind_tools([Weather, Clock], tool_choice="required", parallel_tool_calls=False)
    answer = llm.invoke(QUESTION)
    assert len(answer.tool_calls) == 1 and answer.tool_calls[0]["name"] in ("Weather", "Clock")
    bound = {"Weather": Weather, "Clock": Clock}
    for call in answer.tool_calls:
        bound[call["name"]].model_validate(call["args"])  # LangChain parsed the arguments into a dict
        assert call["id"].startswith("call_")
    chunks = list(llm.stream(QUESTION))
    streamed = sum(chunks[1:], chunks[0])
    assert isinstance(streamed, AIMessageChunk) and len(chunks) > 2
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(c["name"], c["args"]) for c in answer.tool_calls]


@pytest.mark.parametrize("model", MODELS)
def test_langchain_structured_output_by_function_calling(api, model):
    structured = chat_model(api, model).with_structured_output(Person, method="function_calling")
    person = structured.invoke("Ada is 36 and lives at 12 Main Street. Describe her.")
    assert isinstance(person, Person)  # nested model included: parsed and validated by LangChain


@pytest.mark.parametrize("model", MODELS)
def test_instructor_tools_mode_returns_the_model(client, model):
    patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    person = patched.chat.completions.create(
        model=model, response_model=Person, max_retries=0, max_tokens=MAX_TOKENS, temperature=0,
        messages=[{"role": "user", "content": "Ada is 36 and lives at 12 Main Street. Describe her."}])
    assert isinstance(person, Person)
