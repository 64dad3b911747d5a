"""Speculative decoding benchmark (``dspark bench spec``): plain decoding against every method
of the served model on a held-out prompt set, in process and through a running server, with
llama.cpp on the same GGUF as the peer row when its binding is installed."""
from __future__ import annotations

import json
import os
import platform
import queue
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.decoding.stats import DecodeStats
from dspark.decoding.text import Detokenizer, TextGenerator

PROMPTS_FILE = Path(__file__).with_name("data") / "spec_bench_prompts.json"
KINDS = ("chat", "rewrite", "code", "continue")


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


def cpu_model() -> dict:
    """The CPU that produced the numbers: model name, cores, the SIMD extensions that matter."""
    name, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("unknown", "", "x86_64"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    return {"model": name, "cores": os.cpu_count(), "flags": [f for f in wanted if f in flags]}


def resident_mb(pid: Optional[int] = None) -> float:
    """Resident memory (VmRSS) of a process, MB."""
    status = Path(f"/proc/{pid or 'self'}/status").read_text()
    kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return kb / 1024


def stub_processes(server_pid: int, model: str) -> list[tuple[int, list[str]]]:
    """(pid, argv) of the Python backend stubs of the server ``server_pid`` serving ``model``
    (argv[1] is the model's model.py, argv[2] its shared-memory region)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == server_pid and argv[0].endswith(b"triton_python_backend_stub") and \
                any(f"/{model}/".encode() in a for a in argv):
            out.append((int(proc.name), [a.decode(errors="replace") for a in argv if a]))
    return out


def kv_bytes_per_token(config) -> int:
    """Bytes of KV cache one token of one request takes (float32 keys and values)."""
    return config.n_layer * 2 * config.n_kv_head * config.head_dim * 4


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


@dataclass
class MethodResult:
    method: str
    runs: list[Run] = field(default_factory=list)  # one per prompt (the median of repeats)

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.runs)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second after the first round (steady decoding)."""
        seconds = sum(r.decode_s for r in self.runs)
        return sum(max(len(r.tokens) - 1, 0) for r in self.runs) / seconds if seconds else 0.0

    @property
    def end_to_end_tokens_per_s(self) -> float:
        seconds = sum(r.ttft_s + r.decode_s for r in self.runs)
        return self.tokens / seconds if seconds else 0.0

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

    def row(self, plain: Optional["MethodResult"], identical: str) -> dict:
        t = self.totals()
        ms = [m for r in self.runs for m in r.token_ms] or [float("nan")]
        tps = self.decode_tokens_per_s
        return {
            "method": self.method, "tokens/s": round(tps, 1),
            "x plain": round(tps / plain.decode_tokens_per_s, 2) if plain and plain.decode_tokens_per_s else 1.0,
            "end-to-end tok/s": round(self.end_to_end_tokens_per_s, 1),
            "TTFT ms p50": round(1e3 * statistics.median(r.ttft_s for r in self.runs), 1),
            "ITL ms p50": round(float(np.percentile(ms, 50)), 2),
            "ITL ms p99": round(float(np.percentile(ms, 99)), 2),
            "tok/pass": round(t.generated_tokens / t.rounds, 2) if t.rounds else None,
            "accept": round(t.accepted / t.proposed, 2) if t.proposed else None,
            "distinct 8g": round(statistics.mean(distinct_char_8gram_share(r.text) for r in self.runs), 2),
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


def summary_rows(results: dict[str, MethodResult], check_identical: bool) -> list[dict]:
    plain = results.get("none")
    rows = []
    for name, r in results.items():
        identical = "-"
        if check_identical and plain is not None:
            same = sum(a.tokens == b.tokens for a, b in zip(r.runs, plain.runs))
            identical = f"{same}/{len(plain.runs)}"
        rows.append(r.row(plain, identical))
    return rows


def kind_rows(results: dict[str, MethodResult], prompts: list[BenchPrompt]) -> list[dict]:
    """Decode tokens/s per kind as a ratio to plain decoding of the same prompts, same run."""
    plain = results["none"]

    def rate(r: MethodResult, kind: str) -> float:
        runs = [run for run, p in zip(r.runs, prompts) if p.kind == kind]
        seconds = sum(run.decode_s for run in runs)
        return sum(max(len(run.tokens) - 1, 0) for run in runs) / seconds if seconds else 0.0

    kinds = list(dict.fromkeys(p.kind for p in prompts))
    rows = []
    for name, r in results.items():
        row = {"method": name}
        for kind in kinds:
            base = rate(plain, kind)
            row[kind] = round(rate(r, kind) / base, 2) if base else None
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
                         sampling: SamplingParams, concurrency: int) -> dict:
    """Aggregate tokens/s of all prompts run ``concurrency`` at a time on this engine, from an
    empty output cache."""
    ids = [prompt_ids(gen, p) for p in prompts]
    for cache in output_caches(gen.engine):
        cache.replace([])
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        runs = list(pool.map(lambda i: run_one(gen, i, sampling, spec), ids))
    wall = time.perf_counter() - start
    return {"concurrency": concurrency, "tokens/s": round(sum(len(r.tokens) for r in runs) / wall, 1),
            "texts": [r.text for r in runs]}


# -- through a server ---------------------------------------------------------------------------
def stream_request(grpc_url: str, model: str, prompt: BenchPrompt, sampling: dict) -> dict:
    """One gRPC streamed request: text, seconds to the first response, gaps between responses."""
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    values = [("sampling_parameters", json.dumps({**sampling, "chat": prompt.chat}).encode(), "BYTES"),
              ("text_input", prompt.text.encode(), "BYTES"), ("stream", True, "BOOL")]
    inputs = []
    for name, value, dtype in values:
        tensor = grpcclient.InferInput(name, [1], dtype)
        tensor.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else np.bool_))
        inputs.append(tensor)
    start = time.perf_counter()
    client.async_stream_infer(model, inputs, enable_empty_final_response=True)
    pieces, stamps = [], []
    try:
        while True:
            result, error = results.get(timeout=600)
            if error is not None:
                raise RuntimeError(str(error))
            response = result.get_response()
            if response.outputs:
                pieces.append(result.as_numpy("text_output")[0].decode())
                stamps.append(time.perf_counter())
            if response.parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    end = time.perf_counter()
    return {"text": "".join(pieces), "ttft_s": (stamps[0] if stamps else end) - start,
            "seconds": end - start, "gaps_ms": [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])]}


