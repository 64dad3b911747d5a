"""DSpark on the real target, in process: tokens/s against plain decoding in the same run,
accepted tokens per target pass, per-position acceptance of the block drafter, on held-out
prompts (dspark.training.prompts.heldout_prompts: documents and questions the drafter never
trained on). Writes JSON (settings, CPU, per-method results) and prints a markdown table.

    python tools/bench_dspark.py --max-tokens 96 --out bench-results/dspark.json

The target runs on dspark's C kernels over the GGUF (KernelRuntime, the served target); the
drafter on its kernels (served) or on its numpy reference (``--drafter-backend numpy``).

Methods are interleaved per prompt (noise hits all alike); each prompt's time is the median of
``--repeats`` runs; tokens/s counts decoding only (the prompt's prefill is the same work for
every method and is reported apart).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from dspark.drafters.dspark.model import BACKENDS, DSparkDrafter, default_weights
from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.proposers import standard_proposers
from dspark.decoding.proposers.dspark import DSparkProposer
from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.decoding.stats import DecodeStats
from dspark.llm.gguf_model import GGUFModel, installed_smollm2
from dspark.llm.kernel_runtime import KernelRuntime
from dspark.llm.tokenizer import LlamaTokenizer
from dspark.bench.machine import this_machine
from dspark.paths import project_root


def distinct_8gram_share(texts: list[str]) -> float:
    grams = [t[i:i + 8] for t in texts for i in range(max(len(t) - 7, 0))]
    return len(set(grams)) / len(grams) if grams else 0.0


def pass_costs(target, drafter, ids: list[int], k: int, repeats: int = 21) -> dict:
    """Median wall milliseconds of the passes a DSpark round is made of, on one prompt: the target
    over 1 and k + 1 new rows, the drafter's block of k (backbone, Markov head, confidences)
    (also right after a target step) and its context extension by 1 and 3 rows. They say what
    acceptance DSpark needs to pay."""
    cache = target.new_cache(len(ids) + k + 8)
    n = len(ids)
    _, taps = target.forward(cache, ids, np.arange(n), want_taps=True)
    ctx = drafter.new_context(n + k + 8)
    drafter.extend(ctx, taps[:n - 1])

    def median(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def target_rows(rows: int):
        def run():
            target.forward(cache, [ids[-1]] * rows, np.arange(n, n + rows))
            cache.truncate(n)
        return run

    def extend(rows: int):
        def run():
            drafter.extend(ctx, taps[n - 1 - rows:n - 1])
            ctx.truncate(n - 1)
        return run

    def after_target_step(fn):
        """fn's time right after a target step, as in a round: the step has streamed the target's
        weights through the caches, so the drafter reads its own from memory."""
        times = []
        for _ in range(repeats):
            target_rows(1)()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def draft():
        drafter.propose(ctx, ids[-1], k)

    costs = {"target_1_row": median(target_rows(1)), f"target_{k + 1}_rows": median(target_rows(k + 1)),
             f"draft_block_{k}": median(draft), f"draft_block_{k}_after_target_step": after_target_step(draft),
             "draft_extend_1": median(extend(1)), "draft_extend_3": median(extend(3))}
    return {key: round(v * 1e3, 2) for key, v in costs.items()}  # milliseconds


def run_methods(engine, tok, encoded: list[list[int]], prompts: list[dict], methods: list[str],
                temperature: float, args) -> dict:
    """Every method on every prompt (interleaved per prompt), each prompt's run the median of
    ``args.repeats`` by decode time: per method the times, token counts, passes, acceptance by
    position and texts."""
    res = {m: {"seconds": [], "tokens": [], "rounds": 0, "generated": 0, "prefill_s": 0.0,
               "draft_s": 0.0, "proposed_at": [], "accepted_at": [], "texts": []}
           for m in methods}
    for i, ids in enumerate(encoded):
        for m in methods:  # interleaved per prompt
            runs = []
            for rep in range(args.repeats):
                stats = DecodeStats()
                sampling = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=1000 + i)
                spec = SpeculativeParams(method=m, num_speculative_tokens=args.k)
                t0 = time.perf_counter()
                out = [x for chunk in engine.generate(ids, sampling, spec, stats) for x in chunk]
                total = time.perf_counter() - t0
                runs.append((total - stats.prefill_s, out, stats))
            seconds, out, stats = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
            r = res[m]
            r["seconds"].append(seconds)
            r["tokens"].append(len(out))
            r["rounds"] += stats.rounds
            r["generated"] += stats.generated_tokens
            r["prefill_s"] += stats.prefill_s
            r["draft_s"] += stats.draft_s
            for key in ("proposed_at", "accepted_at"):
                vals = getattr(stats, key)
                r[key] += [0] * (len(vals) - len(r[key]))
                for d, v in enumerate(vals):
                    r[key][d] += v
            r["texts"].append(tok.decode(out))
        print(f"T={temperature} prompt {i + 1}/{len(encoded)} ({prompts[i]['kind']}) done", flush=True)
    return res


def summarize(res: dict, prompts: list[dict], methods: list[str]) -> dict:
    """One temperature's result: per method tokens/s (and against plain), tokens per pass,
    acceptance by position, the drafter's share, text figures; tokens/s per prompt kind."""
    plain = sum(res["none"]["tokens"]) / sum(res["none"]["seconds"]) if "none" in res else None
    summary = {}
    for m, r in res.items():
        tps = sum(r["tokens"]) / sum(r["seconds"])
        summary[m] = {
            "tokens_per_s": round(tps, 2),
            "vs_plain": round(tps / plain, 3) if plain else None,
            "tokens_per_pass": round(r["generated"] / max(r["rounds"], 1), 3),
            "per_position_acceptance": [round(a / p, 3) if p else None
                                        for a, p in zip(r["accepted_at"], r["proposed_at"])],
            "verified_at_position": r["proposed_at"],
            "draft_share_of_decode": round(r["draft_s"] / sum(r["seconds"]), 3),
            "distinct_8gram": round(distinct_8gram_share(r["texts"]), 3),
            "identical_to_plain": (sum(a == b for a, b in zip(r["texts"], res["none"]["texts"]))
                                   if "none" in res else None),
        }
    return {"summary": summary,
            "samples": {m: res[m]["texts"][:1] for m in methods},
            "per_kind": {
                kind: {m: round(sum(res[m]["tokens"][j] for j in idx) /
                                sum(res[m]["seconds"][j] for j in idx), 2)
                       for m in methods}
                for kind in dict.fromkeys(p["kind"] for p in prompts)
                for idx in [[j for j, p in enumerate(prompts) if p["kind"] == kind]]}}


