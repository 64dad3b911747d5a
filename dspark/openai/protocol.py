"""OpenAI's request and response shapes for completions and chat completions, and their
translation to the inputs of dspark's `speculative` backend (Triton's LLM-backend convention).

Pure: no Triton, no HTTP. Requests are pydantic models; a field OpenAI defines that dspark does
not implement is refused by name (400) rather than silently ignored, except the few whose default
value changes nothing (``n: 1``, ``presence_penalty: 0``, ``user``...).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dspark.errors import RequestError, field_path
from dspark.openai import tools as toolcalls

# Used when a request gives no max_tokens (OpenAI's own default is "up to the context").
DEFAULT_MAX_TOKENS = 256
MAX_STOP_SEQUENCES = 4  # as OpenAI
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI
MAX_COMPLETION_LOGPROBS = 5  # legacy completions' logprobs, as OpenAI


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
             429: "rate_limit_error", 503: "server_error", 500: "server_error"}

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def from_validation_error(error: ValidationError) -> OpenAIError:
    first = error.errors()[0]
    param = field_path(first["loc"]) or None
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = "is not supported by this server"
    return OpenAIError(400, f"{param}: {message}" if param else message, param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Optional[str] = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: Optional[bool] = None  # the output always follows the schema (docs/openai.md)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema' and only with it")
        return self

    def guided(self) -> Optional[dict]:
        """The backend's ``guided`` constraint (dspark.decoding.constraint.Guided)."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            return {"json_schema": self.json_schema.schema_}
        return None


class _Request(BaseModel):
    """The fields completions and chat completions share."""
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)  # OpenAI's default
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: Optional[int] = Field(None, ge=0)
    stop: Union[str, list[str], None] = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Literal[0, 0.0] = 0
    frequency_penalty: Literal[0, 0.0] = 0
    user: Optional[str] = None  # accepted, not used
    response_format: Optional[ResponseFormat] = None
    # dspark's extension: how the request speculates ({"method": "suffix", ...}), as in
    # sampling_parameters.speculative of Triton's generate endpoint
    speculative: Optional[dict[str, Any]] = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(not s for s in stops):
            raise ValueError("a stop sequence must not be empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _token_limit(self) -> int:
        return self.max_tokens or DEFAULT_MAX_TOKENS

    def _top_logprobs(self) -> Optional[int]:
        return None

    def sampling_parameters(self) -> dict:
        """sampling_parameters of the speculative backend (it validates them once more)."""
        params: dict[str, Any] = {"max_tokens": self._token_limit(), "temperature": self.temperature,
                                  "top_p": self.top_p, "stop": self.stop}
        if self.seed is not None:
            params["seed"] = self.seed
        if self._top_logprobs() is not None:
            params["logprobs"] = self._top_logprobs()
        if self.speculative is not None:
            params["speculative"] = self.speculative
        if self.response_format is not None and (guided := self.response_format.guided()):
            params["guided"] = guided
        return params


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[ContentPart], None] = None  # None: an assistant's message of calls only
    name: Optional[str] = None  # accepted, not used
    tool_calls: Optional[list[toolcalls.ToolCall]] = None  # an assistant's calls
    tool_call_id: Optional[str] = None  # a tool message: the call it answers

    def as_backend(self) -> dict:
        text = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(p.text for p in self.content)
        # "developer" is OpenAI's newer name for the system role
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return message


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)  # OpenAI's newer name of max_tokens
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[list[toolcalls.Tool]] = None
    tool_choice: Optional[toolcalls.ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None  # None: OpenAI's default, true

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value, info):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return value

    def _token_limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS

    def _top_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_mode(self) -> str:
        """What the reply may do with the tools: "none", "auto", "required" or "named"."""
        return toolcalls.choice_mode(self.tool_choice, self.tools)

    def call_parser(self) -> Optional[toolcalls.ToolCallParser]:
        """The parser of the reply's tool calls; None when no tools are offered."""
        return None if self.tool_mode == "none" else toolcalls.ToolCallParser()

    def _check_tools(self) -> None:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise OpenAIError(400, "tools: two functions have the same name", "tools")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise OpenAIError(400, "tool_choice: is only allowed when tools are given", "tool_choice")
        if isinstance(self.tool_choice, toolcalls.NamedToolChoice) and self.tool_choice.function.name not in names:
            raise OpenAIError(400, f"tool_choice: no function named {self.tool_choice.function.name!r} "
                                   "in tools", "tool_choice.function.name")
        called: set[str] = set()
        for i, message in enumerate(self.messages):
            if message.content is None and not (message.role == "assistant" and message.tool_calls):
                raise OpenAIError(400, f"messages[{i}].content: is required (only an assistant message "
                                       "with tool_calls may have none)", f"messages[{i}].content")
            if message.tool_calls and message.role != "assistant":
                raise OpenAIError(400, f"messages[{i}].tool_calls: only an assistant message has tool calls",
                                  f"messages[{i}].tool_calls")
            called.update(c.id for c in message.tool_calls or [])
            if message.role == "tool" and message.tool_call_id not in called:
                raise OpenAIError(400, f"messages[{i}].tool_call_id: a tool message answers a call of an "
                                       "earlier assistant message: give that call's id",
                                  f"messages[{i}].tool_call_id")

    def sampling_parameters(self) -> dict:
        params = super().sampling_parameters()
        if self.tool_mode != "none":  # the reply's calls follow the functions' schemas
            text = params.pop("guided", None)  # response_format's: a reply that does not call
            params["guided"] = {"grammar": toolcalls.call_grammar(
                toolcalls.offered(self.tools, self.tool_choice), self.tool_mode,
                self.parallel_tool_calls is not False, text)}
        return params

    def backend_inputs(self) -> dict[str, Any]:
        self._check_tools()
        mode = self.tool_mode
        messages = toolcalls.render_messages([m.as_backend() for m in self.messages],
                                         toolcalls.offered(self.tools or [], self.tool_choice), mode,
                                         self.parallel_tool_calls is not False)
        return {"messages": json.dumps(messages), "sampling_parameters": json.dumps(self.sampling_parameters())}


