"""Measure the SmolLM2 target on ONNX Runtime (dspark/llm), against llama.cpp where it is installed.

    python tools/bench_llm.py variants   # graph variants: accuracy_level, GQA vs plain-ops attention, rows
    python tools/bench_llm.py head       # the tied Q8_0 head: 8-bit MatMulNBits vs float32 MatMul
    python tools/bench_llm.py context    # per-token cost at context 128/512/2048
    python tools/bench_llm.py batch      # forward_batch of N requests vs N calls
    python tools/bench_llm.py memory     # resident memory: loaded, one request at 2048 tokens
    python tools/bench_llm.py quality    # perplexity and greedy agreement vs llama.cpp (make bench-deps)
    python tools/bench_llm.py speed      # plain greedy tokens/s vs llama.cpp, same GGUF and threads

Each prints a markdown table and writes bench-results/llm-<command>.json with the CPU, the
settings and the raw timings. Timings interleave the compared things within each repeat and
report medians, so a busy machine slows all of them alike.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from dspark.llm.evaluate import greedy, heldout_text, perplexity, runtime_logits, window_nll
from dspark.llm.gguf_model import GGUFModel, installed_smollm2
from dspark.llm.importer import smollm2_dir
from dspark.llm.onnx_runtime import OnnxLlama
from dspark.llm.tokenizer import LlamaTokenizer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench-results"

# Greedy-agreement prompts: chat questions, summarize/rewrite, code, open continuation.
PROMPTS = [
    ("chat", "Why is the sky blue?"),
    ("chat", "What is the difference between a list and a tuple in Python?"),
    ("chat", "Give me three tips for sleeping better."),
    ("summarize", "Summarize in one sentence: The Industrial Revolution began in Britain in the late "
                  "18th century, when new machines changed how goods were made, moving work from homes "
                  "to factories and drawing people from the countryside into growing cities."),
    ("rewrite", "Rewrite this sentence to be more formal: hey, the meeting got moved to friday "
                "cause the boss is out sick."),
    ("rewrite", "Rewrite in the passive voice: The committee approved the new budget on Monday."),
    ("code", "Write a Python function that returns the n-th Fibonacci number iteratively."),
    ("code", "Write a Python function that checks whether a string is a palindrome."),
    ("code", "Complete this Python code:\ndef count_words(text):\n    counts = {}\n"),
    ("continue", "Continue the story: The lighthouse keeper had not seen a ship in forty days, until"),
    ("continue", "Continue: The three most important inventions of the twentieth century are"),
    ("continue", "Continue the recipe: To make a simple tomato sauce, first heat olive oil in a pan,"),
]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def write_results(command: str, settings: dict, rows: list[dict], table: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"llm-{command}.json"
    out.write_text(json.dumps({"command": command, "cpu": cpu_name(), "onnxruntime": ort.__version__,
                               "settings": settings, "rows": rows}, indent=1))
    print(f"CPU: {cpu_name()}; onnxruntime {ort.__version__}; {settings}")
    print(table)
    print(f"(wrote {out.relative_to(ROOT)})")


# Timer of the step benchmarks: wall time, or with --clock cpu the process's CPU time (all its
# threads), which a crowded machine inflates far less (meaningless with spinning threads).
CLOCK = time.perf_counter


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 2)


def _time_rows(runtime: OnnxLlama, cache, context: int, rows: int) -> float:
    """Seconds for one call of ``rows`` new tokens at ``context`` cached tokens (``cache`` was
    filled further; the rows past ``context`` are only scratch for the timing)."""
    cache.length = context
    tokens = np.arange(1000, 1000 + rows)
    start = CLOCK()
    runtime.forward(cache, tokens, context + np.arange(rows))
    return CLOCK() - start


def _prefill(runtime: OnnxLlama, length: int):
    cache = runtime.new_cache()
    tokens = LlamaTokenizer.load(smollm2_dir() / "tokenizer.json").encode(heldout_text() * 2)[:length]
    for start in range(0, length, 512):
        chunk = tokens[start:start + 512]
        runtime.forward(cache, chunk, start + np.arange(len(chunk)), logit_rows=[len(chunk) - 1])
    return cache


class _OpsVariant:
    """The plain-ops attention graph driven directly: the cache goes in whole and comes back whole."""

    def __init__(self, path: Path, threads: int):
        from dspark.runtimes.onnx_session import make_session_options

        self.session = ort.InferenceSession(str(path), make_session_options(threads, 1),
                                            providers=["CPUExecutionProvider"])
        props = self.session.get_modelmeta().custom_metadata_map
        from dspark.llm.gguf_model import LlamaConfig

        self.config = LlamaConfig.from_json(props["dspark_llm_config"])
        self.names = [o.name for o in self.session.get_outputs()]

    def time_rows(self, context: int, rows: int) -> float:
        cfg = self.config
        rng = np.random.default_rng(0)
        past = rng.standard_normal((1, cfg.n_kv_head, context, cfg.head_dim)).astype(np.float32)
        bias = np.zeros((1, 1, rows, context + rows), np.float32)
        bias[0, 0, :, context:] = np.where(np.tri(rows, dtype=bool), 0.0, -np.inf)
        feeds = {"input_ids": np.arange(1000, 1000 + rows)[None], "attention_bias": bias,
                 "position_ids": (context + np.arange(rows))[None], "logit_rows": np.arange(rows),
                 "seqlens_k": np.array([context + rows - 1], np.int32),
                 "query_seqlens": np.array([rows], np.int32)}
        for i in range(cfg.n_layer):
            feeds[f"past_key_{i}"] = feeds[f"past_value_{i}"] = past
        start = CLOCK()
        self.session.run(self.names[:1], feeds)
        return CLOCK() - start


def _build_variants(specs: dict[str, dict], folder: Path) -> dict[str, Path]:
    import onnx

    from dspark.llm.onnx_graph import build_llama_onnx

    model = GGUFModel(installed_smollm2())
    paths = {}
    for name, kwargs in specs.items():
        path = folder / f"{name}.onnx"
        if not path.exists():
            onnx.save(build_llama_onnx(model, **kwargs), str(path))
        paths[name] = path
    return paths


VARIANTS = {
    "gqa_acc4": {"accuracy_level": 4},
    "gqa_acc4_spin": {"accuracy_level": 4},  # the same graph; ORT threads spin between calls
    "gqa_acc1": {"accuracy_level": 1},
    "gqa_acc0": {"accuracy_level": 0},
    "ops_acc4": {"accuracy_level": 4, "attention": "ops"},
}


def cmd_variants(args) -> None:
    rows_list = [int(r) for r in args.rows.split(",")]
    folder = Path(args.keep or tempfile.mkdtemp(prefix="llm-variants-"))
    folder.mkdir(parents=True, exist_ok=True)
    names = args.variants.split(",")
    paths = _build_variants({n: VARIANTS[n] for n in names if not n.endswith("_spin")}, folder)
    runners = {}
    for name in names:
        if VARIANTS[name].get("attention") == "ops":
            ops = _OpsVariant(paths[name], args.threads)
            runners[name] = lambda rows, ops=ops: ops.time_rows(args.context, rows)
        else:
            runtime = OnnxLlama(paths[name.removesuffix("_spin")], threads=args.threads,
                                spinning=name.endswith("_spin"))
            cache = _prefill(runtime, args.context)
            runners[name] = lambda rows, rt=runtime, c=cache: _time_rows(rt, c, args.context, rows)
    samples = {(n, r): [] for n in names for r in rows_list}
    for _ in range(args.repeats):
        for rows in rows_list:
            for name in names:
                samples[(name, rows)].append(runners[name](rows))
    results = [{"variant": n, "rows": r, "ms": _median_ms(samples[(n, r)])} for n in names for r in rows_list]
    table = "| variant | " + " | ".join(f"{r} rows (ms)" for r in rows_list) + " |\n"
    table += "|---|" + "---|" * len(rows_list) + "\n"
    for n in names:
        table += f"| {n} | " + " | ".join(f"{_median_ms(samples[(n, r)])}" for r in rows_list) + " |\n"
    write_results("variants", {"threads": args.threads, "context": args.context, "repeats": args.repeats,
                               "clock": args.clock},
                  results, table)


def cmd_head(args) -> None:
    """The tied Q8_0 head (49152 x 576) alone: 8-bit MatMulNBits vs the dequantized float32 MatMul."""
    from onnx import TensorProto, helper, numpy_helper

    from dspark.runtimes.onnx_session import make_session_options
    from dspark.llm.quant import QK, dequantize, to_nbits

    model = GGUFModel(installed_smollm2())
    w = to_nbits(model.raw("token_embd.weight"), "Q8_0", *model.shape("token_embd.weight"))
    graphs = {
        "MatMulNBits 8-bit, int8 activations": helper.make_node(
            "MatMulNBits", ["x", "q", "s"], ["y"], domain="com.microsoft", K=w.k, N=w.n, bits=8,
            block_size=QK, accuracy_level=4),
        "MatMul float32 (dequantized)": helper.make_node("MatMul", ["x", "wt"], ["y"]),
    }
    inits = {"MatMulNBits 8-bit, int8 activations": [numpy_helper.from_array(w.packed, "q"),
                                                    numpy_helper.from_array(w.scales, "s")],
             "MatMul float32 (dequantized)": [numpy_helper.from_array(np.ascontiguousarray(dequantize(w).T), "wt")]}
    sessions = {}
    for name, node in graphs.items():
        graph = helper.make_graph([node], "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", w.k])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", w.n])], inits[name])
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
        sessions[name] = ort.InferenceSession(proto.SerializeToString(), make_session_options(args.threads, 1),
                                              providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((16, w.k)).astype(np.float32)
    samples: dict[tuple, list[float]] = {}
    for _ in range(args.repeats):
        for rows in (2, 8):
            for name, session in sessions.items():
                start = CLOCK()
                session.run(None, {"x": x[:rows]})
                samples.setdefault((name, rows), []).append(CLOCK() - start)
    results = [{"head": n, "rows": r, "ms": _median_ms(v)} for (n, r), v in samples.items()]
    table = "| head | 2 rows (ms) | 8 rows (ms) | bytes read |\n|---|---|---|---|\n"
    for name in sessions:
        size = w.packed.nbytes + w.scales.nbytes if "NBits" in name else w.n * w.k * 4
        table += f"| {name} | {_median_ms(samples[(name, 2)])} | {_median_ms(samples[(name, 8)])} | {size / 1e6:.0f} MB |\n"
    write_results("head", {"threads": args.threads, "repeats": args.repeats, "clock": args.clock}, results, table)


def cmd_context(args) -> None:
    contexts = [int(c) for c in args.contexts.split(",")]
    runtime = OnnxLlama(smollm2_dir() / "model.onnx", threads=args.threads, max_context=max(contexts) + 64)
    cache = _prefill(runtime, max(contexts))
    folder = Path(args.keep or tempfile.mkdtemp(prefix="llm-variants-"))
    folder.mkdir(parents=True, exist_ok=True)
    ops = _OpsVariant(_build_variants({"ops_acc4": VARIANTS["ops_acc4"]}, folder)["ops_acc4"], args.threads)
    samples: dict[tuple, list[float]] = {}
    for _ in range(args.repeats):
        for context in contexts:
            for rows in (1, 8):
                samples.setdefault(("gqa", context, rows), []).append(_time_rows(runtime, cache, context, rows))
                samples.setdefault(("ops", context, rows), []).append(ops.time_rows(context, rows))
    results = [{"attention": a, "context": c, "rows": r, "ms": _median_ms(v)} for (a, c, r), v in samples.items()]
    table = "| context | GQA 1 row (ms) | GQA 8 rows (ms) | plain ops 1 row (ms) | plain ops 8 rows (ms) |\n|---|---|---|---|---|\n"
    for c in contexts:
        table += (f"| {c} | {_median_ms(samples[('gqa', c, 1)])} | {_median_ms(samples[('gqa', c, 8)])} | "
                  f"{_median_ms(samples[('ops', c, 1)])} | {_median_ms(samples[('ops', c, 8)])} |\n")
    write_results("context", {"threads": args.threads, "repeats": args.repeats, "clock": args.clock},
                  results, table)


def cmd_batch(args) -> None:
    runtime = OnnxLlama(smollm2_dir() / "model.onnx", threads=args.threads, max_batch=max(args.requests))
    caches = [_prefill(runtime, args.context) for _ in range(max(args.requests))]
    samples: dict[tuple, list[float]] = {}
    for _ in range(args.repeats):
        for n in args.requests:
            for rows in (1, 4):
                items = []
                for cache in caches[:n]:
                    cache.length = args.context
                    items.append((cache, np.arange(1000, 1000 + rows), args.context + np.arange(rows), None))
                start = CLOCK()
                runtime.forward_batch(items)
                samples.setdefault(("batched", n, rows), []).append(CLOCK() - start)
                start = CLOCK()
                for cache, tokens, positions, _ in items:
                    cache.length = args.context
                    runtime.forward(cache, tokens, positions)
                samples.setdefault(("separate", n, rows), []).append(CLOCK() - start)
    results = [{"mode": m, "requests": n, "rows": r, "ms": _median_ms(v)} for (m, n, r), v in samples.items()]
    table = ("| requests × rows | one batched call (ms) | separate calls (ms) | speed-up |\n|---|---|---|---|\n")
    for n in args.requests:
        for rows in (1, 4):
            b, s = _median_ms(samples[("batched", n, rows)]), _median_ms(samples[("separate", n, rows)])
            table += f"| {n} × {rows} | {b} | {s} | {s / b:.2f}x |\n"
    write_results("batch", {"threads": args.threads, "context": args.context, "repeats": args.repeats,
                            "clock": args.clock},
                  results, table)


def cmd_memory(args) -> None:
    """Resident memory of a fresh process: the runtime loaded, then one request at ``context``."""
    code = f"""