def print_report(report: dict, out: Path) -> None:
    print(f"\n{report['cpu']}, target on the kernels, drafter on {report['drafter_backend']}, "
          f"{report['threads']} threads, {report['prompts']} held-out prompts, "
          f"<= {report['max_tokens']} tokens, k = {report['k']}")
    print("pass costs (ms, median): " + ", ".join(f"{k} {v}" for k, v in report["pass_costs_ms"].items()))
    for temp, r in report["results"].items():
        print(f"\ntemperature {temp}\n")
        print("| method | tokens/s | vs plain | tokens per target pass | acceptance at position 1..k "
              "| draft share | distinct 8-gram | same text as plain |")
        print("|---|---|---|---|---|---|---|---|")
        for m, s in r["summary"].items():
            acc = " / ".join(f"{a:.2f}" for a in s["per_position_acceptance"] if a is not None)
            print(f"| {m} | {s['tokens_per_s']} | {s['vs_plain']}x | {s['tokens_per_pass']} | {acc} "
                  f"| {s['draft_share_of_decode']} | {s['distinct_8gram']} | "
                  f"{s['identical_to_plain']}/{report['prompts']} |")
    print(f"\nwrote {out}")


def run_drafter_bench(args) -> None:
    """The command's work; ``args`` holds its options as attributes (dspark/cli builds it)."""
    from dspark.training.prompts import heldout_prompts

    gguf = GGUFModel(installed_smollm2())
    tok = LlamaTokenizer.from_gguf(gguf)
    target = KernelRuntime(gguf, threads=args.threads)
    drafter = DSparkDrafter.for_gguf(gguf, args.weights, args.drafter_backend, args.threads)
    engine = SpeculativeEngine(target, standard_proposers(model_proposers=(DSparkProposer(drafter),)),
                               eos_ids=[tok.eos_id])
    prompts = heldout_prompts(args.per_kind)
    encoded = [tok.encode_chat([{"role": "user", "content": p["text"]}]) if p["chat"]
               else tok.encode(p["text"]) for p in prompts]
    methods = args.methods.split(",")
    costs_ms = pass_costs(target, drafter, encoded[0], args.k)
    print("pass costs (ms, median):", json.dumps(costs_ms), flush=True)
    results = {str(temp): summarize(run_methods(engine, tok, encoded, prompts, methods, temp, args), prompts, methods)
               for temp in (float(t) for t in args.temperatures.split(","))}
    report = {"cpu": f"{this_machine().cpu_model} ({this_machine().cpu_class})", "drafter_backend": args.drafter_backend,
              "threads": args.threads, "max_tokens": args.max_tokens,
              "prompts": len(prompts), "k": args.k, "weights": str(args.weights),
              "command": " ".join(sys.argv), "pass_costs_ms": costs_ms, "results": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print_report(report, out)
