"""How a load generator talks to Triton: HTTP, gRPC, and gRPC streaming, all asyncio, one
``send`` per request that returns a Record (times, error kind, streamed response times).

The client's own cost per request is what a load generator on a small machine must keep down
(it shares the cores with the server): each transport builds a request once per input set and
replays its bytes. HTTP speaks KServe v2 with the binary-tensor extension over keep-alive
connections (asyncio streams, one connection per request in flight); gRPC calls Triton's
ModelInfer / ModelStreamInfer with prebuilt protos on one channel. Measured per request on the
2-core dev VM: ~0.15 ms of client CPU for HTTP, against ~0.8 ms through tritonclient's aio
client and ~0.45 ms through its sync client; gRPC costs 0.4-0.6 ms in grpcio however it is called. Streaming also asks for the empty final response
that marks the end of a decoupled model's answer (``triton_enable_empty_final_response``, which
tritonclient's aio ``stream_infer`` cannot set), for time to first token and inter-token latency.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from dspark.bench.inputs import ModelInfo
from dspark.errors import ConfigError

PROTOCOLS = ("http", "grpc", "grpc-stream")


@dataclass
class Record:
    """One request as the client saw it. Times are time.perf_counter() seconds."""

    target: str              # the model, or the label of its traffic class (a tier, say)
    scheduled: float         # when the load generator meant to send it
    sent: float
    done: float = 0.0
    error: str | None = None  # error kind; None when answered
    detail: str | None = None  # the error's message (the first 300 characters)
    first: float | None = None  # first response carrying outputs (streaming)
    gaps: list[float] = field(default_factory=list)  # between responses carrying outputs (streaming)
    last: float | None = None   # the latest response carrying outputs (streaming)
    kept: list[bytes] = field(default_factory=list)  # the kept output of each response (streaming, ``keep``)

    @property
    def latency(self) -> float:
        return self.done - self.sent


def error_kind(error: BaseException) -> str:
    """A short, stable label: the gRPC status or Triton's name for the HTTP status, ``timeout``
    (the client's), ``connection``, or an error response on a stream."""
    if isinstance(error, asyncio.TimeoutError):
        return "timeout"
    if isinstance(error, _StreamError):  # Triton sends no status code on a stream: read the message
        message = str(error).lower()
        return next((kind for word, kind in (("unavailable", "UNAVAILABLE"), ("invalid", "INVALID_ARG"))
                     if word in message), error.kind)
    if isinstance(error, (HttpError, GrpcError)):
        return error.kind
    if isinstance(error, (ConnectionError, OSError, asyncio.IncompleteReadError)):
        return "connection"
    return type(error).__name__


class Transport:
    """One protocol's connection(s) to the server; ``send`` never raises for a failed request."""

    protocol = ""

    def __init__(self, url: str, timeout_s: float, headers: dict[str, str] | None = None):
        self.url, self.timeout_s, self.headers = url, timeout_s, headers or {}

    async def open(self, max_inflight: int) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def model_config(self, model: str) -> dict:
        raise NotImplementedError

    def prepare(self, info: ModelInfo, arrays: dict[str, np.ndarray], parameters: dict | None = None) -> Any:
        """What ``send`` needs for one input set (and request parameters), built once and reused."""
        raise NotImplementedError

    async def send(self, target: str, model: str, prepared: Any, scheduled: float) -> Record:
        record = Record(target, scheduled, time.perf_counter())
        try:
            await asyncio.wait_for(self._infer(model, prepared, record), self.timeout_s)
        except Exception as error:  # counted by kind; the load goes on
            record.error, record.detail = error_kind(error), str(error)[:300]
        record.done = time.perf_counter()
        return record

    async def _infer(self, model: str, prepared: Any, record: Record) -> None:
        raise NotImplementedError


def _raw_bytes(array: np.ndarray, wire_type: str) -> bytes:
    """A tensor's bytes as both protocols carry them (BYTES: 4-byte little-endian length prefixes)."""
    if wire_type == "BYTES":
        from tritonclient.utils import serialize_byte_tensor

        serialized = serialize_byte_tensor(array)
        return serialized.item() if serialized.size else b""
    return np.ascontiguousarray(array).tobytes()


HTTP_STATUS_KIND = {400: "INVALID_ARG", 404: "NOT_FOUND", 499: "CANCELLED", 500: "INTERNAL", 503: "UNAVAILABLE",
                    429: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.kind = HTTP_STATUS_KIND.get(status, f"HTTP_{status}")


class HttpTransport(Transport):
    """KServe v2 over HTTP/1.1 keep-alive, the request bytes built once per input set."""

    protocol = "http"

    async def open(self, max_inflight: int) -> None:
        host, _, port = self.url.rpartition(":")
        self.host, self.port = host.strip("[]") or "127.0.0.1", int(port)
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()

    async def model_config(self, model: str) -> dict:
        status, body = await self._exchange(self._head("GET", f"/v2/models/{model}/config", {}, 0))
        if status != 200:
            raise HttpError(status, _error_text(body))
        return json.loads(body)

    def _head(self, method: str, path: str, headers: dict[str, str], length: int) -> bytes:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.url}", f"Content-Length: {length}",
                 *(f"{k}: {v}" for k, v in {**self.headers, **headers}.items())]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    def prepare(self, info: ModelInfo, arrays: dict[str, np.ndarray], parameters: dict | None = None) -> Any:
        tensors, blobs = [], []
        for spec in info.inputs:
            if spec.name in arrays:
                raw = _raw_bytes(arrays[spec.name], spec.wire_type)
                tensors.append({"name": spec.name, "shape": list(arrays[spec.name].shape), "datatype": spec.wire_type,
                                "parameters": {"binary_data_size": len(raw)}})
                blobs.append(raw)
        header = json.dumps({"inputs": tensors, "parameters": {**(parameters or {}), "binary_data_output": True}}).encode()
        body = header + b"".join(blobs)
        return self._head("POST", f"/v2/models/{info.name}/infer",
                          {"Inference-Header-Content-Length": str(len(header)),
                           "Content-Type": "application/octet-stream"}, len(body)) + body

    async def _exchange(self, request: bytes) -> tuple[int, bytes]:
        reader, writer = self.idle.pop() if self.idle else await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            if "content-length" in fields:
                body = await reader.readexactly(int(fields["content-length"]))
            elif fields.get("transfer-encoding", "").lower() == "chunked":
                body = await _read_chunked(reader)
            else:
                body = await reader.read()
        except BaseException:
            writer.close()
            raise
        if fields.get("connection", "").lower() == "close":
            writer.close()
        else:
            self.idle.append((reader, writer))
        return status, body

    async def _infer(self, model: str, prepared: Any, record: Record) -> None:
        status, body = await self._exchange(prepared)
        if status != 200:
            raise HttpError(status, _error_text(body))