import json, os, sys
sys.path.insert(0, {str(ROOT / 'tools')!r})
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
base = rss()
from dspark.llm.importer import smollm2_dir
from dspark.llm.onnx_runtime import OnnxLlama
from bench_llm import _prefill
imported = rss()
runtime = OnnxLlama(smollm2_dir() / "model.onnx", threads={args.threads}, max_context={args.context})
loaded = rss()
cache = _prefill(runtime, {args.context} - 1)
runtime.forward(cache, [5], [{args.context} - 1])
print(json.dumps({{"python": base, "imports": imported, "loaded": loaded, "one_request": rss()}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    cfg_bytes = 30 * 2 * 3 * 64 * 4 * args.context
    table = ("| stage | resident MB |\n|---|---|\n" + "".join(
        f"| {k} | {v / 1e6:.0f} |\n" for k, v in rss.items()) +
        f"\nKV cache of one request at {args.context} tokens (float32): {cfg_bytes / 1e6:.0f} MB\n")
    write_results("memory", {"threads": args.threads, "context": args.context}, [rss], table)


def _advertises_amx() -> bool:
    return "amx_tile" in Path("/proc/cpuinfo").read_text()


def _llama(args, logits_all: bool):
    """llama.cpp on the same GGUF and thread count. Where the CPU advertises AMX, llama.cpp's
    extra buffer types (its AMX and repacked-weight kernels) are turned off: in this VM the AMX
    tile instructions fault (SIGILL in ggml_backend_amx_mul_mat) although the kernel grants the
    permission, so the usable llama.cpp here is the one without them."""
    try:
        import llama_cpp
        from llama_cpp import Llama
    except ImportError:
        sys.exit("llama-cpp-python is not installed: make bench-deps")
    extra = args.llama_extra_bufts if args.llama_extra_bufts is not None else not _advertises_amx()
    args.llama_extra_bufts = extra  # recorded with the results
    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def model_params():
        params = defaults()
        params.use_extra_bufts = extra
        return params

    llama_cpp.llama_cpp.llama_model_default_params = model_params
    try:
        return Llama(model_path=str(installed_smollm2()), n_ctx=args.n_ctx, n_threads=args.threads,
                     n_threads_batch=args.threads, n_batch=512, logits_all=logits_all, verbose=False)
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = defaults


def _llama_tokens(llm, text: str) -> list[int]:
    return llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)


def _llama_greedy(llm, prompt: list[int], max_new: int, eos_id: int) -> list[int]:
    llm.reset()
    llm.eval(prompt)
    out: list[int] = []
    while len(out) < max_new:
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(token)
        if token == eos_id or len(out) == max_new:
            break
        llm.eval([token])
    return out


def _chat(tokenizer: LlamaTokenizer, text: str) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": text}])


def cmd_quality(args) -> None:
    folder = Path(args.folder) if args.folder else smollm2_dir()
    tokenizer = LlamaTokenizer.load(folder / "tokenizer.json")
    runtime = OnnxLlama(folder / "model.onnx", threads=args.threads, max_context=max(args.window, 256))
    llm = _llama(args, logits_all=True)
    tokens = tokenizer.encode(heldout_text())[:args.tokens]
    same_tokens = _llama_tokens(llm, heldout_text())[:args.tokens] == tokens

    def llama_logits(window):
        llm.reset()
        llm.eval(window)
        return np.array(llm.scores[:len(window)], np.float32)

    ours = perplexity(runtime_logits(runtime), tokens, args.window)
    theirs = perplexity(llama_logits, tokens, args.window)
    first = tokens[:args.window]
    ref_window = {"ours": float(np.exp(window_nll(runtime_logits(runtime)(first), first).mean())),
                  "llama.cpp": float(np.exp(window_nll(llama_logits(first), first).mean()))}
    agreement = []
    for kind, text in PROMPTS:
        prompt = _chat(tokenizer, text)
        a = greedy(runtime, prompt, args.new_tokens, tokenizer.eos_id)
        b = _llama_greedy(llm, prompt, args.new_tokens, tokenizer.eos_id)
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agreement.append({"kind": kind, "prompt": text, "identical": a == b, "common_prefix": same,
                          "ours": tokenizer.decode(a), "llama.cpp": tokenizer.decode(b)})
    identical = sum(r["identical"] for r in agreement)
    rows = [{"perplexity_ours": ours, "perplexity_llama_cpp": theirs, "tokens": len(tokens),
             "window": args.window, "tokenizer_ids_identical": same_tokens, "first_window": ref_window,
             "greedy": agreement}]
    table = (f"| | ours (ORT) | llama.cpp | ratio |\n|---|---|---|---|\n"
             f"| perplexity, {len(tokens)} tokens of CPython docs, windows of {args.window} | {ours:.3f} | "
             f"{theirs:.3f} | {ours / theirs:.4f} |\n"
             f"| greedy, first {args.new_tokens} tokens identical | {identical} of {len(PROMPTS)} prompts | | |\n"
             f"| greedy, mean common prefix | {np.mean([r['common_prefix'] for r in agreement]):.1f} tokens | | |\n"
             f"\nTokenizer ids identical to llama.cpp's on the whole text: {same_tokens}. First window "
             f"perplexity (the unit test's reference): ours {ref_window['ours']:.3f}, llama.cpp "
             f"{ref_window['llama.cpp']:.3f}.\n")
    for r in agreement:
        if not r["identical"]:
            table += f"\n- {r['kind']}: differ after {r['common_prefix']} tokens"
    write_results("quality", {"threads": args.threads, "new_tokens": args.new_tokens, "folder": str(folder),
                              "llama_extra_bufts": args.llama_extra_bufts}, rows, table)


def cmd_speed(args) -> None:
    folder = smollm2_dir()
    tokenizer = LlamaTokenizer.load(folder / "tokenizer.json")
    runtime = OnnxLlama(folder / "model.onnx", threads=args.threads, max_context=1024,
                        spinning=args.spinning)
    llm = _llama(args, logits_all=False)
    prompts = [_chat(tokenizer, text) for _, text in PROMPTS[:args.prompts]]
    samples: dict[str, list[float]] = {"ours": [], "llama.cpp": []}
    decode: dict[str, list[float]] = {"ours": [], "llama.cpp": []}
    counts: dict[str, int] = {"ours": 0, "llama.cpp": 0}

    def run(name, prompt):
        start = time.perf_counter()
        if name == "ours":
            cache = runtime.new_cache(len(prompt) + args.new_tokens)
            logits = runtime.forward(cache, prompt, np.arange(len(prompt)), logit_rows=[len(prompt) - 1])
            first = time.perf_counter()
            token, n = int(np.argmax(logits[-1])), 1
            while n < args.new_tokens:
                logits = runtime.forward(cache, [token], [len(prompt) + n - 1])
                token, n = int(np.argmax(logits[-1])), n + 1
        else:
            llm.reset()
            llm.eval(prompt)
            first = time.perf_counter()
            token, n = int(np.argmax(llm.scores[llm.n_tokens - 1])), 1
            while n < args.new_tokens:
                llm.eval([token])
                token, n = int(np.argmax(llm.scores[llm.n_tokens - 1])), n + 1
        end = time.perf_counter()
        samples[name].append(n / (end - start))
        decode[name].append((n - 1) / (end - first))
        counts[name] += n

    for _ in range(args.repeats):
        for prompt in prompts:
            for name in ("ours", "llama.cpp"):
                run(name, prompt)
    med = {k: statistics.median(v) for k, v in samples.items()}
    dec = {k: statistics.median(v) for k, v in decode.items()}
    rows = [{"runtime": k, "tokens_per_s_with_prompt": med[k], "decode_tokens_per_s": dec[k],
             "samples": samples[k], "decode_samples": decode[k]} for k in samples]
    table = ("| runtime | decode tokens/s | with prompt tokens/s |\n|---|---|---|\n"
             + "".join(f"| {k} | {dec[k]:.1f} | {med[k]:.1f} |\n" for k in samples)
             + f"| ratio ours / llama.cpp | {dec['ours'] / dec['llama.cpp']:.2f}x | "
               f"{med['ours'] / med['llama.cpp']:.2f}x |\n")
    write_results("speed", {"threads": args.threads, "new_tokens": args.new_tokens, "prompts": len(prompts),
                            "repeats": args.repeats, "ort_spinning": args.spinning,
                            "llama_extra_bufts": args.llama_extra_bufts}, rows, table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="step timings in wall time or in the process's CPU time")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("variants")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rows", default="1,4,8,16")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--keep", help="folder for the variant graphs (kept for the next run)")
    p = sub.add_parser("head")
    p.add_argument("--repeats", type=int, default=7)
    p = sub.add_parser("context")
    p.add_argument("--contexts", default="128,512,2048")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--keep", help="folder for the variant graphs (kept for the next run)")
    p = sub.add_parser("batch")
    p.add_argument("--requests", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7)
    p = sub.add_parser("memory")
    p.add_argument("--context", type=int, default=2048)
    p = sub.add_parser("quality")
    p.add_argument("--folder", help="an import other than the demo's (e.g. one made with --accuracy-level 1)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--n-ctx", type=int, default=1024)
    p.add_argument("--llama-extra-bufts", type=lambda v: v == "on", choices=[True, False], default=None,
                   metavar="on|off", help="llama.cpp's extra buffer types (default: off where the CPU advertises AMX)")
    p = sub.add_parser("speed")
    p.add_argument("--spinning", action="store_true", help="let ORT's threads spin between calls")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--n-ctx", type=int, default=1024)
    p.add_argument("--llama-extra-bufts", type=lambda v: v == "on", choices=[True, False], default=None,
                   metavar="on|off", help="llama.cpp's extra buffer types (default: off where the CPU advertises AMX)")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    {"variants": cmd_variants, "head": cmd_head, "context": cmd_context, "batch": cmd_batch, "memory": cmd_memory,
     "quality": cmd_quality, "speed": cmd_speed}[args.command](args)


if __name__ == "__main__":
    main()
