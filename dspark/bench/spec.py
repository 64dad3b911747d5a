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

import statistics
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from dspark.bench.jsonfile import read_json
from dspark.bench.peers import llama_cpp
from dspark.bench.resources import resident_mib
from dspark.bench.results import BenchResult, Metric
from dspark.bench.table import Column
from dspark.bench.spec_inprocess import (ACCEPTANCE, BenchPrompt, GREEDY, KINDS, MEMORY, MethodResult,
                                         SAMPLED, SAMPLED_SEED, SAMPLED_TEMPERATURE, SpecBenchSettings,
                                         WARM_UP, batching_rows, decode_rate, distinct_char_8gram_share,
                                         kind_rows, kv_bytes_per_token, load_prompts, prompt_ids,
                                         run_inprocess, samples, summary_rows)
from dspark.bench.spec_served import run_served, served_rows, stub_pid
from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.errors import ConfigError


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
    from dspark.triton.models import llm_generator
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
        ref = read_json(project_root() / "tests" / "data" / ref_file, "reference")
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
    ref_note = read_json(project_root() / "tests" / "data" / QUALITY_MODELS[0][1], "reference")
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
    from dspark.server.launcher import TritonServer

    server = TritonServer(repositories=demo_repositories(), model_control="explicit", load_models=models)
    server.start()
    try:
        for model in models:
            run_served(server.grpc_url, [BenchPrompt("warm-up", True, WARM_UP)], {"max_tokens": 16}, 1, model)
        return {model: resident_mib(stub_pid(server._process.pid, model)) for model in models}
    finally:
        server.stop()
