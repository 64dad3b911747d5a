"""Reproduce Triton 2.51's gRPC stream leak that keeps an unloaded model alive (not part of `make test`).

Each cycle sends a warm-up request on one gRPC stream and ``--requests`` more on ``--concurrency``
streams, waits for every final response, ends the streams, then unloads the model and waits for
its stub to exit (``reload_model``, as ``dspark bench spec`` does between passes). ``--close
cancel`` cancels each stream right after its answers, as a client that calls
``stop_stream(cancel_requests=True)`` or drops its channel does; ``--close half-close`` ends them
the way dspark's clients do. An unload that does not finish in ``--unload-timeout`` seconds is
counted, the server restarted and its log kept (``--log-verbose 1`` shows the stream state that
was cancelled while its final response was being written: docs/speculative.md, "Soak").

    .venv/bin/python tools/stream_cancel_unload.py --close cancel --cycles 30
"""
from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from dspark.bench.client import GrpcStreamTransport
from dspark.bench.inputs import ModelInfo
from dspark.bench.spec_served import reload_model
from dspark.errors import UnavailableError
from dspark.paths import demo_repositories, project_root
from dspark.server.launcher import TritonServer


async def one_pass(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int, cancel: bool) -> None:
    transport = GrpcStreamTransport(url, timeout_s=300, keep="text_output")
    await transport.open(concurrency)
    try:
        info = ModelInfo.from_config(await transport.model_config(model))
        gate = asyncio.Semaphore(concurrency)

        async def one(index: int, prompt: str):
            sampling = {"max_tokens": max_tokens, "temperature": 0.8 if index % 2 else 0.0}
            prepared = transport.prepare(info, {
                "text_input": np.array([prompt.encode()], dtype=np.object_),
                "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=np.object_),
                "stream": np.array([True])})
            async with gate:
                return await transport.send(model, model, prepared, time.perf_counter())

        records = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        failed = [r for r in records if r.error is not None]
        if failed:
            raise UnavailableError(f"{len(failed)} requests failed, e.g. {failed[0].error}: {failed[0].detail}")
        if cancel:
            for lane in transport.lanes:
                lane.call.cancel()
    finally:
        await transport.close()


def run_stream_cancel(args) -> None:
    """The command's work; ``args`` holds its options as attributes (dspark/cli builds it)."""

    toy = args.model.startswith("spec_toy")
    repositories = [project_root() / "tests" / "spec_toy_repository"] if toy else demo_repositories()
    logs = Path(tempfile.mkdtemp(prefix="dspark-stream-cancel-"))

    def start(index: int) -> TritonServer:
        server = TritonServer(repositories=repositories, model_control="explicit", load_models=[args.model],
                              log_verbose=args.log_verbose, log_path=logs / f"tritonserver-{index}.log")
        server.start()
        return server

    prompts = [f"def function_{i}(x):" for i in range(args.requests)]
    servers = 0
    server = start(servers)
    hung, unload_s = [], []
    loop = asyncio.new_event_loop()
    try:
        for cycle in range(args.cycles):
            for batch, concurrency in (([prompts[0]], 1), (prompts, args.concurrency)):
                loop.run_until_complete(one_pass(server.grpc_url, args.model, batch, concurrency,
                                                 args.max_tokens, args.close == "cancel"))
            try:
                unload_s.append(reload_model(server, args.unload_timeout, args.model))
            except UnavailableError as error:
                hung.append(cycle)
                server.stop(keep_log=True)
                print(f"cycle {cycle}: {error}; server log kept: {server.log_path}", flush=True)
                servers += 1
                server = start(servers)
    finally:
        server.stop(keep_log=bool(hung))
        loop.close()
    print(json.dumps({"model": args.model, "close": args.close, "cycles": args.cycles, "hung": len(hung),
                      "hung_cycles": hung, "unload_s_median": round(statistics.median(unload_s), 2) if unload_s else None,
                      "unload_s_max": round(max(unload_s), 2) if unload_s else None}))
