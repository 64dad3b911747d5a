"""Tool calls: the request shapes, the prompt the functions and earlier calls become, the grammar
that holds a call to its function's schema (checked with llguidance itself, over a byte-level
vocabulary), and the parsing of the model's text into tool_calls, whole and streamed."""
import json

import llguidance
import pytest

from dspark.openai import tools
from dspark.openai.protocol import ChatCompletionRequest, OpenAIError, Reply, parse

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: no arguments
PERSON = {"type": "function", "function": {"name": "person", "parameters": {  # pydantic's shape
    "$defs": {"Address": {"type": "object", "properties": {"street": {"type": "string"}},
                          "required": ["street"]}},
    "type": "object", "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/Address"}},
    "required": ["name", "address"]}}}
USER = {"role": "user", "content": "Weather in Paris?"}


def chat(**fields) -> ChatCompletionRequest:
    return parse(ChatCompletionRequest, {"model": "m", "messages": [USER], **fields})


def inputs(**fields) -> tuple[list[dict], dict]:
    sent = chat(**fields).backend_inputs()
    return json.loads(sent["messages"]), json.loads(sent["sampling_parameters"])


class ByteVocabulary:
    """A vocabulary of the 256 bytes and an end-of-sequence token: any text is its bytes."""
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"</s>"]
    special_token_ids = [256]

    def __call__(self, text):
        return list(text if isinstance(text, bytes) else text.encode())


VOCABULARY = llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteVocabulary()))


def grammar_accepts(grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(VOCABULARY, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    matcher.consume_tokens(list(text.encode()))
    return not matcher.is_error() and matcher.is_accepting()


def call(name, arguments) -> str:
    return tools.call_text(name, arguments)


# --- request shapes and the prompt ----------------------------------------------------------

def test_tools_are_listed_in_a_system_block_with_the_call_format():
    messages, params = inputs(tools=[WEATHER, TIME])
    assert [m["role"] for m in messages] == ["system", "user"]
    block = messages[0]["content"]
    listed = [json.loads(line) for line in block.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()]
    assert listed == [{"name": "get_weather", "description": "The weather in a city",
                       "parameters": WEATHER["function"]["parameters"]},
                      {"name": "get_time", "parameters": {"type": "object", "properties": {}}}]
    assert '<tool_call>{"name": "<function name>", "arguments": ' in block
    assert "otherwise answer in plain text" in block
    assert params["guided"]["grammar"].startswith("start: calls | text")


def test_the_tools_block_joins_the_callers_system_message():
    sent = parse(ChatCompletionRequest, {"model": "m", "tools": [WEATHER], "messages": [
        {"role": "developer", "content": "Be brief."}, USER]}).backend_inputs()
    messages = json.loads(sent["messages"])
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools\n")


def test_tool_choice_none_offers_no_tools_and_no_grammar():
    messages, params = inputs(tools=[WEATHER], tool_choice="none")
    assert messages == [USER] and "guided" not in params
    assert chat(tools=[WEATHER], tool_choice="none").call_parser() is None


def test_a_named_choice_offers_only_that_function_once():
    messages, params = inputs(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                  "function": {"name": "get_time"}})
    assert "You must call the function get_time." in messages[0]["content"]
    assert "get_weather" not in messages[0]["content"] and "get_weather" not in params["guided"]["grammar"]
    grammar = params["guided"]["grammar"]
    assert grammar_accepts(grammar, call("get_time", {}))
    assert not grammar_accepts(grammar, call("get_time", {}) + "\n" + call("get_time", {}))
    assert not grammar_accepts(grammar, "It is noon.")


def test_required_calls_one_or_more_unless_parallel_calls_are_off():
    _, params = inputs(tools=[WEATHER, TIME], tool_choice="required")
    two = call("get_weather", {"city": "Paris"}) + "\n" + call("get_time", {})
    assert grammar_accepts(params["guided"]["grammar"], two)
    assert not grammar_accepts(params["guided"]["grammar"], "Sunny.")
    _, params = inputs(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert grammar_accepts(params["guided"]["grammar"], call("get_time", {}))
    assert not grammar_accepts(params["guided"]["grammar"], two)


def test_auto_allows_plain_text_or_calls():
    _, params = inputs(tools=[WEATHER])
    grammar = params["guided"]["grammar"]
    assert grammar_accepts(grammar, "I cannot tell.\n<tool_call> is not needed")
    assert grammar_accepts(grammar, call("get_weather", {"city": "Paris", "unit": "c"}))
    assert not grammar_accepts(grammar, "<b>bold</b>")  # text starting with "<" would be a call


def test_auto_with_a_response_format_answers_in_that_json_or_in_calls():
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
              "additionalProperties": False}
    _, params = inputs(tools=[WEATHER], response_format={"type": "json_schema", "json_schema": {
        "name": "reply", "schema": schema}})
    grammar = params["guided"]["grammar"]
    assert grammar_accepts(grammar, '{"answer": "sunny"}')
    assert grammar_accepts(grammar, call("get_weather", {"city": "Paris"}))
    assert not grammar_accepts(grammar, "sunny") and not grammar_accepts(grammar, '{"other": 1}')
    _, params = inputs(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    assert not grammar_accepts(params["guided"]["grammar"], '{"answer": "sunny"}')  # calls only


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_weather", "arguments": {"town": "Paris"}}</tool_call>',  # not its schema
    '<tool_call>{"name": "get_weather", "arguments": {"city": 3}}</tool_call>',
    '<tool_call>{"name": "get_wether", "arguments": {"city": "Paris"}}</tool_call>',  # no such function
    '<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}</tool_call>',  # name first
    '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>',  # one spacing only
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}',  # unclosed
])
def test_the_grammar_refuses_calls_off_the_schema(text):
    _, params = inputs(tools=[WEATHER], tool_choice="required")
    assert not grammar_accepts(params["guided"]["grammar"], text)


