"""`dspark bench spec`, `bench shapes` and `bench openai`: thin commands over dspark/bench/spec.py
(speculative decoding on a served real model against plain decoding and llama.cpp on the same GGUF,
in process and through Triton), dspark/bench/shapes.py (the kernels on random-weight GGUFs of
1B-8B shapes: pass cost by rows, decode against the bandwidth ceiling, a draft pair's step) and
dspark/bench/openai_api.py (the OpenAI API's cost over Triton's generate); `bench llm-quality`,
`bench constrained` (structured output's validity and cost) and `bench prefix` (the prefix
cache's saving on the time to the first token)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import click

from dspark.cli.bench.common import bench_errors, emit, progress_log


@click.command(name="spec")
@click.option("--model", default="spec_lm", show_default=True,
              help="The demo repository's LLM model to measure (spec_lm: SmolLM2, gemma_lm: Gemma 3 270M).")
@click.option("--max-tokens", default=96, show_default=True)
@click.option("--per-kind", default=4, show_default=True,
              help="Prompts per kind (chat, rewrite, code, continue; at most 4).")
@click.option("--repeats", default=3, show_default=True, help="Runs per prompt and method (median).")
@click.option("--threads", default=2, show_default=True, help="Threads of the target (and of llama.cpp).")
@click.option("--methods", default="", help="Comma-separated methods (default: every method of the model).")
@click.option("--server/--no-server", default=True, show_default=True,
              help="Also stream through a tritonserver started on free ports (concurrency 1, 2, 4).")
@click.option("--served-repeats", default=2, show_default=True, type=click.IntRange(min=1),
              help="Passes per method and concurrency through the server, each on a freshly loaded model "
                   "(median).")
@click.option("--sampled/--no-sampled", default=True, show_default=True,
              help="Also a sampled run (temperature 0.8).")
@click.option("--llama-cpp/--no-llama-cpp", "peer", default=True, show_default=True,
              help="llama.cpp on the same GGUF as the peer row, when llama_cpp is importable "
                   "(make bench-deps).")
@click.option("--llama-extra-buffers", is_flag=True,
              help="Let llama.cpp use its extra buffer types (weight repacking, AMX kernels); off by "
                   "default: its AMX Q4_1 kernel died with SIGILL on a Sapphire Rapids VM.")
@click.option("--json", "--json-out", "json_path", type=click.Path(path_type=Path), default=None,
              help="The result's path  [default: bench-results/spec-<time>.json]")
@bench_errors
def spec(model: str, max_tokens: int, per_kind: int, repeats: int, threads: int, methods: str, server: bool,
         served_repeats: int, sampled: bool, peer: bool, llama_extra_buffers: bool, json_path: Optional[Path]) -> None:
    """Plain decoding vs every speculative method of MODEL (default spec_lm, SmolLM2-135M-Instruct) on
    held-out prompts; llama.cpp's plain and prompt-lookup decoding of the same GGUF beside it.
    Exits non-zero when a greedy output differs from plain decoding."""
    from dspark.bench.spec import run_spec_bench
    from dspark.bench.spec_inprocess import SpecBenchSettings, mismatched

    settings = SpecBenchSettings(
        max_tokens=max_tokens, per_kind=per_kind, repeats=repeats, threads=threads,
        methods=[m.strip() for m in methods.split(",") if m.strip()], server=server,
        served_repeats=served_repeats, sampled=sampled,
        peer=peer, llama_extra_buffers=llama_extra_buffers, model=model)
    result = run_spec_bench(settings, log=lambda text: progress_log(f"  {text}"))
    emit(result, json_path or Path("bench-results") / f"spec-{time.strftime('%Y%m%d-%H%M%S')}.json")
    different = mismatched(result.rows)
    if different:
        raise click.ClickException(f"greedy outputs differ from plain decoding for {different}")


@click.command("shapes")
@click.option("--shape", "names", multiple=True, type=click.Choice(["1b", "3b", "8b"]),
              help="Shapes to measure (repeatable)  [default: 1b, 3b, 8b]; 8b brings its 1b draft.")
@click.option("--dir", "folder", type=click.Path(file_okay=False, path_type=Path),
              default=Path("bench-results") / "shapes", show_default=True,
              help="Where the random-weight GGUFs are written (0.8-4.9 GB each) and kept for the next run.")
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="Cut every shape to this many blocks (a quick check of the command, not the shape's cost).")
@click.option("--threads", default=2, show_default=True, help="Threads of dspark's kernels and of llama.cpp.")
@click.option("--repeats", default=5, show_default=True, help="Interleaved repeats of each pass (median).")
@click.option("--tokens", default=32, show_default=True, help="Tokens of each decode run.")
@click.option("--llama-cpp/--no-llama-cpp", "peer", default=True, show_default=True,
              help="llama.cpp on the same files, when llama_cpp is importable (make bench-deps).")
@click.option("--pair/--no-pair", default=True, show_default=True,
              help="The 8B shape with the 1B shape as its draft model (cost of a speculative step).")
@click.option("--json", "--json-out", "json_path", type=click.Path(path_type=Path), default=None,
              help="The result's path  [default: bench-results/shapes-<time>.json]")
@bench_errors
def shapes(names: tuple[str, ...], folder: Path, layers: Optional[int], threads: int, repeats: int, tokens: int,
           peer: bool, pair: bool, json_path: Optional[Path]) -> None:
    """dspark's kernels on random-weight GGUFs of the Llama 3.2 1B/3B and Llama 3.1 8B shapes
    (Q4_K_M-like): pass cost by rows, plain decode against the memory-bandwidth ceiling and
    llama.cpp, and the 8B + 1B draft pair's step against its parts. Random weights: for cost
    only, the pair's acceptance is meaningless."""
    from dspark.bench.shapes import run_shapes_bench

    result = run_shapes_bench(list(names) or ["1b", "3b", "8b"], folder, threads, layers, repeats=repeats,
                              tokens=tokens, peer=peer, pair=pair, log=lambda text: progress_log(f"  {text}"))
    emit(result, json_path or Path("bench-results") / f"shapes-{time.strftime('%Y%m%d-%H%M%S')}.json")


