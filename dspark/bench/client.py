"""How a load generator talks to Triton: HTTP, gRPC, and gRPC streaming, all asyncio, one
``send`` per request that returns a Record (times, error kind, streamed response times).

HTTP and unary gRPC use tritonclient's aio clients. Streaming builds ModelInferRequest protos
once per input set and drives Triton's ModelStreamInfer on its own channel: tritonclient's aio
``stream_infer`` cannot ask for the empty final response that marks the end of a decoupled
model's answer (``triton_enable_empty_final_response``), which time-to-first-token and
inter-token latency need.
"""
from __future__ import annotations

import asyncio
import itertools
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

    model: str
    scheduled: float         # when the load generator meant to send it
    sent: float
    done: float = 0.0
    error: str | None = None  # error kind; None when answered
    first: float | None = None  # first response carrying outputs (streaming)
    gaps: list[float] = field(default_factory=list)  # between responses carrying outputs (streaming)
    last: float | None = None   # the latest response carrying outputs (streaming)

    @property
    def latency(self) -> float:
        return self.done - self.sent


def error_kind(error: BaseException) -> str:
    """A short, stable label: the Triton/gRPC status name, an HTTP status, timeout or connection."""
    if isinstance(error, asyncio.TimeoutError):
        return "timeout"
    status = getattr(error, "status", None)
    status = status() if callable(status) else status
    if status:
        text = str(status).replace("StatusCode.", "")
        return {"400": "INVALID_ARG", "INVALID_ARGUMENT": "INVALID_ARG", "503": "UNAVAILABLE", "500": "INTERNAL",
                "404": "NOT_FOUND", "499": "CANCELLED", "429": "UNAVAILABLE", "504": "DEADLINE_EXCEEDED"}.get(text, text)
    message = str(error).lower()
    if getattr(error, "kind", None):
        status_words = [k for w, k in (("unavailable", "UNAVAILABLE"), ("invalid", "INVALID_ARG")) if w in message]
        return status_words[0] if status_words else error.kind
    for word, kind in (("unavailable", "UNAVAILABLE"), ("invalid", "INVALID_ARG"), ("timed out", "timeout"),
                       ("timeout", "timeout"), ("deadline", "DEADLINE_EXCEEDED"), ("cancel", "CANCELLED")):
        if word in message:
            return kind
    if isinstance(error, (ConnectionError, OSError)) or "connect" in message:
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

    def prepare(self, info: ModelInfo, arrays: dict[str, np.ndarray]) -> Any:
        """What ``send`` needs for one input set, built once and reused."""
        raise NotImplementedError

    async def send(self, model: str, prepared: Any, scheduled: float) -> Record:
        record = Record(model, scheduled, time.perf_counter())
        try:
            await asyncio.wait_for(self._infer(model, prepared, record), self.timeout_s)
        except Exception as error:  # counted by kind; the load goes on
            record.error = error_kind(error)
        record.done = time.perf_counter()
        return record

    async def _infer(self, model: str, prepared: Any, record: Record) -> None:
        raise NotImplementedError


class HttpTransport(Transport):
    protocol = "http"

    async def open(self, max_inflight: int) -> None:
        import tritonclient.http.aio as client

        self.module = client
        self.client = client.InferenceServerClient(self.url, conn_limit=max(1, max_inflight))

    async def close(self) -> None:
        await self.client.close()

    async def model_config(self, model: str) -> dict:
        return await self.client.get_model_config(model, headers=self.headers)

    def prepare(self, info: ModelInfo, arrays: dict[str, np.ndarray]) -> Any:
        tensors = []
        for spec in info.inputs:
            if spec.name in arrays:
                tensor = self.module.InferInput(spec.name, list(arrays[spec.name].shape), spec.wire_type)
                tensor.set_data_from_numpy(arrays[spec.name], binary_data=True)
                tensors.append(tensor)
        return tensors

    async def _infer(self, model: str, prepared: Any, record: Record) -> None:
        await self.client.infer(model, prepared, headers=self.headers)


class GrpcTransport(Transport):
    protocol = "grpc"

    async def open(self, max_inflight: int) -> None:
        import tritonclient.grpc.aio as client

        self.module = client
        self.client = client.InferenceServerClient(self.url)

    async def close(self) -> None:
        await self.client.close()

    async def model_config(self, model: str) -> dict:
        return (await self.client.get_model_config(model, headers=self.headers, as_json=True))["config"]

    def prepare(self, info: ModelInfo, arrays: dict[str, np.ndarray]) -> Any:
        tensors = []
        for spec in info.inputs:
            if spec.name in arrays:
                tensor = self.module.InferInput(spec.name, list(arrays[spec.name].shape), spec.wire_type)
                tensor.set_data_from_numpy(arrays[spec.name])
                tensors.append(tensor)
        return tensors

    async def _infer(self, model: str, prepared: Any, record: Record) -> None:
        await self.client.infer(model, prepared, headers=self.headers)


class _Lane:
    """One ModelStreamInfer call: requests go in through a queue, responses are matched by id."""

    def __init__(self, stub, metadata: Sequence[tuple[str, str]]):
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
            for _, future, _ in self.waiting.values():
                if not future.done():
                    future.set_exception(error)
            self.waiting.clear()

    async def close(self) -> None:
        await self.queue.put(None)
        self.call.cancel()
        self.reader.cancel()


class _StreamError(Exception):
    """An error response on the stream (Triton sends a message without a status code)."""

    kind = "stream_error"


class GrpcStreamTransport(Transport):
    """gRPC bidirectional streaming; for decoupled (generative) models also TTFT and inter-token
    latency (between responses that carry outputs)."""

    protocol = "grpc-stream"

    async def open(self, max_inflight: int) -> None:
        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        self.pb = service_pb2
        self.channel = grpc.aio.insecure_channel(self.url, options=[
            ("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1)])
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        metadata = list(self.headers.items())
        self.lanes = [_Lane(self.stub, metadata) for _ in range(max(1, min(16, max_inflight)))]
        self.next_lane = itertools.cycle(self.lanes)
        self.ids = itertools.count()
        self.decoupled: dict[str, bool] = {}

    async def close(self) -> None:
        for lane in self.lanes:
            await lane.close()
        await self.channel.close()

    async def model_config(self, model: str) -> dict:
        from google.protobuf import json_format

        response = await self.stub.ModelConfig(self.pb.ModelConfigRequest(name=model),
                                               metadata=list(self.headers.items()) or None)
        return json_format.MessageToDict(response, preserving_proto_field_name=True)["config"]

    def prepare(self, info: ModelInfo, arrays: dict[str, np.ndarray]) -> Any:
        from tritonclient.utils import serialize_byte_tensor

        self.decoupled[info.name] = info.decoupled
        request = self.pb.ModelInferRequest(model_name=info.name)
        for spec in info.inputs:
            if spec.name not in arrays:
                continue
            array = arrays[spec.name]
            request.inputs.add(name=spec.name, datatype=spec.wire_type, shape=list(array.shape))
            if spec.wire_type == "BYTES":
                serialized = serialize_byte_tensor(array)
                raw = serialized.item() if serialized.size else b""
            else:
                raw = np.ascontiguousarray(array).tobytes()
            request.raw_input_contents.append(raw)
        if info.decoupled:
            request.parameters["triton_enable_empty_final_response"].bool_param = True
        return request

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