def test_arguments_get_no_keys_their_schema_does_not_list():
    _, params = inputs(tools=[WEATHER], tool_choice="required")  # WEATHER says nothing of others
    grammar = params["guided"]["grammar"]
    assert grammar_accepts(grammar, call("get_weather", {"city": "Paris", "unit": "c"}))
    assert not grammar_accepts(grammar, call("get_weather", {"city": "Paris", "wind": 3}))


def test_schema_definitions_still_resolve_under_arguments():
    _, params = inputs(tools=[PERSON], tool_choice="required")
    grammar = params["guided"]["grammar"]
    assert grammar_accepts(grammar, call("person", {"name": "Ada", "address": {"street": "Main"}}))
    assert not grammar_accepts(grammar, call("person", {"name": "Ada", "address": {"road": "Main"}}))


def test_earlier_calls_and_tool_results_are_rendered_as_turns():
    history = [USER,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                   {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
               {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]}]
    sent = parse(ChatCompletionRequest, {"model": "m", "messages": history, "tools": [WEATHER, TIME]})
    messages = json.loads(sent.backend_inputs()["messages"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[2]["content"] == (call("get_weather", {"city": "Paris"}) + "\n" + call("get_time", {}))
    assert messages[3]["content"] == ("<tool_response>\n18 C, sunny\n</tool_response>\n"
                                      "<tool_response>\nnoon\n</tool_response>")
    assert all(isinstance(m["content"], str) and set(m) == {"role", "content"} for m in messages)


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "messages": [USER, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
     "messages[1].tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
])
def test_inconsistent_tool_requests_are_refused_naming_the_field(fields, param):
    with pytest.raises(OpenAIError) as error:
        chat(**fields).backend_inputs()
    assert error.value.status == 400 and error.value.param == param


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice"),
    ({"parallel_tool_calls": "maybe"}, "parallel_tool_calls"),
])
def test_malformed_tool_fields_are_refused_naming_the_field(fields, param):
    with pytest.raises(OpenAIError) as error:
        chat(**fields)
    assert error.value.status == 400 and error.value.param.startswith(param)


