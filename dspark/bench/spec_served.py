"""`bench spec` through a server: prompts streamed over gRPC at several concurrencies to freshly
loaded models, interleaved with in-process runs, and the stubs' memory and unload times."""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from dspark.bench.resources import resident_mib, stub_processes
from dspark.bench.spec_inprocess import (BenchPrompt, CONCURRENCY, MODEL, MethodResult, SERVED,
                                         SERVED_METHODS, WARM_UP, output_caches, prompt_ids, run_one)
from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.decoding.text import TextGenerator
from dspark.errors import UnavailableError


# --- through a server --------------------------------------------------------------------------
def _prepared(transport, info, prompt: BenchPrompt, sampling: dict):
    return transport.prepare(info, {
        "text_input": np.array([prompt.text.encode()], dtype=np.object_),
        "sampling_parameters": np.array([json.dumps({**sampling, "chat": prompt.chat}).encode()], dtype=np.object_),
        "stream": np.array([True])})


def _check_answered(records: list, model: str) -> None:
    failed = [r for r in records if r.error is not None]
    if failed:
        raise UnavailableError(f"{model} failed {len(failed)} of {len(records)} streamed requests, e.g. "
                               f"{failed[0].error}: {failed[0].detail}")


async def _served_pass(transport, info, prompts: Sequence[BenchPrompt], sampling: dict,
                       concurrency: int, model: str) -> tuple[list, float]:
    """All prompts, ``concurrency`` at a time in prompt order: their records and the wall time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(prepared):
        async with gate:
            return await transport.send(model, model, prepared, time.perf_counter())

    prepared = [_prepared(transport, info, p, sampling) for p in prompts]
    start = time.perf_counter()
    records = await asyncio.gather(*(one(p) for p in prepared))
    wall = time.perf_counter() - start
    _check_answered(records, model)
    return records, wall


def _with_transport(grpc_url: str, concurrency: int, work: Callable, model: str):
    """``await work(transport, info)`` over a gRPC streaming transport opened for ``concurrency``."""
    from dspark.bench.client import GrpcStreamTransport
    from dspark.bench.inputs import ModelInfo

    async def go():
        transport = GrpcStreamTransport(grpc_url, timeout_s=600, keep="text_output")
        await transport.open(concurrency)
        try:
            return await work(transport, ModelInfo.from_config(await transport.model_config(model)))
        finally:
            await transport.close()
    return _event_loop().run_until_complete(go())


def run_served(grpc_url: str, prompts: Sequence[BenchPrompt], sampling: dict, concurrency: int,
               model: str = MODEL) -> tuple[list, float]:
    return _with_transport(grpc_url, concurrency,
                           lambda transport, info: _served_pass(transport, info, prompts, sampling, concurrency, model),
                           model)


def run_interleaved(grpc_url: str, prompts: Sequence[BenchPrompt], request: dict, gen: TextGenerator,
                    spec: SpeculativeParams, sampling: SamplingParams, model: str = MODEL) -> tuple[list, float, float]:
    """Concurrency 1, each prompt streamed through the server and then at once in process, so
    that this machine's drift (its speed wanders by a quarter over minutes) hits both alike: the
    records, the served seconds (each request's send to its final response) and the in-process
    seconds (from an empty output cache, as the freshly loaded server starts)."""
    ids = [prompt_ids(gen, p) for p in prompts]
    for cache in output_caches(gen.engine):
        cache.replace([])

    async def work(transport, info):
        records, inprocess_s = [], 0.0
        for prompt, prompt_tokens in zip(prompts, ids):
            records.append(await transport.send(model, model, _prepared(transport, info, prompt, request),
                                                time.perf_counter()))
            start = time.perf_counter()
            run_one(gen, prompt_tokens, sampling, spec)
            inprocess_s += time.perf_counter() - start
        return records, inprocess_s

    records, inprocess_s = _with_transport(grpc_url, 1, work, model)
    _check_answered(records, model)
    return records, sum(r.done - r.sent for r in records), inprocess_s


_loop: Optional[asyncio.AbstractEventLoop] = None


def _event_loop() -> asyncio.AbstractEventLoop:
    """One event loop for every served pass: grpc.aio's poller outlives a loop that
    asyncio.run closes, and then reports "Event loop is closed" from its thread."""
    global _loop
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
    return _loop


def stub_pid(server_pid: int, model: str = MODEL) -> int:
    """The stub serving the model now (a reload starts a new one; the old one may linger a moment)."""
    stubs: list = []
    for _ in range(100):
        stubs = stub_processes(server_pid, model)
        if len(stubs) == 1:
            return stubs[0][0]
        time.sleep(0.1)
    raise UnavailableError(f"cannot tell which stub serves {model}: {stubs}")


def reload_model(server, timeout_s: float, model: str = MODEL) -> float:
    """Unload the model, wait until its stub has exited, load it again: a fresh stub (an empty
    output cache; suffix would otherwise find each prompt's own output from the previous pass).
    A load alone does not do it: Triton 2.51 answers a load of an unchanged, loaded model at
    once and keeps the running stub. Returns the seconds the unload took."""
    import requests

    def post(action: str) -> None:
        reply = requests.post(f"http://{server.http_url}/v2/repository/models/{model}/{action}", json={},
                              headers=server.repository_headers, timeout=300)
        if reply.status_code != 200:
            raise UnavailableError(f"{action}ing {model} failed: HTTP {reply.status_code} {reply.text[:300]}")

    old = stub_pid(server._process.pid, model)
    started = time.perf_counter()
    post("unload")
    while old in (pid for pid, _ in stub_processes(server._process.pid, model)):
        if time.perf_counter() - started > timeout_s:
            raise UnavailableError(f"{model} did not unload within {timeout_s:g} s (its stub {old} still runs)")
        time.sleep(0.05)
    unloaded = time.perf_counter() - started
    post("load")
    return unloaded


class _FreshModels:
    """A tritonserver serving the model, reloaded (``reload_model``) before every served pass. An
    unload that hangs (a client that cancels a gRPC stream as its last answer is written makes
    Triton 2.51 keep the model: docs/speculative.md, "Why an unload hung") restarts the server,
    keeps its log and is counted, so one such stop does not end the benchmark."""

    UNLOAD_TIMEOUT_S = 15.0

    def __init__(self, log: Callable[[str], None], model: str = MODEL):
        self.log, self.model = log, model
        self.reloads, self.hung, self.slowest_unload_s = 0, 0, 0.0
        self.server = self._start()

    def _start(self):
        from dspark.paths import demo_repositories
        from dspark.server.launcher import TritonServer

        server = TritonServer(repositories=demo_repositories(), model_control="explicit", load_models=[self.model])
        server.start()
        return server

    def reload(self) -> None:
        self.reloads += 1
        try:
            self.slowest_unload_s = max(self.slowest_unload_s, reload_model(self.server, self.UNLOAD_TIMEOUT_S, self.model))
        except UnavailableError as error:
            self.hung += 1
            stacks = Path(self.server.log_path).with_name("tritonserver-stacks.txt")
            self.server.write_native_stacks(stacks)
            self.server.stop(keep_log=True)
            self.log(f"{error}; restarting the server (its log: {self.server.log_path}; native stacks: {stacks})")
            self.server = self._start()

    def stop(self, failed: bool) -> None:
        self.server.stop(keep_log=failed)
        if failed:
            self.log(f"the server's log is kept: {self.server.log_path}")

    def pass_on_fresh_stub(self, request: dict, measure: Callable[[str], tuple]) -> tuple[tuple, float]:
        """Reload, warm up on a prompt outside the set, then ``measure(grpc_url)``: what it
        returns, and the stub's peak resident MiB meanwhile."""
        from dspark.bench.resources import ResourceSampler, summarize_samples

        self.reload()
        grpc_url, pid = self.server.grpc_url, self.server._process.pid
        run_served(grpc_url, [BenchPrompt("warm-up", True, WARM_UP)], request, 1, self.model)
        stub_pid(pid, self.model)
        sampler = ResourceSampler(pid, 0.5).start()
        measured = measure(grpc_url)
        return measured, summarize_samples(sampler.stop(), self.model).get("model_stubs_rss_mib", 0.0)


def served_rows(gen: TextGenerator, prompts: list[BenchPrompt], results: dict[str, MethodResult],
                specs: dict[str, SpeculativeParams], sampling: SamplingParams, repeats: int,
                log: Callable[[str], None], model: str = MODEL) -> tuple[list[dict], dict]:
    """Each method at concurrency 1, 2, 4 through a tritonserver started here, the median of
    ``repeats`` passes (the same text in every pass counts); the stub's resident memory after
    load and at most while serving (MiB); the reloads' unload times. The in-process reference is
    measured inside the concurrency-1 passes, each prompt in process right after it was served
    (``run_interleaved``); served / in-process at concurrency 1 is the median of the passes'
    ratios."""
    from dspark.bench.load import summarize

    rows = []
    models = _FreshModels(log, model)
    failed = True
    try:
        idle = resident_mib(stub_pid(models.server._process.pid, model))
        peak = idle
        for method in [m for m in SERVED_METHODS if m in specs]:
            request = {"max_tokens": sampling.max_tokens, "speculative": vars(specs[method])}
            runs = results[method].runs
            counts = sum(len(r.tokens) for r in runs)
            inproc_rates: list[float] = []  # filled by the concurrency-1 passes, CONCURRENCY's first
            pass_ratios: list[float] = []
            for concurrency in CONCURRENCY:
                records, walls, same = [], [], len(prompts)
                for _ in range(repeats):
                    if concurrency == 1:
                        (pass_records, wall, inprocess_s), rss = models.pass_on_fresh_stub(
                            request, lambda url: run_interleaved(url, prompts, request, gen, specs[method], sampling, model))
                        inproc_rates.append(counts / inprocess_s)
                        pass_ratios.append(inprocess_s / wall)
                    else:
                        (pass_records, wall), rss = models.pass_on_fresh_stub(
                            request, lambda url: run_served(url, prompts, request, concurrency, model))
                    peak = max(peak, rss)
                    records += pass_records
                    walls.append(wall)
                    texts = [b"".join(r.kept).decode(errors="replace") for r in pass_records]
                    same = min(same, sum(text == run.text for text, run in zip(texts, runs)))
                tps = statistics.median(counts / wall for wall in walls)
                inproc = statistics.median(inproc_rates)
                figures = summarize(records, sum(walls))
                rows.append({"run": SERVED, "method": method, "concurrency": concurrency, "tokens_per_s": tps,
                             "ttft_p50_ms": figures["ttft_p50_ms"], "gap_p50_ms": figures["itl_p50_ms"],
                             "gap_p99_ms": figures["itl_p99_ms"], "inprocess_e2e_tokens_per_s": inproc,
                             "served_x_inprocess": statistics.median(pass_ratios) if concurrency == 1 else
                             tps / inproc if inproc else None,
                             "same_text": f"{same}/{len(prompts)}"})
                log(f"served {method} at concurrency {concurrency}: {tps:.1f} tok/s")
        failed = False
    finally:
        models.stop(failed)
    return rows, {"stub resident MiB after load": idle, "stub resident MiB max while serving": peak,
                  "model reloads (unload + load, nothing in flight)": models.reloads,
                  "reloads whose unload hung (server restarted)": models.hung,
                  "stub unload s, slowest of the others": models.slowest_unload_s}


