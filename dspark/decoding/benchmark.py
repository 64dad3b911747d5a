"""Speculative decoding benchmark: plain decoding against every method on the same held-out
prompts, in process and through a running server (``dspark bench spec``)."""
from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from dspark.decoding.corpus import split_documents
from dspark.decoding.stats import DecodeStats
from dspark.decoding.lm import OnnxLM
from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.decoding.text import TextGenerator

METHODS: dict[str, SpeculativeParams] = {
    "none": SpeculativeParams("none"),
    "draft": SpeculativeParams("draft", num_speculative_tokens=6),
    "draft_k4_fixed": SpeculativeParams("draft", num_speculative_tokens=4, adaptive=False),
    "draft_ort": SpeculativeParams("draft", num_speculative_tokens=6),  # draft run by ORT
    "ngram": SpeculativeParams("ngram", num_speculative_tokens=6),
    "hybrid": SpeculativeParams("hybrid", num_speculative_tokens=6),
    "tree_w2": SpeculativeParams("tree", num_speculative_tokens=4, tree_width=2),
    "tree": SpeculativeParams("tree", num_speculative_tokens=4, tree_width=4),
}


@dataclass
class Prompt:
    category: str
    text: str


def heldout_prompts(per_category: int = 4) -> list[Prompt]:
    """Prompts from documents the LM pair never saw, in Spec-Bench-like categories:
    input-grounded (continue a given passage; revise a given function, which re-states it) and
    free generation (prose, code)."""
    _, held = split_documents()
    prose = [d.text for d in held if d.kind == "prose"]
    code = [d.text for d in held if d.kind == "code" and len(d.text) > 3000]
    out: list[Prompt] = []

    def cut(text: str, start: int, length: int) -> str:
        begin = text.find("\n", start) + 1
        end = text.rfind("\n", begin, begin + length)
        return text[begin:end + 1]

    for i in range(per_category):
        doc = code[i % len(code)]
        out.append(Prompt("continue", cut(doc, len(doc) // 3, 900)))
    for i in range(per_category):
        doc = code[(i + per_category) % len(code)]
        start = doc.find("\ndef ", len(doc) // 4)
        func = cut(doc, max(start, 0), 700)
        head = "".join(func.splitlines(keepends=True)[:2])
        out.append(Prompt("revise", f"{func}\n\n# The same function, revised:\n{head}"))
    for i in range(per_category):
        doc = prose[i % len(prose)]
        out.append(Prompt("prose", cut(doc, (i // len(prose)) * 1500, 300)))
    for i in range(per_category):
        doc = code[(i + 2 * per_category) % len(code)]
        start = doc.find("\n    def ", len(doc) // 2)
        out.append(Prompt("code", cut(doc, max(start, 0), 160)))
    return out


def distinct_8gram_share(tokens: list[int]) -> float:
    grams = [tuple(tokens[i:i + 8]) for i in range(len(tokens) - 7)]
    return len(set(grams)) / len(grams) if grams else 1.0


@dataclass
class MethodResult:
    method: str
    per_token_ms: list[float] = field(default_factory=list)
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    draft_s: float = 0.0
    target_s: float = 0.0
    distinct_8grams: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    prompt_seconds: list[float] = field(default_factory=list)
    prefill_s: float = 0.0  # the target reading the prompts; not in ``seconds``

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def seconds(self) -> float:
        """Decoding time over all prompts (each prompt's median run)."""
        return sum(self.prompt_seconds)

    @property
    def end_to_end_tokens_per_s(self) -> float:
        """With the prompt prefill, as a client of the server sees it."""
        return self.tokens / (self.seconds + self.prefill_s) if self.seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def row(self, plain: "MethodResult | None", identical: str) -> dict:
        ms = self.per_token_ms or [float("nan")]
        return {
            "method": self.method, "tokens/s": round(self.tokens_per_s, 1),
            "x plain": round(self.tokens_per_s / plain.tokens_per_s, 2) if plain else 1.0,
            "ms/tok p50": round(float(np.percentile(ms, 50)), 2),
            "ms/tok p99": round(float(np.percentile(ms, 99)), 2),
            "accept": round(self.accepted / self.proposed, 2) if self.proposed else None,
            "tok/pass": round(self.tokens / self.rounds, 2) if self.rounds else None,
            "draft %": round(100 * self.draft_s / self.seconds, 1) if self.seconds else None,
            "target %": round(100 * self.target_s / self.seconds, 1) if self.seconds else None,
            "distinct 8g": round(statistics.mean(self.distinct_8grams), 2) if self.distinct_8grams else None,
            "identical": identical,
        }


def run_one(gen: TextGenerator, prompt: str, sampling: SamplingParams, spec: SpeculativeParams):
    """(tokens, seconds, per-token ms, stats) of one generation, timed round by round."""
    stats = DecodeStats()
    ids = gen.tokenizer.encode(prompt)
    tokens, per_token = [], []
    start = last = time.perf_counter()
    for new in gen.engine.generate(ids, sampling, spec, stats):
        now = time.perf_counter()
        spent = now - last - (stats.prefill_s if last == start else 0.0)
        per_token += [spent * 1e3 / len(new)] * len(new)
        last = now
        tokens += new
    # decoding time: the prompt's prefill by the target is the same work for every method
    return tokens, time.perf_counter() - start - stats.prefill_s, per_token, stats


def run_inprocess(gen: TextGenerator, prompts: list[Prompt], methods: dict[str, SpeculativeParams],
                  sampling: SamplingParams, repeats: int = 3,
                  generators: dict[str, TextGenerator] | None = None) -> dict[str, MethodResult]:
    """Every method on every prompt; methods interleaved per prompt so machine noise hits all
    alike; each prompt's time is the median of ``repeats``. ``generators`` gives some methods
    another generator (e.g. the same models with the draft on ORT)."""
    results = {name: MethodResult(name) for name in methods}
    generators = generators or {}
    for prompt in prompts:
        for name, spec in methods.items():
            method_gen = generators.get(name, gen)
            runs = [run_one(method_gen, prompt.text, sampling, spec) for _ in range(repeats)]
            runs.sort(key=lambda r: r[1])
            tokens, seconds, per_token, stats = runs[len(runs) // 2]
            r = results[name]
            r.per_token_ms += per_token
            r.proposed += stats.proposed
            r.accepted += stats.accepted
            r.rounds += stats.rounds
            r.draft_s += stats.draft_s
            r.target_s += stats.target_s
            r.prefill_s += stats.prefill_s
            r.distinct_8grams.append(distinct_8gram_share(tokens))
            r.outputs.append(tokens)
            r.prompt_seconds.append(seconds)
    return results


def cost_profile(gen: TextGenerator, context: int = 300, repeats: int = 60,
                 ort_draft: OnnxLM | None = None) -> dict:
    """Median ms of one target/draft call at a given context: 1 row, k+1 rows, a w4 x 4 tree
    (``ort_draft``: the same draft on ORT, for comparison)."""
    def timed(lm, rows: int) -> float:
        cache = lm.new_cache()
        lm.forward(cache, np.zeros(context, np.int64), np.arange(context))
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            lm.forward(cache, np.zeros(rows, np.int64), np.arange(context, context + rows))
            times.append(time.perf_counter() - t)
            cache.truncate(context)
        return statistics.median(times) * 1e3

    out = {"context": context, "target_1": timed(gen.engine.target, 1),
           "target_5": timed(gen.engine.target, 5), "target_17": timed(gen.engine.target, 17)}
    draft = gen.engine.proposers.get("draft")
    if draft is not None:
        out["draft_1"] = timed(draft.lm, 1)
        out["draft_4"] = timed(draft.lm, 4)
    if ort_draft is not None:
        out["draft_1_ort"] = timed(ort_draft, 1)
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def run_server(grpc_url: str, model: str, prompts: list[Prompt], spec: dict, max_tokens: int,
               concurrency: int, tokens_per_prompt: list[int]) -> dict:
    """Stream each prompt through gRPC at a concurrency (wall time includes the prompt's
    prefill); tokens counted from the in-process run of the same greedy method (identical
    outputs)."""
    import queue

    import tritonclient.grpc as grpcclient

    def one(i: int) -> tuple[float, str]:
        results: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(grpc_url)
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        sampling = json.dumps({"max_tokens": max_tokens, "speculative": spec})
        inputs = []
        for name, value, dtype in (("text_input", prompts[i].text.encode(), "BYTES"),
                                   ("sampling_parameters", sampling.encode(), "BYTES"),
                                   ("stream", True, "BOOL")):
            tensor = grpcclient.InferInput(name, [1], dtype)
            tensor.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else np.bool_))
            inputs.append(tensor)
        start = time.perf_counter()
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        text = []
        while True:
            result, error = results.get(timeout=600)
            if error is not None:
                raise RuntimeError(str(error))
            response = result.get_response()
            if response.outputs:
                text.append(result.as_numpy("text_output")[0].decode())
            if response.parameters["triton_final_response"].bool_param:
                break
        seconds = time.perf_counter() - start
        client.stop_stream()
        client.close()
        return seconds, "".join(text)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(one, range(len(prompts))))
    wall = time.perf_counter() - start
    tokens = sum(tokens_per_prompt)
    return {"concurrency": concurrency, "tokens/s": round(tokens / wall, 1),
            "mean request s": round(statistics.mean(s for s, _ in done), 2),
            "texts": [t for _, t in done]}


def format_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(str(r.get(k, ""))) for r in rows)) for k in keys}
    lines = ["| " + " | ".join(k.ljust(widths[k]) for k in keys) + " |",
             "|" + "|".join("-" * (widths[k] + 2) for k in keys) + "|"]
    lines += ["| " + " | ".join(str(r.get(k, "")).ljust(widths[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def summary_rows(results: dict[str, MethodResult], check_identical: bool) -> list[dict]:
    plain = results.get("none")
    rows = []
    for name, r in results.items():
        identical = "-"
        if check_identical and plain is not None:
            same = sum(a == b for a, b in zip(r.outputs, plain.outputs))
            identical = f"{same}/{len(plain.outputs)}"
        rows.append(r.row(plain, identical))
    return rows


def category_rows(results: dict[str, MethodResult], prompts: list[Prompt]) -> list[dict]:
    """tokens/s per category as a ratio to plain decoding of the same prompts, same run."""
    cats = list(dict.fromkeys(p.category for p in prompts))
    plain = results["none"]

    def rate(r: MethodResult, c: str) -> float:
        idx = [i for i, p in enumerate(prompts) if p.category == c]
        return sum(len(r.outputs[i]) for i in idx) / sum(r.prompt_seconds[i] for i in idx)

    return [{"method": name, **{c: round(rate(r, c) / rate(plain, c), 2) for c in cats}}
            for name, r in results.items()]
