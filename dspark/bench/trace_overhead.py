"""`bench trace`: what the USDT probes cost end to end. Three builds of the same code:

- A: dspark/_ext built again with ``-DDSPARK_NO_PROBES`` into its own folder (the probe macros
  compile to nothing), loaded first through ``DSPARK_EXT_PATH`` (dspark/_ext/__init__.py);
- B: the normal build, nothing attached (each probe one branch on its semaphore);
- C: B with `dspark trace`'s own bpftrace program attached to the process (dspark/trace/attach.py).

Decode tokens/s of each demo LLM is measured in process, the engine's plain decoding of a fixed
prompt (as `bench spec` times it: tokens after the first over the time after the first), in one
worker process per build (A's with the probe-less folder first); B and C are the same worker,
traced while C is measured. Router throughput is closed-loop requests/s through a QoS router in
front of a zero-work target on a tritonserver per build (A's server loads the probe-less
folder), as `bench router` measures its capacity. Rounds interleave A, B and C, their order
turning each round; each figure is the median over rounds, the ratios are against A."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from dspark.bench.results import BenchResult, Metric, relative_band
from dspark.bench.table import Column
from dspark.errors import ConfigError
from dspark.paths import project_root

MODELS = ("spec_lm", "gemma_lm")  # the demo repository's LLMs: SmolLM2-135M, Gemma 3 270M
BUILDS = ("A", "B", "C")
LABELS = {"A": "A: built without probes", "B": "B: probes, detached", "C": "C: probes, dspark trace attached"}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
EXT_ENV = "DSPARK_EXT_PATH"


@dataclass
class TraceBenchSettings:
    models: Sequence[str] = MODELS
    rounds: int = 5
    tokens: int = 64            # tokens per decode run
    runs: int = 2               # decode runs per model, build and round (their tokens/s pooled)
    threads: int = 2
    router: bool = True
    router_s: float = 6.0       # seconds of closed loop per build and round
    outstanding: int = 8
    build_dir: Optional[Path] = None  # keep the probe-less build here (default: a temporary folder)

    def to_json(self) -> dict:
        return {**asdict(self), "models": list(self.models), "build_dir": str(self.build_dir or "")}


# --- A: the probe-less build -------------------------------------------------------------------
def build_without_probes(folder: Path, log: Callable[[str], None] = lambda _: None) -> Path:
    """dspark/_ext built with ``-DDSPARK_NO_PROBES`` under ``folder`` (reused when already
    there); returns the folder of its modules, checked to carry no probe."""
    folder = folder.resolve()
    lib = folder / "lib" / "dspark" / "_ext"
    if not list(lib.glob("probes.*so")):
        log(f"building dspark/_ext without probes into {folder} (a few minutes) ...")
        env = {**os.environ, "CFLAGS": (os.environ.get("CFLAGS", "") + " -DDSPARK_NO_PROBES").strip()}
        env.pop("DSPARK_SANITIZE", None)
        result = subprocess.run(
            [sys.executable, "setup.py", "-q", "build_clib", "--build-clib", str(folder / "clib"), "--build-temp",
             str(folder / "temp"), "build_ext", "--build-lib", str(folder / "lib"), "--build-temp",
             str(folder / "temp")], cwd=project_root(), env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise ConfigError("build", "the build without probes failed: "
                              + (result.stderr.strip().splitlines() or ["no output"])[-1], folder)
    check = subprocess.run([sys.executable, "-c", "import dspark._ext.probes as p; print(int(p.BUILT), p.__file__)"],
                           env={**os.environ, EXT_ENV: str(lib)}, capture_output=True, text=True)
    built, _, path = check.stdout.strip().partition(" ")
    if check.returncode != 0 or built != "0" or not path.startswith(str(lib)):
        raise ConfigError("build", f"the build without probes does not load as expected ({check.stdout.strip()} "
                          f"{check.stderr.strip()[-300:]})", lib)
    return lib


# --- decoding, in a worker process per build ---------------------------------------------------
def worker(models: Sequence[str], threads: int) -> None:
    """Load ``models``, then answer lines ``{"model", "tokens", "runs"}`` on stdin with
    ``{"tokens", "seconds"}`` of plain greedy decoding (after the first token) on stdout."""
    from dspark.bench.spec import demo_llm_folder
    from dspark.bench.spec_inprocess import run_one
    from dspark.decoding.sampling import SamplingParams, SpeculativeParams
    from dspark.triton.models import llm_generator
    from dspark.triton.request_pool import limit_heap_growth
    from dspark._ext import probes

    limit_heap_growth()
    generators = {m: llm_generator(demo_llm_folder(m), threads=threads) for m in models}
    ids = {m: g.encode_chat([{"role": "user", "content": PROMPT}]) for m, g in generators.items()}
    plain = SpeculativeParams("none")
    for m, g in generators.items():  # warm-up
        run_one(g, ids[m], SamplingParams(max_tokens=8), plain)
    print(json.dumps({"ready": True, "built": bool(probes.BUILT), "probes": probes.__file__}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        tokens = seconds = 0.0
        for _ in range(ask["runs"]):
            run = run_one(generators[ask["model"]], ids[ask["model"]], SamplingParams(max_tokens=ask["tokens"]), plain)
            tokens += max(len(run.tokens) - 1, 0)
            seconds += run.decode_s
        print(json.dumps({"tokens": tokens, "seconds": seconds}), flush=True)


class Worker:
    def __init__(self, models: Sequence[str], threads: int, ext_dir: Optional[Path]):
        env = {k: v for k, v in os.environ.items() if k != EXT_ENV}
        if ext_dir is not None:
            env[EXT_ENV] = str(ext_dir)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dspark.bench.trace_overhead", "worker", str(threads), *models],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=project_root())
        self.hello = self._read()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise ConfigError("worker", f"the decode worker exited ({self.process.wait()})")
        return json.loads(line)

    def tokens_per_s(self, model: str, tokens: int, runs: int) -> float:
        self.process.stdin.write(json.dumps({"model": model, "tokens": tokens, "runs": runs}) + "\n")
        self.process.stdin.flush()
        answer = self._read()
        return answer["tokens"] / answer["seconds"] if answer["seconds"] else 0.0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def traced(pids: list[int], measure: Callable[[], object]) -> tuple[object, int]:
    """``measure()`` while `dspark trace`'s program is attached to ``pids``; (its value, the
    probe events bpftrace saw: proof it was attached)."""
    from dspark.trace import attach, report

    holder: dict = {}
    out, err, seconds = attach.run_bpftrace(attach.program(pids), 0.001,
                                            on_start=lambda: holder.update(value=measure()))
    if "value" not in holder:
        raise ConfigError("bpftrace", "did not attach: " + (err.strip().splitlines() or ["no output"])[-1])
    trace = report.parse(out, seconds)
    return holder["value"], sum(len(events) for events in trace.events.values())


# --- router throughput, a server per build -----------------------------------------------------
@contextlib.contextmanager
def router_server(ext_dir: Optional[Path]):
    from dspark.bench.router.repository import bench_server
    from dspark.bench.router.scenarios import RouterBenchSettings

    previous = os.environ.pop(EXT_ENV, None)
    if ext_dir is not None:
        os.environ[EXT_ENV] = str(ext_dir)
    try:
        settings = RouterBenchSettings(service_ms=0.0, instances=2, overhead=False)
        context = bench_server(settings)
        server, _ = context.__enter__()
    finally:
        os.environ.pop(EXT_ENV, None)
        if previous is not None:
            os.environ[EXT_ENV] = previous
    try:
        yield server, settings
    finally:
        context.__exit__(None, None, None)


def router_qps(server, settings, outstanding: int, seconds: float) -> float:
    from dspark.bench.router.measure import Bench

    async def run() -> float:
        bench = Bench(server.http_url, server.metrics_url, settings, lambda _: None)
        await bench.transport.open(0)
        try:
            return (await bench.closed_loop("bench_router", outstanding, seconds, tiers=True))["qps"]
        finally:
            await bench.transport.close()

    return asyncio.run(run())


# --- the benchmark -----------------------------------------------------------------------------
COLUMNS = [Column("measure"), Column("build"), Column("value", "median", ",.1f"), Column("unit"),
           Column("x_a", "x A", ".3f"), Column("runs", "rounds")]
METRICS = [Metric("value", "higher"), Metric("x_a", "higher")]


def order(round_index: int) -> list[str]:
    """A, B, C turned by one each round, so no build is always first after the others."""
    shift = round_index % len(BUILDS)
    return list(BUILDS[shift:] + BUILDS[:shift])


def rows_of(measure: str, unit: str, values: dict[str, list[float]]) -> list[dict]:
    base = statistics.median(values["A"]) if values["A"] else 0.0
    rows = []
    for build in BUILDS:
        median = statistics.median(values[build]) if values[build] else float("nan")
        rows.append({"measure": measure, "build": LABELS[build], "value": median, "unit": unit,
                     "x_a": median / base if base else None, "runs": len(values[build]),
                     "samples": [round(v, 2) for v in values[build]], "band": {"value": relative_band(values[build])}})
    return rows


def run_trace_bench(settings: TraceBenchSettings, log: Callable[[str], None] = lambda _: None) -> BenchResult:
    from dspark.trace import attach

    missing = attach.check()
    if missing:
        raise ConfigError("dspark trace", "; ".join(str(m) for m in missing))
    temporary = None
    folder = settings.build_dir
    if folder is None:
        temporary = folder = Path(tempfile.mkdtemp(prefix="dspark-noprobes-"))
    rows: list[dict] = []
    events: dict[str, int] = {}
    try:
        ext_a = build_without_probes(folder, log)
        log("starting the decode workers (A: without probes; B and C: the normal build) ...")
        workers = {"A": Worker(settings.models, settings.threads, ext_a),
                   "B": Worker(settings.models, settings.threads, None)}
        try:
            if workers["A"].hello["built"] or not workers["B"].hello["built"]:
                raise ConfigError("build", f"worker A must load a build without probes and B one with them: "
                                  f"{workers['A'].hello} {workers['B'].hello}", ext_a)
            decode = {m: {b: [] for b in BUILDS} for m in settings.models}
            for r in range(settings.rounds):
                for build in order(r):
                    for m in settings.models:
                        w = workers["A" if build == "A" else "B"]
                        if build == "C":
                            value, seen = traced([w.pid], lambda: w.tokens_per_s(m, settings.tokens, settings.runs))
                            events[f"decode {m}"] = events.get(f"decode {m}", 0) + seen
                        else:
                            value = w.tokens_per_s(m, settings.tokens, settings.runs)
                        decode[m][build].append(value)
                log(f"round {r + 1}/{settings.rounds}: " + "; ".join(
                    f"{m} " + " ".join(f"{b} {decode[m][b][-1]:.1f}" for b in BUILDS) for m in settings.models))
        finally:
            for w in workers.values():
                w.close()
        for m in settings.models:
            rows += rows_of(f"decode {m}", "tokens/s", decode[m])
        if settings.router:
            rows += _router_rows(settings, ext_a, events, log)
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    notes = [f"{settings.rounds} rounds, A, B, C interleaved (order turning each round); medians; x A: against "
             f"the build without probes. Decoding: plain greedy, {settings.runs} x {settings.tokens} tokens per "
             f"model, build and round, {settings.threads} threads, in one process per build (B and C: the same "
             "one, traced while C runs)",
             "C: `dspark trace`'s bpftrace program (dspark/trace/programs/serve.bt) attached to the process for "
             "its measurement; probe events it saw: " + ", ".join(f"{k} {v}" for k, v in events.items())]
    if settings.router:
        notes.append(f"router: closed loop, {settings.outstanding} requests outstanding, {settings.router_s:g} s "
                     "per build and round through a QoS router in front of a zero-work target (2 instances), "
                     "one tritonserver per build (B and C: the same)")
    return BenchResult("trace", settings.to_json(), rows, COLUMNS, key_fields=["measure", "build"], metrics=METRICS,
                       notes=notes)


def _router_rows(settings: TraceBenchSettings, ext_a: Path, events: dict[str, int],
                 log: Callable[[str], None]) -> list[dict]:
    from dspark.trace import attach

    log("starting the router servers (A: without probes; B and C: the normal build) ...")
    qps: dict[str, list[float]] = {b: [] for b in BUILDS}
    with router_server(ext_a) as (server_a, bench_settings), router_server(None) as (server_b, _):
        servers = {"A": server_a, "B": server_b}
        for server in servers.values():  # warm-up
            router_qps(server, bench_settings, settings.outstanding, 2.0)
        for r in range(settings.rounds):
            for build in order(r):
                server = servers["A" if build == "A" else "B"]
                measure = lambda: router_qps(server, bench_settings, settings.outstanding, settings.router_s)  # noqa: E731
                if build == "C":
                    value, seen = traced(attach.server_pids(server._process.pid), measure)
                    events["router"] = events.get("router", 0) + seen
                else:
                    value = measure()
                qps[build].append(value)
            log(f"router round {r + 1}/{settings.rounds}: " + " ".join(f"{b} {qps[b][-1]:.1f}" for b in BUILDS))
    return rows_of("router", "requests/s", qps)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        worker(sys.argv[3:], int(sys.argv[2]))
