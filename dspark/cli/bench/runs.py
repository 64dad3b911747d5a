"""`dspark bench drafter | llm-kernels | soak | stream-cancel`: the long runs whose work is a
library ``run_*`` function (dspark/bench/); each command passes its options to it as attributes."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import click

SKIPPABLE = ("steps", "products", "decode", "agreement", "memory")


def _ints(text: str) -> list[int]:
    try:
        return [int(part) for part in re.split(r"[\s,]+", text.strip()) if part]
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected integers separated by commas") from None


@click.command("drafter")
@click.option("--weights", default=None, help="the drafter's weights (default: the shipped ones)")
@click.option("--drafter-backend", type=click.Choice(["kernel", "numpy"]), default="kernel", show_default=True,
              help="the drafter's runtime: dspark's C kernels (served) or the numpy reference")
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--max-tokens", type=int, default=96, show_default=True)
@click.option("--per-kind", type=int, default=4, show_default=True)
@click.option("--repeats", type=int, default=1, show_default=True)
@click.option("--k", type=int, default=8, show_default=True, help="num_speculative_tokens")
@click.option("--methods", default="none,dspark,suffix,hybrid", show_default=True)
@click.option("--temperatures", default="0,0.8", show_default=True)
@click.option("--out", default=None, help="the report (default: bench-results/dspark.json)")
def drafter(**options) -> None:
    """The trained DSpark drafter against plain decoding and the other proposers on SmolLM2 (held-out prompts)."""
    from dspark.bench.drafter import BACKENDS, run_drafter_bench
    from dspark.drafters.dspark.model import default_weights
    from dspark.paths import project_root

    assert options["drafter_backend"] in BACKENDS
    options["weights"] = options["weights"] or str(default_weights())
    options["out"] = options["out"] or str(project_root() / "bench-results" / "dspark.json")
    run_drafter_bench(SimpleNamespace(**options))


@click.command("llm-kernels")
@click.option("--gguf", type=click.Path(path_type=Path), default=None,
              help="a .gguf file or an imported model's folder (default: the installed SmolLM2-135M-Instruct)")
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--repeats", type=int, default=9, show_default=True)
@click.option("--contexts", default="128,512,2048", show_default=True, help="context lengths, comma-separated")
@click.option("--rows", default="1,2,4,8,16", show_default=True, help="rows per pass, comma-separated")
@click.option("--decode-tokens", type=int, default=64, show_default=True)
@click.option("--decode-repeats", type=int, default=3, show_default=True)
@click.option("--llama-extra-buffers", is_flag=True,
              help="let llama.cpp use its extra buffer types (repacking, AMX); off by default because its "
                   "AMX kernels crash on this build (dspark/bench/peers/llama_cpp.py)")
@click.option("--clock", type=click.Choice(["wall", "cpu"]), default="wall", show_default=True,
              help="cpu: CPU time of the calling thread (with --threads 1: less sensitive to other load) "
                   "for the steps and products tables")
@click.option("--skip", default="", help="tables to leave out, comma-separated: steps, products, decode, agreement, memory")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None, help="write the report here")
def llm_kernels(json_path, contexts, rows, skip, **options) -> None:
    """dspark's LLM kernels against llama.cpp on one GGUF: steps, products, decoding, agreement, memory."""
    from dspark.bench.llm_kernels import run_llm_kernels_bench

    tables = [t for t in re.split(r"[\s,]+", skip.strip()) if t]
    unknown = sorted(set(tables) - set(SKIPPABLE))
    if unknown:
        raise click.BadParameter(f"{', '.join(unknown)}: not a table; one of {', '.join(SKIPPABLE)}", param_hint="--skip")
    run_llm_kernels_bench(SimpleNamespace(json=json_path, contexts=_ints(contexts), rows=_ints(rows),
                                          skip=tables, **options))


@click.command("soak")
@click.option("--minutes", type=float, default=12.0, show_default=True)
@click.option("--workers", type=int, default=6, show_default=True)
@click.option("--cancel-share", type=float, default=0.2, show_default=True)
@click.option("--warmup-share", type=float, default=0.2, show_default=True, help="share of the run before memory counts")
@click.option("--model", default="spec_lm", show_default=True, help="spec_lm (the real model) or spec_toy (the test fixture)")
@click.option("--sample-s", type=float, default=5.0, show_default=True)
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
def soak(**options) -> None:
    """Soak the speculative backend: requests, cancels and memory over a long run (not part of `make test`)."""
    from dspark.bench.soak import run_soak

    run_soak(SimpleNamespace(**options))


@click.command("stream-cancel")
@click.option("--model", default="spec_lm", show_default=True, help="spec_lm (the real model) or spec_toy (the test fixture)")
@click.option("--close", type=click.Choice(["cancel", "half-close"]), default="cancel", show_default=True)
@click.option("--cycles", type=int, default=30, show_default=True)
@click.option("--concurrency", type=int, default=4, show_default=True)
@click.option("--requests", type=int, default=8, show_default=True)
@click.option("--max-tokens", type=int, default=48, show_default=True)
@click.option("--unload-timeout", type=float, default=12.0, show_default=True)
@click.option("--log-verbose", type=int, default=0, show_default=True)
def stream_cancel(**options) -> None:
    """Reproduce Triton's gRPC stream that keeps an unloaded model alive (cancel vs half-close)."""
    from dspark.bench.stream_cancel import run_stream_cancel

    run_stream_cancel(SimpleNamespace(**options))