def _error_text(body: bytes) -> str:
    try:
        return json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


class GrpcTransport(Transport):
    """Triton's gRPC service with prebuilt ModelInferRequest protos on one channel."""

    protocol = "grpc"

    async def open(self, max_inflight: int) -> None:
        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        self.pb = service_pb2
        self.rpc_error = grpc.aio.AioRpcError
        self.channel = grpc.aio.insecure_channel(self.url, options=[
            ("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1)])
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.metadata = list(self.headers.items()) or None
        self.decoupled: dict[str, bool] = {}

    async def close(self) -> None:
        await self.channel.close()

    async def model_config(self, model: str) -> dict:
        from google.protobuf import json_format

        response = await self.stub.ModelConfig(self.pb.ModelConfigRequest(name=model), metadata=self.metadata)
        return json_format.MessageToDict(response, preserving_proto_field_name=True)["config"]

    def prepare(self, info: ModelInfo, arrays: dict[str, np.ndarray], parameters: dict | None = None) -> Any:
        self.decoupled[info.name] = info.decoupled
        request = self.pb.ModelInferRequest(model_name=info.name)
        for key, value in (parameters or {}).items():
            field = ("bool_param" if isinstance(value, bool) else "int64_param" if isinstance(value, int)
                     else "double_param" if isinstance(value, float) else "string_param")
            setattr(request.parameters[key], field, value if field != "string_param" else str(value))
        for spec in info.inputs:
            if spec.name in arrays:
                request.inputs.add(name=spec.name, datatype=spec.wire_type, shape=list(arrays[spec.name].shape))
                request.raw_input_contents.append(_raw_bytes(arrays[spec.name], spec.wire_type))
        if info.decoupled:
            request.parameters["triton_enable_empty_final_response"].bool_param = True
        return request

    async def _infer(self, model: str, prepared: Any, record: Record) -> None:
        try:
            await self.stub.ModelInfer(prepared, metadata=self.metadata)
        except self.rpc_error as error:
            raise GrpcError(error.code().name, error.details()) from None


class GrpcError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.kind = {"INVALID_ARGUMENT": "INVALID_ARG"}.get(code, code)


class _Lane:
    """One ModelStreamInfer call: requests go in through a queue, responses are matched by id."""

    def __init__(self, stub, metadata: Sequence[tuple[str, str]], keep: str | None = None):
        self.keep = keep
        self.queue: asyncio.Queue = asyncio.Queue()
        self.waiting: dict[str, tuple[Record, asyncio.Future, bool]] = {}
        self.call = stub.ModelStreamInfer(self._requests(), metadata=metadata or None)
        self.reader = asyncio.ensure_future(self._read())

    async def _requests(self):
        while True:
            request = await self.queue.get()
            if request is None:
                return
            yield request

    async def _read(self) -> None:
        try:
            async for response in self.call:
                inner = response.infer_response
                entry = self.waiting.get(inner.id)
                if entry is None:
                    continue
                record, future, decoupled = entry
                if response.error_message:
                    self.waiting.pop(inner.id)
                    if not future.done():
                        future.set_exception(_StreamError(response.error_message))
                    continue
                now = time.perf_counter()
                if inner.outputs:
                    if self.keep:
                        record.kept += _kept_output(inner, self.keep)
                    if record.first is None:
                        record.first = now
                    else:
                        record.gaps.append(now - record.last)
                    record.last = now
                final = inner.parameters["triton_final_response"].bool_param if decoupled else True
                if final:
                    self.waiting.pop(inner.id)
                    if not future.done():
                        future.set_result(None)
        except Exception as error:  # the stream broke: fail everything still waiting on it
            self._fail_waiting(error)

    def _fail_waiting(self, error: Exception) -> None:
        for _, future, _ in self.waiting.values():
            if not future.done():
                future.set_exception(error)
        self.waiting.clear()

    async def close(self, timeout_s: float = 5.0) -> None:
        """End the call. With nothing in flight, half-close it and let the server end it: Triton
        2.51 keeps a stream's first request, and with it the model (which then never unloads), when
        the client cancels just as that request's final response is being written (docs/speculative.md,
        "Why an unload hung"). Requests still in flight, or a call the server has not ended in ``timeout_s``, are
        cancelled."""
        await self.queue.put(None)
        if not self.waiting:
            await asyncio.wait({self.reader}, timeout=timeout_s)
        self.call.cancel()
        self.reader.cancel()
        # the cancelled call ends the reader without an exception it catches: end their waits here
        self._fail_waiting(GrpcError("CANCELLED", "the stream was closed with the request in flight"))


def _kept_output(response, name: str) -> list[bytes]:
    """The elements of the BYTES output ``name`` of a ModelInferResponse (none if it lacks it)."""
    from tritonclient.utils import deserialize_bytes_tensor

    for index, output in enumerate(response.outputs):
        if output.name == name and index < len(response.raw_output_contents):
            return list(deserialize_bytes_tensor(response.raw_output_contents[index]))
    return []


class _StreamError(Exception):
    """An error response on the stream (Triton sends a message without a status code)."""

    kind = "stream_error"


class GrpcStreamTransport(GrpcTransport):
    """gRPC bidirectional streaming; for decoupled (generative) models also TTFT and inter-token
    latency (between responses that carry outputs). ``keep``: a BYTES output whose elements each
    response adds to ``Record.kept`` (a generative model's text, to check it)."""

    protocol = "grpc-stream"

    def __init__(self, url: str, timeout_s: float, headers: dict[str, str] | None = None, keep: str | None = None):
        super().__init__(url, timeout_s, headers)
        self.keep = keep

    async def open(self, max_inflight: int) -> None:
        await super().open(max_inflight)
        self.lanes = [_Lane(self.stub, self.metadata or (), self.keep) for _ in range(max(1, min(16, max_inflight)))]
        self.next_lane = itertools.cycle(self.lanes)
        self.ids = itertools.count()

    async def close(self) -> None:
        for lane in self.lanes:
            await lane.close()
        await super().close()

    async def _infer(self, model: str, prepared: Any, record: Record) -> None:
        request = self.pb.ModelInferRequest()
        request.CopyFrom(prepared)
        request.id = str(next(self.ids))
        lane = next(self.next_lane)
        future = asyncio.get_running_loop().create_future()
        lane.waiting[request.id] = (record, future, self.decoupled.get(model, False))
        await lane.queue.put(request)
        try:
            await future
        finally:
            lane.waiting.pop(request.id, None)


def make_transport(protocol: str, url: str, timeout_s: float = 60.0,
                   headers: dict[str, str] | None = None) -> Transport:
    classes = {"http": HttpTransport, "grpc": GrpcTransport, "grpc-stream": GrpcStreamTransport}
    if protocol not in classes:
        raise ConfigError("protocol", f"{protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    return classes[protocol](url, timeout_s, headers)