def run_served(grpc_url: str, model: str, prompts: list[BenchPrompt], sampling: dict,
               concurrency: int, tokens: list[int]) -> dict:
    """All prompts through the server, ``concurrency`` at a time. ``tokens``: each prompt's
    token count from the in-process run of the same greedy method (identical outputs)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda p: stream_request(grpc_url, model, p, sampling), prompts))
    wall = time.perf_counter() - start
    gaps = [g for d in done for g in d["gaps_ms"]] or [float("nan")]
    return {"concurrency": concurrency, "tokens/s": round(sum(tokens) / wall, 1),
            "TTFT ms p50": round(1e3 * statistics.median(d["ttft_s"] for d in done), 1),
            "response gap ms p50": round(float(np.percentile(gaps, 50)), 1),
            "response gap ms p99": round(float(np.percentile(gaps, 99)), 1),
            "texts": [d["text"] for d in done]}


# -- the peer: llama.cpp on the same GGUF -------------------------------------------------------
def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def run_llama_cpp(gguf: Path, prompt_tokens: list[list[int]], max_tokens: int, threads: int,
                  temperature: float, seed: int, prompt_lookup: bool, eos: int,
                  repeats: int = 1, extra_buffers: bool = False) -> list[dict]:
    """llama.cpp (``llama-cpp-python``) on the same GGUF, the same prompt tokens and threads:
    per prompt its tokens, seconds to the first token and decode seconds (median of repeats).
    ``prompt_lookup``: its prompt-lookup speculative mode (``LlamaPromptLookupDecoding``);
    ``extra_buffers``: let llama.cpp repack weights for its own kernels (AMX where present)."""
    from llama_cpp import Llama
    from llama_cpp import llama_cpp as raw

    if not extra_buffers and not getattr(raw, "_dspark_plain_buffers", False):
        # llama.cpp's "extra buffer types" (weight repacking, its AMX kernels) off: built with
        # GGML_NATIVE on a Sapphire Rapids VM its AMX Q4_1 kernel died with SIGILL (seen by the
        # llm-kernel work); off, Q4_1 runs on its AVX-512/AVX2 dot products, as on CPUs without AMX
        defaults = raw.llama_model_default_params

        def params():
            p = defaults()
            if hasattr(p, "use_extra_bufts"):
                p.use_extra_bufts = False
            return p

        raw.llama_model_default_params = params
        raw._dspark_plain_buffers = True
    options = {}
    if prompt_lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        options["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=10)
    llm = Llama(model_path=str(gguf), n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                seed=seed, logits_all=True, verbose=False, **options)
    out = []
    for ids in prompt_tokens:
        runs = []
        for _ in range(repeats):
            llm.reset()
            tokens, first = [], None
            start = time.perf_counter()
            sampler = dict(temp=temperature, top_k=1 if temperature == 0 else 0, top_p=1.0, min_p=0.0,
                           repeat_penalty=1.0)
            for token in llm.generate(ids, reset=True, **sampler):
                if first is None:
                    first = time.perf_counter()
                if token == eos:
                    break
                tokens.append(token)
                if len(tokens) >= max_tokens:
                    break
            end = time.perf_counter()
            runs.append({"tokens": tokens, "ttft_s": (first or end) - start, "decode_s": end - (first or end)})
        runs.sort(key=lambda r: r["decode_s"])
        out.append(runs[len(runs) // 2])
    return out


def llama_cpp_row(name: str, runs: list[dict], detokenize, plain: Optional[MethodResult]) -> dict:
    seconds = sum(r["decode_s"] for r in runs)
    tps = sum(max(len(r["tokens"]) - 1, 0) for r in runs) / seconds if seconds else 0.0
    row = {"method": name, "tokens/s": round(tps, 1),
           "x plain": round(tps / plain.decode_tokens_per_s, 2) if plain else None,
           "end-to-end tok/s": round(sum(len(r["tokens"]) for r in runs) /
                                     sum(r["ttft_s"] + r["decode_s"] for r in runs), 1),
           "TTFT ms p50": round(1e3 * statistics.median(r["ttft_s"] for r in runs), 1),
           "distinct 8g": round(statistics.mean(distinct_char_8gram_share(detokenize(r["tokens"]))
                                                for r in runs), 2)}
    if plain is not None:
        same = sum(r["tokens"] == p.tokens for r, p in zip(runs, plain.runs))
        row["same as dspark plain"] = f"{same}/{len(runs)}"
    return row


def format_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    widths = {k: max(len(k), *(len(str(r.get(k, ""))) for r in rows)) for k in keys}
    lines = ["| " + " | ".join(k.ljust(widths[k]) for k in keys) + " |",
             "|" + "|".join("-" * (widths[k] + 2) for k in keys) + "|"]
    lines += ["| " + " | ".join(str(r.get(k, "")).ljust(widths[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


class Sampler:
    """The stub's resident memory over time (a soak's or benchmark's)."""

    def __init__(self, pid: int, interval_s: float):
        self.pid, self.interval_s = pid, interval_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            try:
                self.samples.append((time.perf_counter() - start, resident_mb(self.pid)))
            except (OSError, StopIteration):
                return

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, float]]:
        self._stop.set()
        self._thread.join()
        return self.samples
