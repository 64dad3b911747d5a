"""The OpenAI-compatible HTTP API (Starlette): /v1/models, /v1/completions, /v1/chat/completions,
streamed as server-sent events in OpenAI's chunk format, in front of Triton's LLMs. Plain
Starlette routes, not FastAPI's: pydantic checks the bodies here already, and FastAPI's dependency
solving and extra middleware cost 0.4 of its 1.9 ms of CPU per request."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import re
from typing import Optional, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from dspark.decoding.request import parse_generate_options, parse_messages
from dspark.decoding.sampling import SpeculativeParams
from dspark.errors import RequestError
from dspark.openai import tools
from dspark.openai.protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    Reply,
    TokenizeRequest,
    finish_reason,
    parse,
    request_error,
    sse,
    usage,
)
from dspark.openai.triton import TritonLLMs


def _check_with_backend_rules(inputs: dict) -> None:
    """The speculative backend's own parsers, here, so a bad field is a 400 naming it before
    any call to the server."""
    try:
        parse_generate_options(inputs["sampling_parameters"], SpeculativeParams())
        parse_messages(inputs.get("messages"))
    except RequestError as error:
        raise request_error(error) from None


# a JSON string escape of a UTF-16 surrogate: only then can a decoded body hold a lone one
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_body(raw: bytes):
    """A request body as JSON; any body a client can send that is not usable JSON text is a 400
    (nesting deeper than Python's recursion limit, a lone surrogate such as "\\ud800")."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise OpenAIError(400, "the request body nests too deeply") from None
    except ValueError as error:
        raise OpenAIError(400, f"the request body is not JSON ({error})") from None
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise OpenAIError(400, "the request body holds a lone UTF-16 surrogate (\\ud800-\\udfff "
                                   "not in a pair), which is no character") from None
    return body


async def _disconnected(receive) -> None:
    """Returns once the client has gone (after its body was read, the next ASGI message is the
    disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _first_piece(pieces, guided_by: Optional[str]):
    """The model's first piece; a constraint it cannot compile is named as ``guided_by``, the
    request field it came from (``tools`` for a tool call's grammar)."""
    try:
        return await anext(pieces)
    except OpenAIError as error:
        if guided_by and error.message.startswith("guided"):
            error.param = guided_by
        raise


async def _whole(pieces, guided_by: Optional[str]):
    """The text, final piece and log-probability entries (None: not asked for) of a generation."""
    piece = await _first_piece(pieces, guided_by)
    parts, entries = [], None
    while True:
        parts.append(piece.text)
        if piece.logprobs is not None:
            entries = entries if entries is not None else []
            entries.extend(piece.logprobs)
        if piece.final:
            return "".join(parts), piece, entries
        piece = await anext(pieces, None)
        if piece is None:
            raise OpenAIError(500, "the model ended its stream without a final response")


def create_app(llms: TritonLLMs, api_key: Optional[str] = None, cors_origins: Sequence[str] = ()) -> Starlette:
    """``api_key``: when set, every request needs ``Authorization: Bearer <api_key>`` (but
    GET /health). ``cors_origins``: browser origins allowed to call the API (none by default)."""
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await llms.close()

    def authorized(endpoint):
        # checked in each route, not in an HTTP middleware: Starlette's BaseHTTPMiddleware wraps
        # each (streamed) response in a task and a memory stream, ~20 % of this thread's time
        async def checked(request: Request):
            if api_key is not None:
                scheme, _, given = request.headers.get("authorization", "").partition(" ")
                if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
                    raise OpenAIError(401, "missing or wrong API key: send Authorization: Bearer <key>",
                                      code="invalid_api_key")
            return await endpoint(request)
        return checked

    async def openai_error(_request: Request, error: OpenAIError):
        return JSONResponse(error.body(), status_code=error.status)

    async def http_error(_request: Request, error: HTTPException):  # an unknown path or method
        return JSONResponse(OpenAIError(error.status_code, f"{error.detail}: the API serves GET /v1/models, "
                                        "POST /v1/completions, POST /v1/chat/completions, POST /tokenize, "
                                        "POST /detokenize and GET /health").body(),
                            status_code=error.status_code, headers=error.headers)

    async def unexpected(_request: Request, error: Exception):
        return JSONResponse(OpenAIError(500, f"{type(error).__name__}: {error}").body(), status_code=500)

    async def list_models(_request: Request):
        return JSONResponse({"object": "list", "data": await llms.models()})

    async def get_model(request: Request):
        model = request.path_params["model"]
        await llms.require(model)
        return JSONResponse(next(m for m in await llms.models() if m["id"] == model))

    async def body_of(request: Request):
        return parse_body(await request.body())

    async def health(_request: Request):
        """Liveness and readiness without a key (as vLLM's): 200 once Triton answers ready."""
        if await llms.ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def complete(request: Request, kind):
        req = parse(kind, await body_of(request))
        inputs = req.backend_inputs()
        _check_with_backend_rules(inputs)
        await llms.require(req.model)
        reply = Reply(req)
        echo = req.prompt if isinstance(req, CompletionRequest) and req.echo else ""
        calls = req.call_parser() if isinstance(req, ChatCompletionRequest) else None
        guided_by = "tools" if calls is not None else None
        # streamed from Triton also for one reply: Triton sees a closed connection when it
        # writes the next piece, so a client that went away cancels the model's request
        pieces = llms.generate(req.model, inputs, stream=True)
        if not req.stream:
            work = asyncio.ensure_future(_whole(pieces, guided_by))
            gone = asyncio.ensure_future(_disconnected(request.receive))
            try:
                await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not work.done():  # the client went away: stop the generation
                    work.cancel()
                    with contextlib.suppress(asyncio.CancelledError, OpenAIError):
                        await work
                await pieces.aclose()
            if work.cancelled():
                return JSONResponse({}, status_code=499)  # nobody reads it
            text, piece, entries = work.result()
            counts = usage(piece.prompt_tokens, piece.completion_tokens)
            if calls is not None:
                calls.feed(text)
                calls.finish()
                return JSONResponse(reply.whole(text, tools.finish_reason(calls, piece.finish_reason),
                                                counts, tools.message(calls), reply.logprobs(entries)))
            reply.skip(echo)
            return JSONResponse(reply.whole(echo + text, finish_reason(piece.finish_reason), counts,
                                            logprobs=reply.logprobs(entries)))
        first = await _first_piece(pieces, guided_by)  # an error before any text is still an HTTP error

        def call_events(deltas):  # the chunks of a reply that may call tools
            return [sse(reply.delta_chunk(tools.delta_json(delta))) for delta in deltas]

        async def events():
            piece = first
            try:
                if calls is None:
                    reply.skip(echo)
                    yield sse(reply.chunk(echo + piece.text, first=True, logprobs=reply.logprobs(piece.logprobs)))
                else:
                    yield sse(reply.delta_chunk({"role": "assistant", "content": None}))
                    for event in call_events(calls.feed(piece.text)):
                        yield event
                while not piece.final:
                    piece = await anext(pieces)
                    if piece.logprobs and calls is None:  # each chunk carries its tokens' log-probabilities
                        yield sse(reply.chunk(piece.text, logprobs=reply.logprobs(piece.logprobs)))
                    elif piece.text and calls is None:
                        yield reply.text_event(piece.text)
                    elif piece.text:
                        for event in call_events(calls.feed(piece.text)):
                            yield event
                if calls is None:
                    reason = finish_reason(piece.finish_reason)
                else:
                    for event in call_events(calls.finish()):
                        yield event
                    reason = tools.finish_reason(calls, piece.finish_reason)
                yield sse(reply.chunk(None, reason))
                if req.include_usage:
                    yield sse(reply.usage_chunk(usage(piece.prompt_tokens, piece.completion_tokens)))
                yield SSE_DONE
            except OpenAIError as error:  # after the first event: say so in the stream
                yield sse(error.body())
            finally:
                await pieces.aclose()  # cancels the model's request if it is still running

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def tokenizer(request: Request, kind):
        """The served model's own tokenizer, in its Triton backend: no second copy here."""
        req = parse(kind, await body_of(request))
        inputs = req.backend_inputs()
        await llms.require(req.model)
        pieces = llms.generate(req.model, inputs, stream=False)
        try:
            piece = await anext(pieces)
        finally:
            await pieces.aclose()
        return JSONResponse(json.loads(piece.text))

    async def tokenize(request: Request):
        return await tokenizer(request, TokenizeRequest)

    async def detokenize(request: Request):
        return await tokenizer(request, DetokenizeRequest)

    async def chat_completions(request: Request):
        return await complete(request, ChatCompletionRequest)

    async def completions(request: Request):
        return await complete(request, CompletionRequest)

    routes = [Route("/v1/models", authorized(list_models), methods=["GET"]),
              Route("/v1/models/{model}", authorized(get_model), methods=["GET"]),
              Route("/v1/chat/completions", authorized(chat_completions), methods=["POST"]),
              Route("/v1/completions", authorized(completions), methods=["POST"]),
              Route("/tokenize", authorized(tokenize), methods=["POST"]),
              Route("/detokenize", authorized(detokenize), methods=["POST"]),
              Route("/health", health, methods=["GET"])]
    middleware = []
    if cors_origins:  # pure ASGI; answers preflights itself
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware

        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins),
                                     allow_methods=["GET", "POST"],
                                     allow_headers=["Authorization", "Content-Type"]))
    return Starlette(routes=routes, lifespan=lifespan, middleware=middleware, exception_handlers={
        OpenAIError: openai_error, HTTPException: http_error, Exception: unexpected})
