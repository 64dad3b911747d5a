"""`dspark bench`: thin commands over dspark/bench, one module of this package per family:
load.py (`model`, `system`, `profile`, `crosscheck`: a running server), results.py (`compare`,
`all`), micro.py (operator micro benchmarks), llm.py (speculative decoding, GGUF shapes, the OpenAI
API, LLM quality), router.py, rollout.py, runs.py (long runs over a library ``run_*``),
trace_overhead.py (the probes' end-to-end cost); common.py
holds what they share. A command is added to the group by one line in COMMANDS, and its module is
imported only when it runs (or when `dspark bench --help` lists it)."""
from __future__ import annotations

from dspark.cli.lazy import lazy_group

# command name -> "module:attribute" of its click command, one line each
COMMANDS = {
    "model": "dspark.cli.bench.load:model",
    "system": "dspark.cli.bench.load:system",
    "profile": "dspark.cli.bench.load:profile",
    "crosscheck": "dspark.cli.bench.load:crosscheck",
    "compare": "dspark.cli.bench.results:compare",
    "all": "dspark.cli.bench.results:bench_all",
    "kernels": "dspark.cli.bench.micro:bench_kernels",
    "pool": "dspark.cli.bench.micro:bench_pool",
    "gemm": "dspark.cli.bench.micro:bench_gemm",
    "micro": "dspark.cli.bench.micro:micro",
    "spec": "dspark.cli.bench.llm:spec",
    "shapes": "dspark.cli.bench.llm:shapes",
    "openai": "dspark.cli.bench.llm:openai",
    "llm-quality": "dspark.cli.bench.llm:llm_quality",
    "constrained": "dspark.cli.bench.llm:constrained",
    "prefix": "dspark.cli.bench.llm:prefix",
    "router": "dspark.cli.bench.router:router",
    "rollout": "dspark.cli.bench.rollout:rollout_bench",
    "drafter": "dspark.cli.bench.runs:drafter",
    "llm-kernels": "dspark.cli.bench.runs:llm_kernels",
    "soak": "dspark.cli.bench.runs:soak",
    "stream-cancel": "dspark.cli.bench.runs:stream_cancel",
    "trace": "dspark.cli.bench.trace_overhead:trace_bench",
}


@lazy_group(COMMANDS)
def bench() -> None:
    """Benchmarks: micro (operators), model and system (a running server), compare, profile, all."""