# --- the reply ------------------------------------------------------------------------------

def parse_whole(text: str) -> tools.ToolCallParser:
    parser = tools.ToolCallParser()
    parser.feed(text)
    parser.finish()
    return parser


def test_calls_become_tool_calls_with_json_arguments():
    text = call("get_weather", {"city": "Paris", "unit": "c"}) + "\n" + call("get_time", {})
    parser = parse_whole(text)
    message = tools.message(parser)
    assert message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
        {"city": "Paris", "unit": "c"}, {}]
    ids = [c["id"] for c in message["tool_calls"]]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert all(c["type"] == "function" for c in message["tool_calls"])
    assert tools.finish_reason(parser, "eos") == "tool_calls"
    assert tools.finish_reason(parser, "length") == "length"


def test_plain_text_stays_content():
    parser = parse_whole("It is sunny in Paris.")
    assert tools.message(parser) == {"role": "assistant", "content": "It is sunny in Paris."}
    assert tools.finish_reason(parser, "eos") == "stop"
    assert tools.message(parse_whole("<")) == {"role": "assistant", "content": "<"}
    assert tools.message(parse_whole("<tool_call>oops")) == {"role": "assistant", "content": "<tool_call>oops"}


def test_arguments_with_braces_and_quotes_in_strings_end_at_their_own_brace():
    arguments = {"city": 'a "}" b {', "nested": {"list": [1, {"x": "]"}]}}
    message = tools.message(parse_whole(call("f", arguments)))
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == arguments


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_streamed_pieces_assemble_to_the_whole_reply(size):
    text = call("get_weather", {"city": "Zürich \\ \"x\""}) + "\n" + call("get_time", {})
    parser = tools.ToolCallParser()
    deltas = [d for i in range(0, len(text), size) for d in parser.feed(text[i:i + size])] + parser.finish()
    calls: dict[int, dict] = {}
    for delta in map(tools.delta_json, deltas):
        assert set(delta) == {"tool_calls"}
        (piece,) = delta["tool_calls"]
        if "id" in piece:  # a call's first chunk has its id, type and name
            assert piece["type"] == "function" and piece["function"]["arguments"] == ""
            calls[piece["index"]] = {"id": piece["id"], "name": piece["function"]["name"], "arguments": ""}
        else:
            assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
            calls[piece["index"]]["arguments"] += piece["function"]["arguments"]
    whole = tools.message(parse_whole(text))["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole]


def test_streamed_text_is_held_only_while_it_could_open_a_call():
    parser = tools.ToolCallParser()
    assert parser.feed("<to") == []  # could be <tool_call>
    assert [d.content for d in parser.feed("ast>")] == ["<toast>"]
    assert [d.content for d in parser.feed(" and jam")] == [" and jam"]
    assert parser.content == "<toast> and jam" and not parser.called


def test_a_reply_cut_short_keeps_the_call_as_far_as_it_got():
    parser = parse_whole('<tool_call>{"name": "get_weather", "arguments": {"city": "Par')
    assert tools.message(parser)["tool_calls"][0]["function"]["arguments"] == '{"city": "Par'
    assert tools.finish_reason(parser, "length") == "length"


def test_whole_and_chunk_shapes():
    reply = Reply(chat(tools=[WEATHER]))
    parser = parse_whole(call("get_weather", {"city": "Paris"}))
    body = reply.whole("ignored", tools.finish_reason(parser, "eos"), {"total_tokens": 1}, tools.message(parser))
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    chunk = reply.delta_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]})
    assert chunk["object"] == "chat.completion.chunk" and chunk["id"] == body["id"]
    assert chunk["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] == "{"
