"""Benchmark of dspark's llama kernels (dspark.llm.kernel_runtime) on SmolLM2-135M-Instruct or
another GGUF (--gguf: a .gguf file or an imported model's folder, e.g. the demo's Gemma 3 270M
Q4_K_M in model_repository/gemma_lm/1/model).

  python tools/bench_llm_kernel.py [--gguf PATH] [--threads 2] [--json out.json]

Prints markdown tables (docs/llm_kernels.md quotes them) and writes the numbers, the settings
and the CPU model as JSON:
  1. step cost: one decoder step at a cached context of 128/512/2048 rows, for 1 new row
     (plain decoding) and 2/4/8/16 new rows (verification; every row gets logits), medians of
     interleaved repeats, and each relative to 1 row;
  2. plain greedy decoding tokens/s after a chat prompt: dspark's kernels and llama.cpp
     (llama-cpp-python, `make bench-deps`) with the same threads; the peer is skipped, with a
     note, when not installed;
  3. greedy agreement with llama.cpp: 32 tokens on 12 prompts;
  4. resident memory of a process holding the model and one 2048-row cache filled by a prompt.
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from itertools import product
from pathlib import Path

import numpy as np

PROMPTS = [  # 12 prompts, 4 kinds (chat question, rewrite, code, open continuation)
    "Why is the sky blue?",
    "What is the capital of Australia, and why was it chosen?",
    "Give me three tips for sleeping better.",
    "Rewrite more formally: hey, can u send me the report by tmrw? thx",
    "Summarize in one sentence: The meeting was moved from Tuesday to Thursday because the "
    "projector in room 4 broke and the replacement arrives on Wednesday.",
    "Rewrite as a haiku: the train was late again this morning.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a SQL query that counts orders per customer in a table orders(customer_id, id).",
    "Complete this Python code:\ndef is_palindrome(s):\n",
    "Continue the story: The lighthouse keeper found a letter in a bottle.",
    "Continue: The three most important inventions of the 20th century are",
    "Explain recursion to a ten-year-old.",
]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def product_matrices(weights) -> dict:
    """The first layer's matrix of each block type (in L2) and the head (read from memory)."""
    picked = {}
    for key in ("blk.0.ffn_gate", "blk.0.attn_q", "blk.0.attn_v", "blk.0.attn_output", "blk.0.ffn_down", "head"):
        matrix = weights[key]
        if key == "head" or matrix.fmt not in {m.fmt for m in picked.values()}:
            picked[f"{matrix.fmt} {matrix.n}x{matrix.k} ({key.removeprefix('blk.0.')})"] = matrix
    return picked


def products(rt, weights, rows_list, repeats, clock) -> dict:
    """Median ms of single products (no norm) of product_matrices(), for each row count."""
    rng = np.random.default_rng(1)
    out = {}
    for name, matrix in product_matrices(weights).items():
        for rows in rows_list:
            hidden = rng.standard_normal((rows, matrix.k)).astype(np.float32)
            logits = np.empty((rows, matrix.n), np.float32)
            times = []
            for _ in range(max(repeats, int(3e8 / matrix.data.nbytes))):
                t0 = clock()
                rt._model.project(hidden, logits, matrix, False)
                times.append(clock() - t0)
            ms = 1e3 * float(np.median(times))
            out[f"{name}/{rows}"] = {"ms": ms, "gmac_s": matrix.n * matrix.k * rows / ms / 1e6,
                                     "gb_s": matrix.data.nbytes / ms / 1e6}
    return out


def step_costs(runtimes: dict, contexts, rows_list, repeats, clock=time.perf_counter) -> dict:
    """Median ms of one step of `rows` new rows at each cached context, per runtime, all
    configurations interleaved in each repeat."""
    rng = np.random.default_rng(0)
    caches = {}
    for name, rt in runtimes.items():
        for ctx in contexts:
            cache = rt.new_cache(ctx + max(rows_list))
            for start in range(0, ctx, 512):  # the prompt in chunks of 512 rows
                n = min(512, ctx - start)
                rt.forward(cache, rng.integers(0, rt.config.vocab, n), np.arange(start, start + n),
                           logit_rows=[n - 1])
            caches[name, ctx] = cache
    times: dict = {key: [] for key in product(runtimes, contexts, rows_list)}
    for _ in range(repeats):
        for name, ctx, rows in times:
            cache = caches[name, ctx]
            tokens = rng.integers(0, runtimes[name].config.vocab, rows)
            t0 = clock()
            runtimes[name].forward(cache, tokens, np.arange(ctx, ctx + rows))
            times[name, ctx, rows].append(clock() - t0)
            cache.truncate(ctx)
    return {name: {f"{ctx}/{rows}": 1e3 * float(np.median(times[name, ctx, rows]))
                   for ctx in contexts for rows in rows_list} for name in runtimes}


