"""`bench spec`, in process: the held-out prompts, the settings, and every method run on every
prompt with methods interleaved per prompt (see dspark/bench/spec.py for the whole benchmark)."""
from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from dspark.bench.jsonfile import read_json
from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.decoding.stats import DecodeStats
from dspark.decoding.text import Detokenizer, TextGenerator


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
    data = read_json(path, "prompts")["prompts"]
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
                                              engine.eos_ids, batch_verification=True,
                                              grammars=engine.grammars),
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