@click.command("openai")
@click.option("--model", default="spec_lm", show_default=True, help="The demo repository's LLM model.")
@click.option("--pairs", default=100, show_default=True, help="Interleaved request pairs per case.")
@click.option("--stream-tokens", default=64, show_default=True, help="Tokens of the streamed case.")
@click.option("--json", "--json-out", "json_path", type=click.Path(path_type=Path), default=None)
@bench_errors
def openai(model: str, pairs: int, stream_tokens: int, json_path: Optional[Path]) -> None:
    """What the OpenAI-compatible API adds over Triton's generate endpoint, per request and per
    streamed token (one `dspark serve --openai-port`, interleaved pairs)."""
    from dspark.bench.openai_api import OpenAIBenchSettings, run_openai_bench

    result = run_openai_bench(OpenAIBenchSettings(model, pairs, stream_tokens), log=lambda t: progress_log(f"  {t}"))
    emit(result, json_path or Path("bench-results") / f"openai-{time.strftime('%Y%m%d-%H%M%S')}.json")


@click.command("llm-quality")
@click.option("--json", "--json-out", "json_path", type=click.Path(path_type=Path), default=None)
@bench_errors
def llm_quality(json_path: Optional[Path]) -> None:
    """The demo repository's LLMs against llama.cpp's stored figures for the same GGUF
    (tests/data/*_llama_cpp.json, `dspark llm reference`): tokens, perplexity, greedy agreement."""
    from dspark.bench.spec import run_llm_quality

    result = run_llm_quality()
    emit(result, json_path or Path("bench-results") / f"llm-quality-{time.strftime('%Y%m%d-%H%M%S')}.json")


@click.command("constrained")
@click.option("--models", default="spec_lm,gemma_lm", show_default=True,
              help="Comma-separated demo LLM models (spec_lm: SmolLM2, gemma_lm: Gemma 3 270M).")
@click.option("--schemas", default=22, show_default=True, type=click.IntRange(min=1),
              help="The first N JSON schemas of dspark/bench/data/constrained_schemas.json.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1),
              help="Interleaved repeats (median).")
@click.option("--max-tokens", default=96, show_default=True, type=click.IntRange(min=1))
@click.option("--method", default="suffix", show_default=True,
              help="The speculative method measured against plain decoding.")
@click.option("--threads", default=2, show_default=True)
@click.option("--sampled/--no-sampled", default=True, show_default=True, help="Also temperature 0.8.")
@click.option("--check/--no-check", default=False, show_default=True,
              help="Exit non-zero when a target is missed (100 % valid; on SmolLM2 a schema <= 10 % "
                   "slower than plain decoding, speculation keeping >= 90 % of its speed-up).")
@click.option("--json", "--json-out", "json_path", type=click.Path(path_type=Path), default=None)
@bench_errors
def constrained(models: str, schemas: int, repeats: int, max_tokens: int, method: str, threads: int,
                sampled: bool, check: bool, json_path: Optional[Path]) -> None:
    """Structured output (guided JSON schemas) against the same requests unconstrained: schema-valid
    %, plain decoding's rate with and without the schema, speculation's speed-up kept under it, and
    the mask's cost per token; greedy and sampled, interleaved, in process."""
    from dspark.bench.constrained import (ConstrainedSettings, check_targets, optional_models,
                                          run_constrained_bench)

    settings = ConstrainedSettings(optional_models(models), schemas, repeats, max_tokens, method, threads, sampled)
    result = run_constrained_bench(settings, log=lambda text: progress_log(f"  {text}"))
    emit(result, json_path or Path("bench-results") / f"constrained-{time.strftime('%Y%m%d-%H%M%S')}.json")
    missed = check_targets(result)
    if check and missed:
        raise click.ClickException("; ".join(missed))


@click.command("prefix")
@click.option("--prefix-tokens", default=2000, show_default=True, type=click.IntRange(min=64),
              help="Tokens the two prompts of the shared-prefix case share.")
@click.option("--turns", default=5, show_default=True, type=click.IntRange(min=2),
              help="User turns of the chat case (the last one is timed).")
@click.option("--turn-tokens", default=300, show_default=True, type=click.IntRange(min=1),
              help="Tokens of each user message.")
@click.option("--reply-tokens", default=32, show_default=True, type=click.IntRange(min=1),
              help="Tokens of each assistant reply before the last turn.")
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(min=1),
              help="Interleaved repeats of each case (median).")
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "--json-out", "json_path", type=click.Path(path_type=Path), default=None,
              help="The result's path  [default: bench-results/prefix-<time>.json]")
@bench_errors
def prefix(prefix_tokens: int, turns: int, turn_tokens: int, reply_tokens: int, repeats: int, threads: int,
           json_path: Optional[Path]) -> None:
    """Time to the first token with the prefix cache against without it, on the demo's SmolLM2: a
    prompt sharing a long prefix with the one before (target <= 0.15x) and a chat's last turn
    (target <= 0.3x)."""
    from dspark.bench.prefix import PrefixBenchSettings, run_prefix_bench

    settings = PrefixBenchSettings(prefix_tokens, turns, turn_tokens, reply_tokens, repeats, threads)
    result = run_prefix_bench(settings, log=lambda text: progress_log(f"  {text}"))
    emit(result, json_path or Path("bench-results") / f"prefix-{time.strftime('%Y%m%d-%H%M%S')}.json")