class KernelPeer:
    name = "dspark kernels"

    def __init__(self, rt):
        self.rt = rt

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], float]:
        cache = self.rt.new_cache(len(prompt) + n)
        logits = self.rt.forward(cache, prompt, np.arange(len(prompt)), logit_rows=[len(prompt) - 1])
        out = [int(logits[-1].argmax())]
        t0 = time.perf_counter()
        while len(out) < n:
            logits = self.rt.forward(cache, [out[-1]], [cache.length])
            out.append(int(logits[0].argmax()))
        return out, (n - 1) / (time.perf_counter() - t0)


class LlamaCppPeer:
    name = "llama.cpp"

    def __init__(self, path: Path, threads: int, extra_buffers: bool):
        from dspark.bench.peers import llama_cpp

        self.llm = llama_cpp.load(path, threads, extra_buffers=extra_buffers)
        self._greedy = llama_cpp.greedy

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], float]:
        return self._greedy(self.llm, prompt, n)


def resident_memory(gguf: Path, threads: int, context: int) -> dict:
    """In a fresh process: RSS after loading the model and filling one `context`-row cache."""
    code = f"""
import json, numpy as np
from dspark.llm.kernel_runtime import KernelRuntime
def rss(field='VmRSS'):  # VmHWM: this process's peak (ru_maxrss keeps the parent's across exec)
    for line in open('/proc/self/status'):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
rt = KernelRuntime({str(gguf)!r}, threads={threads}, max_context={context})
loaded = rss()
cache = rt.new_cache({context})
rng = np.random.default_rng(0)
for start in range(0, {context} - 1, 512):
    n = min(512, {context} - 1 - start)
    rt.forward(cache, rng.integers(0, rt.config.vocab, n), np.arange(start, start + n), logit_rows=[n - 1])
rt.forward(cache, [1], [cache.length])
print(json.dumps({{"model_loaded_mb": loaded, "with_cache_mb": rss(),
                  "peak_mb": rss('VmHWM'),
                  "cache_mb": cache.nbytes / 2**20, "cache_rows": cache.length}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_products(products_: dict, rows_list) -> None:
    print("| product | " + " | ".join(f"{r} rows" for r in rows_list) + " |")
    print("|---|" + "---|" * len(rows_list))
    for name in dict.fromkeys(k.rsplit("/", 1)[0] for k in products_):
        cells = [products_[f"{name}/{r}"] for r in rows_list]
        print(f"| {name} | " + " | ".join(f"{c['ms']:.3f} ms, {c['gmac_s']:.0f} GMAC/s, {c['gb_s']:.1f} GB/s"
                                         for c in cells) + " |")
    print()


def print_steps(step_ms: dict, contexts, rows_list) -> None:
    for name, costs in step_ms.items():
        print(f"{name}:\n")
        print("| cached rows | 1 row: ms (tokens/s) | " + " | ".join(f"{r} rows" for r in rows_list[1:]) + " |")
        print("|---|---|" + "---|" * (len(rows_list) - 1))
        for ctx in contexts:
            one = costs[f"{ctx}/1"]
            cells = [f"{costs[f'{ctx}/{r}']:.2f} ms ({costs[f'{ctx}/{r}'] / one:.2f}x)" for r in rows_list[1:]]
            print(f"| {ctx} | {one:.2f} ({1e3 / one:.0f}) | " + " | ".join(cells) + " |")
        print()


def decode_rates(peers: list, prompt: list[int], tokens: int, repeats: int) -> dict:
    """Median plain greedy decoding tokens/s per peer, the peers interleaved in each repeat; printed."""
    rates = {p.name: [] for p in peers}
    for _ in range(repeats):
        for peer in peers:
            rates[peer.name].append(peer.greedy(prompt, tokens)[1])
    medians = {k: float(np.median(v)) for k, v in rates.items()}
    base = medians.get("llama.cpp")
    print(f"| plain greedy decoding, {tokens} tokens after a chat prompt | tokens/s |"
          + (" vs llama.cpp |" if base else ""))
    print("|---|---|" + ("---|" if base else ""))
    for name, rate in medians.items():
        print(f"| {name} | {rate:.1f} |" + (f" {rate / base:.2f}x |" if base else ""))
    print()
    return medians


def greedy_agreement(peers: list, prompts: list[list[int]]) -> dict:
    """32 greedy tokens per prompt from every peer against the last one's: identical outputs and
    the first difference; printed."""
    outputs = {p.name: [p.greedy(prompt, 32)[0] for prompt in prompts] for p in peers}
    ref = outputs[peers[-1].name]
    agreement = {}
    print(f"| greedy, 32 tokens, 12 prompts, vs {peers[-1].name} | identical | first difference at (mean) |")
    print("|---|---|---|")
    for name, outs in outputs.items():
        if name == peers[-1].name:
            continue
        first = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), 32) for o, r in zip(outs, ref)]
        same = sum(f == 32 for f in first)
        agreement[name] = {"identical": same, "first_difference": first}
        print(f"| {name} | {same}/12 | {np.mean(first):.1f} |")
    print()
    return agreement


def print_memory(mem: dict) -> None:
    print("| resident memory | MB |\n|---|---|")
    print(f"| model loaded | {mem['model_loaded_mb']:.0f} |")
    print(f"| + one {mem['cache_rows']}-row cache, filled ({mem['cache_mb']:.0f} MB of keys/values) | "
          f"{mem['with_cache_mb']:.0f} |")
    print(f"| peak (loading, the prompt's scratch) | {mem['peak_mb']:.0f} |\n")


def run_llm_kernels_bench(args) -> None:
    """The command's work; ``args`` holds its options as attributes (dspark/cli builds it)."""

    from dspark._ext import llama as ext
    from dspark.llm.gguf_model import GGUFModel, installed_smollm2
    from dspark.llm.importer import import_source
    from dspark.llm.kernel_runtime import KernelRuntime
    from dspark.llm.tokenizer import LlamaTokenizer

    gguf_path = installed_smollm2() if args.gguf is None else (
        args.gguf if args.gguf.suffix == ".gguf" else import_source(args.gguf))
    model = GGUFModel(gguf_path)
    rt = KernelRuntime(model, threads=args.threads, max_context=max(args.contexts) + max(args.rows) + 64)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    result = {"cpu": cpu_name(), "isa": rt.isa, "threads": rt.threads, "model": gguf_path.name,
              "settings": vars(args) | {"json": str(args.json) if args.json else None, "gguf": str(gguf_path)},
              "isa_info": ext.isa_info()}
    print(f"# {gguf_path.name} on {result['cpu']}, {rt.threads} threads, kernels: {rt.isa}, "
          f"clock: {args.clock}\n")

    if "products" not in args.skip:
        result["products"] = products(rt, rt.weights, args.rows, args.repeats, clock)
        print_products(result["products"], args.rows)

    if "steps" not in args.skip:
        result["step_ms"] = step_costs({"dspark kernels": rt}, args.contexts, args.rows, args.repeats, clock)
        print_steps(result["step_ms"], args.contexts, args.rows)

    tokenizer = LlamaTokenizer.from_gguf(model)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    peers = [KernelPeer(rt)]
    notes = []
    try:
        peers.append(LlamaCppPeer(gguf_path, args.threads, args.llama_extra_buffers))
    except ImportError:
        notes.append("llama.cpp: llama-cpp-python is not installed (make bench-deps)")

    if "decode" not in args.skip:
        result["decode_tokens_per_s"] = decode_rates(peers, prompts[0], args.decode_tokens, args.decode_repeats)
    if "agreement" not in args.skip and len(peers) > 1:
        result["agreement"] = greedy_agreement(peers, prompts)
    if "memory" not in args.skip:
        result["memory"] = resident_memory(gguf_path, args.threads, 2048)
        print_memory(result["memory"])

    for note in notes:
        print("note:", note)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
