"""`dspark bench spec`: speculative decoding against plain decoding, in process and served."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import click

from dspark.cli.bench import bench
from dspark.paths import project_root


@bench.command(name="spec")
@click.option("--max-tokens", default=96, show_default=True)
@click.option("--per-category", default=4, show_default=True, help="Held-out prompts per category.")
@click.option("--repeats", default=3, show_default=True, help="Runs per prompt and method (median).")
@click.option("--threads", default=1, show_default=True, help="ORT intra-op threads per session.")
@click.option("--server/--no-server", default=True, show_default=True,
              help="Also stream through a tritonserver started on free ports (concurrency 1, 2, 4).")
@click.option("--sampled/--no-sampled", default=True, show_default=True,
              help="Also a sampled run (temperature 0.8).")
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
def spec(max_tokens: int, per_category: int, repeats: int, threads: int, server: bool,
         sampled: bool, json_out: Optional[Path]) -> None:
    """Plain decoding vs draft, prompt-lookup, hybrid and tree speculation on the demo LM pair."""
    from dspark.decoding import benchmark as bm
    from dspark.decoding.models import toy_generator
    from dspark.decoding.sampling import SamplingParams

    repo = project_root() / "model_repository"
    paths = (repo / "spec_target/1/model.onnx", repo / "spec_draft/1/model.onnx",
             repo / "spec_lm/1/tokenizer.json")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise click.ClickException(f"missing {', '.join(missing)}: run `make setup` first")
    gen = toy_generator(*paths, threads=threads)
    # the same models with the draft on ORT instead of dspark's C forward pass
    gen_ort = toy_generator(*paths, threads=threads, draft_runtime="onnxruntime")
    ort_draft = gen_ort.engine.proposers["draft"].lm
    prompts = bm.heldout_prompts(per_category)
    report: dict = {"max_tokens": max_tokens, "prompts": len(prompts), "repeats": repeats}

    costs = bm.cost_profile(gen, ort_draft=ort_draft)
    report["costs_ms"] = costs
    click.echo(f"per call (ms, context {costs['context']}): " + ", ".join(
        f"{k}={v}" for k, v in costs.items() if k != "context"))
    click.echo(f"draft/target cost ratio {costs['draft_1'] / costs['target_1']:.2f} "
               f"(draft on ORT: {costs['draft_1_ort'] / costs['target_1']:.2f}); "
               f"verify 5 rows / 1 row {costs['target_5'] / costs['target_1']:.2f}; "
               f"17-node tree / 1 row {costs['target_17'] / costs['target_1']:.2f}")

    greedy = SamplingParams(max_tokens=max_tokens)
    results = bm.run_inprocess(gen, prompts, bm.METHODS, greedy, repeats, {"draft_ort": gen_ort})
    rows = bm.summary_rows(results, check_identical=True)
    report["greedy"] = rows
    click.echo(f"\nGreedy, in process ({len(prompts)} held-out prompts x {max_tokens} tokens, "
               f"median of {repeats}):")
    click.echo(bm.format_table(rows))
    cats = bm.category_rows(results, prompts)
    report["greedy_by_category"] = cats
    click.echo("\nSpeed-up over plain by category:")
    click.echo(bm.format_table(cats))
    mismatched = [r["method"] for r in rows if r["identical"] not in ("-", f"{len(prompts)}/{len(prompts)}")]

    if sampled:
        hot = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1234)
        sampled_methods = {k: v for k, v in bm.METHODS.items() if k in ("none", "draft", "ngram", "hybrid", "tree")}
        s_results = bm.run_inprocess(gen, prompts, sampled_methods, hot, max(1, repeats // 2))
        s_rows = bm.summary_rows(s_results, check_identical=False)
        report["sampled"] = s_rows
        click.echo("\nSampled (temperature 0.8, seed 1234), in process:")
        click.echo(bm.format_table(s_rows))

    if server:
        report["server"] = _served(bm, gen.tokenizer, prompts, results, max_tokens)

    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=1))
    if mismatched:
        raise click.ClickException(f"greedy outputs differ from plain decoding for {mismatched}")


def _served(bm, tok, prompts, results, max_tokens: int) -> list[dict]:
    from dataclasses import asdict

    from dspark.paths import demo_repositories
    from dspark.triton.server import TritonServer

    rows = []
    server = TritonServer(repositories=demo_repositories(), model_control="explicit",
                          load_models=["spec_lm"])
    server.start()
    try:
        for method in ("none", "ngram", "hybrid", "tree", "draft"):
            spec = bm.METHODS[method]
            spec_json = asdict(spec)
            counts = [len(o) for o in results[method].outputs]
            inproc = results[method].end_to_end_tokens_per_s
            bm.run_server(server.grpc_url, "spec_lm", prompts[:2], spec_json, max_tokens, 1, counts[:2])
            for concurrency in (1, 2, 4):
                out = max((bm.run_server(server.grpc_url, "spec_lm", prompts, spec_json, max_tokens,
                                         concurrency, counts) for _ in range(2)),
                          key=lambda o: o["tokens/s"])  # best of 2: the cores are shared
                same = sum(text == tok.decode(o).decode("utf-8", "replace")
                           for text, o in zip(out.pop("texts"), results[method].outputs))
                row = {"method": method, **out, "in-process tokens/s (with prefill)": round(inproc, 1),
                       "served/in-process": round(out["tokens/s"] / inproc, 2),
                       "same text": f"{same}/{len(prompts)}"}
                rows.append(row)
    finally:
        server.stop()
    click.echo("\nThrough tritonserver, gRPC streaming (same prompts, greedy; wall time with the "
               "prompt prefill, best of 2 passes):")
    click.echo(bm.format_table(rows))
    return rows
