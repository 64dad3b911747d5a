"""`bench spec`: speculative decoding of the served real model (``spec_lm``: SmolLM2-135M-Instruct,
4-bit) against plain decoding, on a held-out prompt set (data/spec_bench_prompts.json: chat,
rewrite, code, continue), in process and streamed through a tritonserver, with llama.cpp on the
same GGUF as the peer when its binding (``llama_cpp``) is importable.

In process, every method runs on every prompt, methods interleaved per prompt so machine noise
hits all alike; a prompt's run is the median (by decode time) of the repeats, and every repeat
starts from the output cache SuffixDecoding had before the prompt's first run (earlier prompts'
outputs, never its own). ``tokens/s`` counts decoding after the first token (the prompt's
prefill, the same work for every method, is the TTFT). Through the server, each method and
concurrency (1, 2, 4) gets freshly loaded models (one per pass, median of the passes) warmed up
on a prompt outside the set; all prompts go ``concurrency`` at a time over gRPC streaming
(dspark/bench/client.py); tokens/s is the in-process token count over the pass's wall time. At
concurrency 1 each prompt also runs in process right after it was served, the in-process
reference for every concurrency.
One ``BenchResult``, one table per ``run``.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from dspark.bench.peers import llama_cpp
from dspark.bench.resources import resident_mib, stub_processes
from dspark.bench.results import BenchResult, Metric
from dspark.bench.table import Column
from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.decoding.stats import DecodeStats
from dspark.decoding.text import Detokenizer, TextGenerator
from dspark.errors import ConfigError, UnavailableError

MODEL = "spec_lm"
PROMPTS_FILE = Path(__file__).with_name("data") / "spec_bench_prompts.json"
KINDS = ("chat", "rewrite", "code", "continue")
SERVED_METHODS = ("none", "ngram", "suffix", "dspark", "hybrid")
CONCURRENCY = (1, 2, 4)
SAMPLED_TEMPERATURE, SAMPLED_SEED = 0.8, 1234
WARM_UP = "Say hello."

# the ``run`` of a row: one table each
GREEDY = "greedy, in process"
BY_KIND = "greedy, x plain by kind"
ACCEPTANCE = "greedy, acceptance by depth"
SAMPLED = f"sampled (T={SAMPLED_TEMPERATURE:g}, seed {SAMPLED_SEED}), in process"
BATCHING = "in process, verification batched"
SERVED = "served, gRPC streaming"
MEMORY = "memory, unload"


@dataclass
class BenchPrompt:
    kind: str
    chat: bool
    text: str


def load_prompts(per_kind: int = 4, path: Path = PROMPTS_FILE) -> list[BenchPrompt]:
    """The first ``per_kind`` prompts of each kind, kinds interleaved (chat, rewrite, code,
    continue, chat, ...), so a short run still covers every kind."""
    data = json.loads(path.read_text(encoding="utf-8"))["prompts"]
    by_kind = {k: [BenchPrompt(p["kind"], p["chat"], p["text"]) for p in data if p["kind"] == k]
               for k in KINDS}
    return [by_kind[k][i] for i in range(per_kind) for k in KINDS if i < len(by_kind[k])]


def prompt_ids(gen: TextGenerator, prompt: BenchPrompt) -> list[int]:
    if prompt.chat:
        return gen.encode_chat([{"role": "user", "content": prompt.text}])
    return gen.encode(prompt.text)


def distinct_char_8gram_share(text: str) -> float:
    """Distinct character 8-grams / all character 8-grams of a text (1.0: nothing repeats;
    a looping output scores low)."""
    grams = [text[i:i + 8] for i in range(len(text) - 7)]
    return len(set(grams)) / len(grams) if grams else 1.0


def kv_bytes_per_token(target) -> int:
    """Bytes of KV cache one token of one request takes, measured on the runtime's own cache
    (fp16 on dspark's kernels, float32 on the ONNX graph)."""
    rows = 64
    cache = target.new_cache(rows)
    nbytes = getattr(cache, "nbytes", None)  # the kernels' cache says; the ONNX graph's is float32
    return nbytes // rows if isinstance(nbytes, int) else \
        target.config.n_layer * 2 * target.config.n_kv_head * target.config.head_dim * 4


@dataclass
class SpecBenchSettings:
    max_tokens: int = 96
    per_kind: int = 4            # prompts per kind (at most 4)
    repeats: int = 3             # runs per prompt and method (median)
    threads: int = 2             # of the target, and of llama.cpp
    methods: Sequence[str] = ()  # default: every method of the model
    server: bool = True          # also streamed through a tritonserver (concurrency 1, 2, 4)
    served_repeats: int = 2      # passes per served point, each on a freshly loaded model (median)
    sampled: bool = True         # also a sampled run
    peer: bool = True            # llama.cpp when importable
    llama_extra_buffers: bool = False
    model: str = MODEL           # a speculative model of the demo repository serving an imported LLM

    def to_json(self) -> dict:
        return {**asdict(self), "methods": list(self.methods)}


# --- in process --------------------------------------------------------------------------------
@dataclass
class Run:
    """One generation: its tokens and text, the seconds of its parts, its statistics."""
    tokens: list[int]
    text: str
    ttft_s: float  # prompt read + the first round, as a streaming client waits for it
    decode_s: float  # everything after the first round
    token_ms: list[float]  # per generated token: its round's time / the round's tokens
    stats: DecodeStats


def run_one(gen: TextGenerator, ids: list[int], sampling: SamplingParams,
            spec: SpeculativeParams) -> Run:
    stats = DecodeStats()
    detok = Detokenizer(gen.tokenizer)
    tokens, token_ms, text = [], [], ""
    start = last = time.perf_counter()
    first = None
    for new in gen.engine.generate(ids, sampling, spec, stats):
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            token_ms += [(now - last) * 1e3 / max(len(new), 1)] * len(new)
        last = now
        tokens += new
        text += detok.add(new)
    end = time.perf_counter()
    text += detok.flush()
    first = first or end
    return Run(tokens, text, first - start, end - first, token_ms, stats)


def decode_rate(runs: Sequence[tuple[int, float]]) -> float:
    """Tokens after the first per second after the first token, over (tokens, decode seconds) of runs."""
    seconds = sum(s for _, s in runs)
    return sum(max(n - 1, 0) for n, _ in runs) / seconds if seconds else 0.0


@dataclass
class MethodResult:
    method: str
    runs: list[Run] = field(default_factory=list)  # one per prompt (the median of repeats)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second after the first round (steady decoding)."""
        return decode_rate([(len(r.tokens), r.decode_s) for r in self.runs])

    @property
    def end_to_end_tokens_per_s(self) -> float:
        seconds = sum(r.ttft_s + r.decode_s for r in self.runs)
        return sum(len(r.tokens) for r in self.runs) / seconds if seconds else 0.0

    def totals(self) -> DecodeStats:
        out = DecodeStats()
        for r in self.runs:
            s = r.stats
            out.generated_tokens += s.generated_tokens
            out.rounds += s.rounds
            out.proposed += s.proposed
            out.accepted += s.accepted
            for d in range(len(s.proposed_at)):
                while len(out.proposed_at) <= d:
                    out.proposed_at.append(0)
                    out.accepted_at.append(0)
                out.proposed_at[d] += s.proposed_at[d]
                out.accepted_at[d] += s.accepted_at[d]
        return out

    def per_position_acceptance(self) -> list[float]:
        """Share of passes that kept the guess at depth d, of those whose tree reached it."""
        t = self.totals()
        return [round(a / p, 3) for a, p in zip(t.accepted_at, t.proposed_at) if p]

    def row(self, run: str, plain: Optional["MethodResult"], identical: str) -> dict:
        t = self.totals()
        ms = [m for r in self.runs for m in r.token_ms] or [float("nan")]
        tps = self.decode_tokens_per_s
        return {
            "run": run, "method": self.method, "tokens_per_s": tps,
            "x_plain": tps / plain.decode_tokens_per_s if plain and plain.decode_tokens_per_s else 1.0,
            "e2e_tokens_per_s": self.end_to_end_tokens_per_s,
            "ttft_p50_ms": 1e3 * statistics.median(r.ttft_s for r in self.runs),
            "itl_p50_ms": float(np.percentile(ms, 50)), "itl_p99_ms": float(np.percentile(ms, 99)),
            "tokens_per_pass": t.generated_tokens / t.rounds if t.rounds else None,
            "accept": t.accepted / t.proposed if t.proposed else None,
            "distinct_8gram": statistics.mean(distinct_char_8gram_share(r.text) for r in self.runs),
            "identical": identical,
        }


def output_caches(engine) -> list:
    """The caches of earlier outputs the engine's proposers keep (SuffixDecoding's)."""
    return list({id(p.cache): p.cache for p in engine.proposers.values()
                 if hasattr(getattr(p, "cache", None), "replace")}.values())


def run_inprocess(gen: TextGenerator, prompts: list[BenchPrompt], methods: dict[str, SpeculativeParams],
                  sampling: SamplingParams, repeats: int = 3,
                  progress: Callable[[str], None] = lambda _: None) -> dict[str, MethodResult]:
    """Every method on every prompt; methods interleaved per prompt so machine noise hits all
    alike; each prompt's run is the median (by decode time) of ``repeats``. Every repeat starts
    from the output cache the prompt's first run had (earlier prompts' outputs, not its own).
    Sampled runs use the same seed for every method (the texts differ by method)."""
    results = {name: MethodResult(name) for name in methods}
    caches = output_caches(gen.engine)
    for i, prompt in enumerate(prompts):
        ids = prompt_ids(gen, prompt)
        saved = [c.outputs() for c in caches]
        for name, spec in methods.items():
            runs = []
            for _ in range(repeats):
                for cache, outputs in zip(caches, saved):
                    cache.replace(outputs)
                runs.append(run_one(gen, ids, sampling, spec))
            runs.sort(key=lambda r: r.decode_s)
            results[name].runs.append(runs[len(runs) // 2])
        progress(f"prompt {i + 1}/{len(prompts)} ({prompt.kind})")
    return results


def summary_rows(results: dict[str, MethodResult], run: str, check_identical: bool) -> list[dict]:
    plain = results.get("none")
    rows = []
    for name, r in results.items():
        identical = "-"
        if check_identical and plain is not None:
            same = sum(a.tokens == b.tokens for a, b in zip(r.runs, plain.runs))
            identical = f"{same}/{len(plain.runs)}"
        rows.append(r.row(run, plain, identical))
    return rows


def mismatched(rows: Sequence[dict]) -> list[str]:
    """The methods whose greedy outputs differ from plain decoding on some prompt."""
    def differs(identical: str) -> bool:  # "same/prompts", or "-" when not checked (peers)
        same, sep, prompts = identical.partition("/")
        return bool(sep) and same != prompts
    return [r["method"] for r in rows if r.get("run") == GREEDY and differs(r.get("identical", "-"))]


def kind_rows(results: dict[str, MethodResult], prompts: list[BenchPrompt]) -> list[dict]:
    """Decode tokens/s per kind as a ratio to plain decoding of the same prompts, same run."""
    plain = results["none"]

    def rate(r: MethodResult, kind: str) -> float:
        return decode_rate([(len(run.tokens), run.decode_s) for run, p in zip(r.runs, prompts) if p.kind == kind])

    kinds = list(dict.fromkeys(p.kind for p in prompts))
    rows = []
    for name, r in results.items():
        row = {"run": BY_KIND, "method": name}
        for kind in kinds:
            base = rate(plain, kind)
            row[kind] = rate(r, kind) / base if base else None
        rows.append(row)
    return rows


def samples(results: dict[str, MethodResult], prompts: list[BenchPrompt], chars: int = 400) -> list[dict]:
    """The first prompt of each kind and its plain greedy output, for the docs."""
    out, seen = [], set()
    for prompt, run in zip(prompts, results["none"].runs):
        if prompt.kind not in seen:
            seen.add(prompt.kind)
            out.append({"kind": prompt.kind, "prompt": prompt.text, "output": run.text[:chars]})
    return out


def concurrent_inprocess(gen: TextGenerator, prompts: list[BenchPrompt], spec: SpeculativeParams,
                         sampling: SamplingParams, concurrency: int) -> float:
    """Aggregate tokens/s of all prompts run ``concurrency`` at a time on this engine, from an
    empty output cache."""
    ids = [prompt_ids(gen, p) for p in prompts]
    for cache in output_caches(gen.engine):
        cache.replace([])
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        runs = list(pool.map(lambda i: run_one(gen, i, sampling, spec), ids))
    return sum(len(r.tokens) for r in runs) / (time.perf_counter() - start)


def batching_rows(gen: TextGenerator, prompts: list[BenchPrompt], specs: dict[str, SpeculativeParams],
                  sampling: SamplingParams, methods: Sequence[str]) -> list[dict]:
    """In process, all prompts 1 and 4 at a time: each request's own target calls against
    verification batched into shared target calls (the same target, proposers and prompts)."""
    from dspark.decoding.engine import SpeculativeEngine

    engine = gen.engine
    batched = TextGenerator(SpeculativeEngine(engine.target, engine.proposers.values(), engine.context,
                                              engine.eos_ids, batch_verification=True),
                            gen.tokenizer, gen.max_token_bytes)
    rows = []
    try:
        for method in methods:
            row = {"run": BATCHING, "method": method}
            for label, g in (("own", gen), ("batched", batched)):
                for concurrency in (1, 4):
                    row[f"{label}_c{concurrency}"] = concurrent_inprocess(g, prompts, specs[method], sampling,
                                                                          concurrency)
            rows.append(row)
    finally:
        batched.engine.close()
    return rows


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


def _stub_pid(server_pid: int, model: str = MODEL) -> int:
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

    old = _stub_pid(server._process.pid, model)
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
        from dspark.triton.server import TritonServer

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
        _stub_pid(pid, self.model)
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
        idle = resident_mib(_stub_pid(models.server._process.pid, model))
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


# --- the peer: llama.cpp on the same GGUF (dspark/bench/peers/llama_cpp.py) ----------------------
def llama_cpp_row(name: str, runs: list[dict], detokenize, plain: Optional[MethodResult]) -> dict:
    tps = decode_rate([(len(r["tokens"]), r["decode_s"]) for r in runs])
    row = {"run": GREEDY, "method": name, "tokens_per_s": tps,
           "x_plain": tps / plain.decode_tokens_per_s if plain else None,
           "e2e_tokens_per_s": sum(len(r["tokens"]) for r in runs) / sum(r["ttft_s"] + r["decode_s"] for r in runs),
           "ttft_p50_ms": 1e3 * statistics.median(r["ttft_s"] for r in runs),
           "distinct_8gram": statistics.mean(distinct_char_8gram_share(detokenize(r["tokens"])) for r in runs)}
    if plain is not None:
        same = sum(r["tokens"] == p.tokens for r, p in zip(runs, plain.runs))
        row["same_as_plain"] = f"{same}/{len(runs)}"
    return row


# --- the result ----------------------------------------------------------------------------------
COLUMNS = [
    Column("run"), Column("method"), Column("measure"), Column("value", "value", ",.1f"),
    Column("concurrency", "conc"), Column("tokens_per_s", "tokens/s", ".1f"), Column("x_plain", "x plain", ".2f"),
    Column("x_llama_cpp", "x llama.cpp", ".2f"), Column("e2e_tokens_per_s", "end-to-end tok/s", ".1f"),
    Column("ttft_p50_ms", "TTFT ms p50", ".1f"), Column("itl_p50_ms", "ITL ms p50", ".2f"),
    Column("itl_p99_ms", "ITL ms p99", ".2f"), Column("gap_p50_ms", "response gap ms p50", ".1f"),
    Column("gap_p99_ms", "response gap ms p99", ".1f"), Column("tokens_per_pass", "tok/pass", ".2f"),
    Column("accept", "accept", ".2f"), Column("distinct_8gram", "distinct 8g", ".2f"),
    Column("identical", "identical"), Column("same_as_plain", "same as dspark plain"),
    *(Column(kind, kind, ".2f") for kind in KINDS),
    Column("acceptance", "kept at depth 1/2/...", ".2f"),
    Column("own_c1", "own calls c1 tok/s", ".1f"), Column("own_c4", "own calls c4 tok/s", ".1f"),
    Column("batched_c1", "batched c1 tok/s", ".1f"), Column("batched_c4", "batched c4 tok/s", ".1f"),
    Column("inprocess_e2e_tokens_per_s", "in-process tok/s (end to end)", ".1f"),
    Column("served_x_inprocess", "served / in-process", ".2f"), Column("same_text", "same text"),
]
METRICS = [Metric("tokens_per_s", "higher"), Metric("e2e_tokens_per_s", "higher"), Metric("x_plain", "higher"),
           Metric("ttft_p50_ms", "lower"), Metric("itl_p50_ms", "lower"), Metric("itl_p99_ms", "lower"),
           Metric("tokens_per_pass", "higher"), Metric("own_c4", "higher"), Metric("batched_c4", "higher")]


def demo_llm_folder(model: str) -> Path:
    """The import folder that the demo repository's LLM model ``model`` serves (its parameter
    llm_model, in version 1), checked to hold an import."""
    from dspark.llm.importer import STAMP_FILE
    from dspark.paths import project_root
    from dspark.repository.modelspec import SPEC_FILENAME, ModelSpec

    spec_path = project_root() / "model_repository" / model / SPEC_FILENAME
    llm_folder = ModelSpec.load(spec_path).parameters.get("llm_model") if spec_path.is_file() else None
    if not llm_folder:
        raise ConfigError("model", f"'{model}' is not a model of the demo repository serving an imported LLM "
                          "(parameter llm_model)", spec_path)
    folder = spec_path.parent / "1" / llm_folder
    if not (folder / STAMP_FILE).is_file():  # what the kernel runtime reads: the GGUF it names
        raise ConfigError(STAMP_FILE, "missing: run `make setup` first", folder)
    return folder


def run_spec_bench(settings: SpecBenchSettings, log: Callable[[str], None] = lambda _: None) -> BenchResult:
    """Load the model in this process, measure everything the settings ask for, return the result."""
    from dspark.decoding.models import llm_generator
    from dspark.triton.request_pool import limit_heap_growth
    from dspark.llm.importer import import_source

    model = settings.model
    folder = demo_llm_folder(model)
    limit_heap_growth()  # as the serving stub does
    gen = llm_generator(folder, threads=settings.threads)
    engine = gen.engine
    names = list(settings.methods) or list(engine.methods)
    unknown = sorted(set(names) - set(engine.methods))
    if unknown:
        raise ConfigError("methods", f"{unknown} not among the model's {list(engine.methods)}")
    names = ["none"] + [n for n in names if n != "none"]
    specs = {n: SpeculativeParams(n, num_speculative_tokens=8 if n in ("dspark", "hybrid") else 4) for n in names}
    prompts = load_prompts(settings.per_kind)
    kv = kv_bytes_per_token(engine.target)
    memory = {"in-process MiB after load": resident_mib(), "KV KiB per token": kv / 2**10,
              "KV MiB per request at full context": kv * engine.context / 2**20}

    greedy = SamplingParams(max_tokens=settings.max_tokens)
    results = run_inprocess(gen, prompts, specs, greedy, settings.repeats, log)
    rows = summary_rows(results, GREEDY, check_identical=True)
    notes = [f"{model} ({folder.name}, {type(engine.target).__name__}), {len(prompts)} held-out prompts ({settings.per_kind} per kind) x up to "
             f"{settings.max_tokens} tokens, median of {settings.repeats}, {settings.threads} threads; tokens/s "
             "after the first token, TTFT holds the prompt's prefill"]
    gguf = import_source(folder)
    if settings.peer and llama_cpp.available():
        ids = [prompt_ids(gen, p) for p in prompts]
        peer_rows = []
        for label, lookup in (("llama.cpp plain", False), ("llama.cpp prompt lookup", True)):
            runs = llama_cpp.timed_generations(gguf, ids, settings.max_tokens, settings.threads, 0.0, SAMPLED_SEED, lookup,
                                 gen.tokenizer.eos_id, settings.repeats, settings.llama_extra_buffers)
            peer_rows.append(llama_cpp_row(label, runs, gen.tokenizer.decode, results["none"]))
        base = peer_rows[0]["tokens_per_s"]
        for row in rows + peer_rows:
            row["x_llama_cpp"] = row["tokens_per_s"] / base if base else None
        rows += peer_rows
        notes.append(f"peer: llama-cpp-python {llama_cpp.version()} on the same GGUF, same prompt tokens and "
                     "threads (plain, and LlamaPromptLookupDecoding(10))")
    else:
        notes.append("no llama.cpp rows: " + ("--no-llama-cpp" if not settings.peer else
                     "llama_cpp is not importable (make bench-deps installs it)"))
    rows += kind_rows(results, prompts)
    rows += [{"run": ACCEPTANCE, "method": n, "acceptance": r.per_position_acceptance()}
             for n, r in results.items() if n != "none"]

    if settings.sampled:
        hot = SamplingParams(max_tokens=settings.max_tokens, temperature=SAMPLED_TEMPERATURE, seed=SAMPLED_SEED)
        rows += summary_rows(run_inprocess(gen, prompts, specs, hot, max(1, settings.repeats // 2), log),
                             SAMPLED, check_identical=False)

    greedy_rows = [r for r in rows if r["run"] == GREEDY and r["method"] in specs and r["method"] != "none"]
    best = max(greedy_rows, key=lambda r: r["tokens_per_s"], default=None)
    rows += batching_rows(gen, prompts, specs, greedy, ["none"] + ([best["method"]] if best else []))
    memory["in-process MiB after the runs"] = resident_mib()
    if settings.server:
        served, stub_memory = served_rows(gen, prompts, results, specs, greedy, settings.served_repeats, log, model)
        rows += served
        memory.update(stub_memory)
        notes.append(f"served: the median of {settings.served_repeats} passes per method and concurrency, "
                     f"each on a freshly loaded {model} warmed up on a prompt outside "
                     "the set; tokens/s = the in-process token count over the pass's wall time (prompt reading "
                     "included; at concurrency 1, over the requests' times); in-process reference: each prompt "
                     "in process right after it was served at concurrency 1 (median of the passes; served / "
                     "in-process at concurrency 1: the median of the passes' ratios); response gaps between "
                     "streamed responses")
    rows += [{"run": MEMORY, "measure": k, "value": v} for k, v in memory.items()]
    return BenchResult(
        "spec", {**settings.to_json(), "model": f"{model} ({folder.name})", "target": type(engine.target).__name__,
                 "prompts": len(prompts),
                 "specs": {n: vars(s) for n, s in specs.items()}, "context": engine.context},
        rows, COLUMNS, key_fields=["run", "method", "concurrency", "measure"], metrics=METRICS, notes=notes,
        series={"samples": samples(results, prompts)}, group_by="run")


# --- quality against llama.cpp's stored figures -------------------------------------------------
QUALITY_MODELS = (("spec_lm", "smollm2_llama_cpp.json"), ("gemma_lm", "gemma3_270m_llama_cpp.json"))


def run_llm_quality() -> BenchResult:
    """Per demo LLM: whether dspark's tokens equal llama.cpp's on the held-out text, teacher-forced
    perplexity of both over those tokens, and how many of llama.cpp's first greedy tokens dspark
    repeats (and the float64 reference's top-2 margin where they part)."""
    from dspark.llm.evaluate import greedy, heldout_text, perplexity, runtime_logits
    from dspark.llm.gguf_model import GGUFModel
    from dspark.llm.importer import import_source
    from dspark.llm.kernel_runtime import KernelRuntime
    from dspark.llm.reference import reference_logits
    from dspark.llm.tokenizer import LlamaTokenizer
    from dspark.paths import project_root

    resident = _served_resident_mib([name for name, _ in QUALITY_MODELS])
    rows = []
    for name, ref_file in QUALITY_MODELS:
        folder = demo_llm_folder(name)
        ref = json.loads((project_root() / "tests" / "data" / ref_file).read_text())
        model = GGUFModel(import_source(folder))
        tokenizer = LlamaTokenizer.load(folder / "tokenizer.json")
        runtime = KernelRuntime(model)
        ids = tokenizer.encode(heldout_text(tuple(ref["topics"])))[:len(ref["tokens"])]
        ppl = perplexity(runtime_logits(runtime), ref["tokens"])
        ours = greedy(runtime, ref["greedy_prompt_tokens"], len(ref["greedy"]))
        agree = next((i for i, (a, b) in enumerate(zip(ours, ref["greedy"])) if a != b), len(ours))
        margin = None
        if agree < len(ours):  # how close the two candidates are where the runs part, in float64
            logits, _ = reference_logits(model, ref["greedy_prompt_tokens"] + ours[:agree])
            top = np.sort(logits[-1])[-2:]
            margin = float(top[1] - top[0])
        cfg = model.config
        rows.append({"model": name, "gguf": ref["gguf"], "architecture": cfg.architecture,
                     "weights": "/".join(sorted(set("/".join(cfg.weight_types.values()).split("/")))),
                     "tokens_equal": ids == ref["tokens"], "ppl": ppl, "ppl_llama_cpp": ref["ppl"],
                     "ppl_ratio": ppl / ref["ppl"], "greedy_agree": f"{agree}/{len(ours)}", "margin": margin,
                     "resident_mib": resident[name]})
    rows.append({"model": "both, together", "resident_mib": sum(resident.values())})
    columns = [Column("model"), Column("gguf"), Column("architecture"), Column("weights"),
               Column("tokens_equal", "tokens = llama.cpp's"), Column("ppl", "perplexity", ".3f"),
               Column("ppl_llama_cpp", "llama.cpp perplexity", ".3f"), Column("ppl_ratio", "ratio", ".4f"),
               Column("greedy_agree", "greedy tokens equal before the first difference"),
               Column("margin", "float64 top-2 margin there", ".3f"),
               Column("resident_mib", "served stub resident MiB", ".0f")]
    ref_note = json.loads((project_root() / "tests" / "data" / QUALITY_MODELS[0][1]).read_text())
    return BenchResult("llm-quality", {}, rows, columns, key_fields=["model"], metrics=[Metric("ppl_ratio", "lower")],
                       notes=[f"first {len(ref_note['tokens'])} tokens of pydoc topic 'class' (one window), greedy "
                              f"after {ref_note['greedy_prompt']!r}; llama.cpp figures stored by "
                              f"`dspark llm reference` (llama-cpp-python {ref_note['llama_cpp']}, repacking off); "
                              "resident: each model's backend stub in one tritonserver serving both, after one "
                              "request each"])


def _served_resident_mib(models: list[str]) -> dict[str, float]:
    """Resident MiB of each model's backend stub, one tritonserver serving them all, after one
    short chat request to each."""
    from dspark.bench.resources import resident_mib
    from dspark.paths import demo_repositories
    from dspark.triton.server import TritonServer

    server = TritonServer(repositories=demo_repositories(), model_control="explicit", load_models=models)
    server.start()
    try:
        for model in models:
            run_served(server.grpc_url, [BenchPrompt("warm-up", True, WARM_UP)], {"max_tokens": 16}, 1, model)
        return {model: resident_mib(_stub_pid(server._process.pid, model)) for model in models}
    finally:
        server.stop()