class CompletionRequest(_Request):
    prompt: Union[str, list[str]]
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    def _top_logprobs(self) -> Optional[int]:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError("give one prompt (a string, or a list of one string)")
            value = value[0]
        if not value:
            raise ValueError("is empty; give a prompt")
        return value

    def backend_inputs(self) -> dict[str, Any]:
        return {"text_input": self.prompt, "exclude_input_in_output": True,
                "sampling_parameters": json.dumps(self.sampling_parameters())}


def parse(kind: type[_Request], body: Any) -> _Request:
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    try:
        return kind.model_validate(body)
    except ValidationError as error:
        raise from_validation_error(error) from None


FINISH_REASONS = {"length": "length", "eos": "stop", "stop": "stop"}


def finish_reason(backend_reason: str) -> str:
    return FINISH_REASONS.get(backend_reason, "stop")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Reply:
    """Builds the response objects of one request (ids and timestamps shared by its chunks)."""

    def __init__(self, request: _Request):
        self.chat = isinstance(request, ChatCompletionRequest)
        self.model = request.model
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"
        self._text_event: Optional[tuple[bytes, bytes]] = None
        self._offset = 0  # legacy completions' text_offset of the next token

    def logprobs(self, entries: Optional[list[dict]]) -> Optional[dict]:
        """A choice's ``logprobs`` from the backend's entries (None: not asked for): chat's
        ``{content: [{token, logprob, bytes, top_logprobs}]}``, or legacy completions'
        ``{tokens, token_logprobs, top_logprobs, text_offset}``."""
        if entries is None:
            return None
        if self.chat:
            def one(e):
                return {"token": e["text"], "logprob": e["logprob"], "bytes": e["bytes"]}
            return {"content": [{**one(e), "top_logprobs": [one(t) for t in e["top_logprobs"]]}
                                for e in entries]}
        offsets = []
        for e in entries:
            offsets.append(self._offset)
            self._offset += len(e["text"])
        return {"tokens": [e["text"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["text"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}

    def skip(self, text: str) -> None:
        """Text before the completion's tokens (an echoed prompt) counts in text_offset."""
        self._offset += len(text)

    def _head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def whole(self, text: str, reason: str, counts: dict, message: Optional[dict] = None,
              logprobs: Optional[dict] = None) -> dict:
        """``message``: the chat reply's message when it is not just ``text`` (tool calls)."""
        if self.chat:
            choice = {"index": 0, "message": message or {"role": "assistant", "content": text},
                      "finish_reason": reason, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}
        return {**self._head(self.object), "choices": [choice], "usage": counts}

    def chunk(self, text: Optional[str], reason: Optional[str] = None, first: bool = False,
              logprobs: Optional[dict] = None) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant", "content": text or ""} if first else \
                ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
        return {**self._head("text_completion"), "choices": [choice]}

    def delta_chunk(self, delta: dict, reason: Optional[str] = None) -> dict:
        """A chat chunk of any ``delta`` (a tool call's start or arguments)."""
        choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def text_event(self, text: str) -> bytes:
        """``sse(self.chunk(text))`` for a chunk of text, the one event sent per streamed piece:
        built from a template made once per reply, so only the text is JSON-encoded each time."""
        if self._text_event is None:
            marker = "\x00"
            head, _, tail = sse(self.chunk(marker)).rpartition(json.dumps(marker).encode())  # the text is last
            self._text_event = (head, tail)
        head, tail = self._text_event
        return head + json.dumps(text).encode() + tail

    def usage_chunk(self, counts: dict) -> dict:
        name = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(name), "choices": [], "usage": counts}


def sse(data: Union[dict, str]) -> bytes:
    """One server-sent event as OpenAI streams them: ``data: <json>`` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse("[DONE]")


def backend_error(message: str) -> OpenAIError:
    """A generation error the speculative backend returned, in OpenAI's terms. Triton's generate
    endpoints pass on only the message, so the status follows dspark's own messages:
    "busy: ..." (its request pool is full) is 429, a shut-down or unloading model 503, an
    unexpected failure ("generation failed: ...") 500, anything else a bad request naming the
    field before its first colon."""
    if message.startswith("busy:"):
        return OpenAIError(429, message, code="model_busy")
    if "shutting down" in message or "is unloading" in message or "not ready" in message:
        return OpenAIError(503, message, code="model_unavailable")
    if message.startswith("generation failed"):
        return OpenAIError(500, message)
    field, _, rest = message.partition(":")
    param = field if rest and " " not in field.strip() else None
    if param and param.startswith("guided"):  # the backend's name for the constraint
        param = "response_format"
    return OpenAIError(400, message, param)


def request_error(error: RequestError) -> OpenAIError:
    return OpenAIError(400, str(error), error.field or None)
