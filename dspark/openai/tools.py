"""OpenAI tool calls (function calling) over models whose chat template knows no tools.

Three parts, all pure:

* the request shapes: ``tools``, ``tool_choice``, and the tool calls of an assistant message;
* the prompt: the functions are listed in a system-message block with the exact call format,
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; an assistant turn's earlier calls
  are written back in that format and each role ``tool`` message becomes a ``<tool_response>``
  block in a user turn (:func:`render_messages`);
* the constraint: a Lark grammar for ``sampling_parameters.guided`` whose calls are each
  function's JSON schema (``%json``), so a call is always well formed and its arguments valid
  (:func:`call_grammar`), and the parser that turns the model's text back into ``tool_calls``,
  piece by piece as it streams (:class:`ToolCallParser`).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from dspark.decoding.constraint import JSON_STYLE, closed_objects

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
CALL_SEPARATOR = "\n"  # between two parallel calls


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: Optional[str] = None
    # a JSON Schema of the arguments object; omitted: the function takes no arguments
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: Optional[bool] = None  # accepted: the arguments always follow the schema

    def summary(self) -> dict:
        entry: dict[str, Any] = {"name": self.name}
        if self.description:
            entry["description"] = self.description
        entry["parameters"] = self.parameters
        return entry


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCall(BaseModel):
    """One call in an assistant message of the conversation so far."""
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def choice_mode(choice: Optional[ToolChoice], tools: Optional[list[Tool]]) -> str:
    """"none", "auto", "required" or "named": what the reply may do. OpenAI's default is "auto"
    with tools and "none" without."""
    if not tools:
        return "none"
    if choice is None:
        return "auto"
    return "named" if isinstance(choice, NamedToolChoice) else choice


def offered(tools: list[Tool], choice: Optional[ToolChoice]) -> list[FunctionDefinition]:
    """The functions the model may call: all of them, or only the one a named choice names."""
    functions = [t.function for t in tools]
    if isinstance(choice, NamedToolChoice):
        return [f for f in functions if f.name == choice.function.name]
    return functions


# --- the prompt ----------------------------------------------------------------------------

def tools_prompt(functions: list[FunctionDefinition], mode: str, parallel: bool) -> str:
    """The system-message block that offers ``functions`` and says how to call them."""
    listing = "\n".join(json.dumps(f.summary(), ensure_ascii=False) for f in functions)
    if mode == "named":
        must = f"You must call the function {functions[0].name}."
    elif mode == "required":
        must = "You must call one or more of these functions." if parallel else \
            "You must call one of these functions."
    else:
        must = "Call a function when it helps to answer; otherwise answer in plain text."
    lines = ["# Tools", "", "You can call these functions, described as JSON:", "<tools>", listing,
             "</tools>", "", f"{must} To call a function, reply with only:",
             f'{CALL_OPEN}{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}'
             f"{CALL_CLOSE}"]
    if parallel and mode != "named":
        lines.append("Write one such block per call, one per line.")
    lines.append(f"Each result comes back in a user turn as {RESPONSE_OPEN}<result>{RESPONSE_CLOSE}.")
    return "\n".join(lines)


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it (``arguments``: a JSON object, or its text)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # kept as the string it was
    return CALL_OPEN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + CALL_CLOSE


def render_messages(messages: list[dict], functions: list[FunctionDefinition], mode: str,
                    parallel: bool) -> list[dict]:
    """Chat messages of system/user/assistant roles with string content, which any chat template
    renders. ``messages``: OpenAI's, as dicts (``role``, ``content`` text or None, ``tool_calls``,
    ``tool_call_id``). The tools block joins the first system message (or is one, first); an
    assistant's calls follow its text; consecutive ``tool`` messages make one user turn of
    ``<tool_response>`` blocks."""
    out: list[dict] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            block = f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"
            if out and out[-1].get("tool_responses"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_responses": True})
            continue
        if role == "assistant" and message.get("tool_calls"):
            calls = CALL_SEPARATOR.join(call_text(c["function"]["name"], c["function"]["arguments"])
                                        for c in message["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": role, "content": content})
    for message in out:
        message.pop("tool_responses", None)
    if mode != "none" and functions:
        block = tools_prompt(functions, mode, parallel)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


# --- the constraint ------------------------------------------------------------------------

def call_schema(function: FunctionDefinition) -> dict:
    """The JSON schema of one call, ``{"name": <the name>, "arguments": <its parameters>}``, in
    that order, as the API writes JSON (docs/openai.md, structured output: one line, and an object
    that lists its properties gets no others). The parameters' ``$defs`` move to the root, where
    their ``#/$defs/...`` refs now point."""
    arguments = closed_objects(dict(function.parameters)) or {"type": "object"}
    defs = {key: arguments.pop(key) for key in ("$defs", "definitions") if key in arguments}
    if "type" not in arguments and not any(k in arguments for k in ("$ref", "anyOf", "allOf", "oneOf")):
        arguments["type"] = "object"
    return {"type": "object", "properties": {"name": {"const": function.name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False, **defs,
            "x-guidance": JSON_STYLE}


def call_grammar(functions: list[FunctionDefinition], mode: str, parallel: bool,
                 text: Optional[dict] = None) -> str:
    """An llguidance Lark grammar of the reply: one call (or, with ``parallel``, one or more
    separated by a newline) of the offered functions, each under its schema; with ``mode``
    "auto" a reply without calls instead: plain text (that does not start with ``<``), or, with
    ``text`` (``{"json_schema": ...}`` or ``{"json_object": true}``, what ``response_format``
    asks), that JSON."""
    many = parallel and mode != "named"
    lines = ["start: " + ("calls | text" if mode == "auto" else "calls"),
             "calls: call" + (f" ({json.dumps(CALL_SEPARATOR)} call)*" if many else ""),
             f"call: {json.dumps(CALL_OPEN)} function {json.dumps(CALL_CLOSE)}",
             "function: " + " | ".join(f"function_{i}" for i in range(len(functions)))]
    for i, function in enumerate(functions):
        lines.append(f"function_{i}: %json " + json.dumps(call_schema(function)))
    if mode == "auto" and text:
        schema = dict(text["json_schema"]) if "json_schema" in text else {"type": "object"}
        lines.append("text: %json " + json.dumps({"x-guidance": JSON_STYLE, **closed_objects(schema)}))
    elif mode == "auto":
        lines += ["text: TEXT", r"TEXT: /[^<](?s:.)*/"]
    return "\n".join(lines) + "\n"


# --- the reply -----------------------------------------------------------------------------

def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# after <tool_call>: the call's JSON up to the arguments' value
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_CALL_TAIL = re.compile(r"\s*\}\s*" + re.escape(CALL_CLOSE))


@dataclass
class Delta:
    """What one piece of text adds to the reply: content text, or a call's start (``name``
    with ``id``) or arguments text, for the call at ``index``."""
    content: Optional[str] = None
    index: Optional[int] = None
    id: Optional[str] = None
    name: Optional[str] = None
    arguments: Optional[str] = None


@dataclass
class ToolCallParser:
    """Turns the model's text, fed piece by piece, into content or tool calls. The reply is
    either plain text or calls (the grammar allows nothing else); text that could still be the
    start of ``<tool_call>`` is held until it is or is not. Anything that breaks the call format
    (a reply cut by ``max_tokens`` aside) ends the calls: the rest is content."""
    calls: list[ParsedCall] = field(default_factory=list)
    content: str = ""
    _buffer: str = ""
    _state: str = "start"  # start, text, head, args, tail, between
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False

    def feed(self, text: str) -> list[Delta]:
        self._buffer += text
        deltas: list[Delta] = []
        while self._step(deltas):
            pass
        return deltas

    def finish(self) -> list[Delta]:
        """The text still held, as content (a call cut short stays as far as it got)."""
        deltas: list[Delta] = []
        if self._state in ("start", "text") and self._buffer:
            deltas.append(self._text(self._buffer))
            self._buffer = ""
        return deltas

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def _text(self, text: str) -> Delta:
        self._state = "text"
        self.content += text
        return Delta(content=text)

    def _step(self, deltas: list[Delta]) -> bool:
        """Consumes what it can of the buffer; False when it needs more text."""
        buf, state = self._buffer, self._state
        if not buf:
            return False
        if state == "text":
            deltas.append(self._text(buf))
            self._buffer = ""
            return False
        if state in ("start", "between"):
            if state == "between" and buf.startswith(CALL_SEPARATOR):
                buf = buf[len(CALL_SEPARATOR):]
                if not buf:
                    return False
            if buf.startswith(CALL_OPEN):
                self._buffer, self._state = buf[len(CALL_OPEN):], "head"
                return True
            if CALL_OPEN.startswith(buf):
                return False
            deltas.append(self._text(self._buffer))
            self._buffer = ""
            return False
        if state == "head":
            match = _CALL_HEAD.match(buf)
            if match is None or match.end() == len(buf):  # the value may still be growing whitespace
                if match is None and not _could_be_head(buf):
                    self._buffer, self._state = CALL_OPEN + buf, "text"  # not a call after all
                    return True
                return False
            call = ParsedCall(new_call_id(), json.loads(match.group(1)))
            self.calls.append(call)
            deltas.append(Delta(index=len(self.calls) - 1, id=call.id, name=call.name))
            self._buffer, self._state = buf[match.end():], "args"
            self._depth, self._in_string, self._escape = 0, False, False
            return True
        if state == "args":
            taken = self._scan_arguments(buf)
            call = self.calls[-1]
            if taken:
                piece = buf[:taken]
                call.arguments += piece
                deltas.append(Delta(index=len(self.calls) - 1, arguments=piece))
            self._buffer = buf[taken:]
            if self._depth == 0 and call.arguments:
                call.complete = True
                self._state = "tail"
                return True
            return False
        if state == "tail":
            match = _CALL_TAIL.match(buf)
            if match is not None:
                self._buffer, self._state = buf[match.end():], "between"
                return True
            if not _could_be_tail(buf):
                self._state = "text"
                return True
            return False
        return False

    def _scan_arguments(self, buf: str) -> int:
        """How much of ``buf`` belongs to the arguments' JSON value (an object: up to its
        closing brace)."""
        for i, ch in enumerate(buf):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
            elif self._depth == 0 and not ch.isspace():
                # not an object or array (a schema that allows a scalar): up to the next comma
                # or brace is the value
                end = next((j for j in range(i, len(buf)) if buf[j] in ",}"), None)
                if end is None:
                    return 0
                self._depth = 0
                return end
        return len(buf)


def _could_be_head(buf: str) -> bool:
    """Whether more text could still make ``buf`` (after ``<tool_call>``) a call's head."""
    text = re.sub(r"\s+", "", buf)  # names have no spaces
    lead = '{"name":"'
    if len(text) <= len(lead):
        return lead.startswith(text)
    if not text.startswith(lead):
        return False
    name = re.match(r'"(?:[^"\\]|\\.)*"', text[len(lead) - 1:])
    if name is None:
        return True  # the name is still being written
    rest = text[len(lead) - 1 + name.end():]
    return ',"arguments":'.startswith(rest)


def _could_be_tail(buf: str) -> bool:
    stripped = buf.lstrip()
    if not stripped:
        return True
    if not stripped.startswith("}"):
        return False
    return CALL_CLOSE.startswith(stripped[1:].lstrip()) or stripped[1:].lstrip().startswith(CALL_CLOSE)


def finish_reason(parser: ToolCallParser, backend_reason: str) -> str:
    """"tool_calls" when the reply called and ended by itself; "length" when cut short."""
    if backend_reason == "length":
        return "length"
    return "tool_calls" if parser.called else "stop"


def message(parser: ToolCallParser) -> dict:
    """The assistant message of a whole (not streamed) reply."""
    if parser.called:
        return {"role": "assistant", "content": parser.content or None,
                "tool_calls": [c.as_openai() for c in parser.calls]}
    return {"role": "assistant", "content": parser.content}


def delta_json(delta: Delta) -> dict:
    """A streamed chunk's ``delta`` as OpenAI streams calls: the first chunk of a call has its
    index, id, type and name (arguments ""), the next ones arguments fragments."""
    if delta.content is not None:
        return {"content": delta.content}
    if delta.name is not None:
        call = {"index": delta.index, "id": delta.id, "type": "function",
                "function": {"name": delta.name, "arguments": ""}}
    else:
        call = {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {"tool_calls": [call]}
