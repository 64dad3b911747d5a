"""`dspark bench constrained`: structured output (``guided`` JSON schemas) on the demo LLMs, in
process, against the same requests unconstrained: how many replies are schema-valid, what the
grammar's mask costs per token, how much slower constrained plain decoding is than unconstrained
plain decoding, and how much of speculation's speed-up a schema keeps. The four configurations
(plain and speculative, each with and without the schema) run interleaved per prompt and repeat;
each figure is a median over repeats of the rates summed over the prompts."""
from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from dspark.bench.jsonfile import read_json
from dspark.bench.results import BenchResult, Metric
from dspark.bench.table import Column
from dspark.decoding.constraint import Guided
from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.decoding.stats import DecodeStats
from dspark.errors import ConfigError
from dspark.paths import project_root

SCHEMAS_FILE = Path(__file__).parent / "data" / "constrained_schemas.json"
MODELS = ("spec_lm", "gemma_lm")


@dataclass
class ConstrainedSettings:
    models: tuple[str, ...] = MODELS
    schemas: int = 22  # the first N of the data file
    repeats: int = 3
    max_tokens: int = 96
    method: str = "suffix"  # the speculative method measured against plain decoding
    threads: int = 2
    sampled: bool = True  # also temperature 0.8


def load_schemas(path: Path = SCHEMAS_FILE) -> list[dict]:
    data = read_json(path)
    return data["schemas"]


def model_folder(model: str) -> Path:
    """The imported LLM of a demo model (its version folder holds one import)."""
    folders = sorted((project_root() / "model_repository" / model / "1").glob("*/import.json"))
    if not folders:
        raise ConfigError("model", f"{model!r} has no imported LLM under model_repository/{model}/1 "
                                   "(run `make setup`)")
    return folders[0].parent


def _valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _timed(gen, ids, sampling, spec) -> tuple[list[int], float, DecodeStats]:
    stats = DecodeStats()
    start = time.perf_counter()
    tokens = [t for chunk in gen.engine.generate(ids, sampling, spec, stats) for t in chunk]
    return tokens, time.perf_counter() - start - stats.prefill_s, stats


def mask_ms_per_token(gen, guided: Guided, tokens: list[int]) -> float:
    """The grammar's cost per token: a fresh constraint replays the reply, a mask per position."""
    constraint = gen.engine.grammars.compile(guided)
    start = time.perf_counter()
    for token in tokens:
        constraint.allowed()
        constraint.advance(token)
    constraint.allowed()
    return (time.perf_counter() - start) * 1e3 / (len(tokens) + 1)


def run_model(settings: ConstrainedSettings, model: str, log: Callable[[str], None]) -> list[dict]:
    from dspark.triton.models import llm_generator

    gen = llm_generator(model_folder(model), threads=settings.threads, max_context=1024)
    if settings.method not in gen.engine.methods:
        raise ConfigError("method", f"{settings.method!r} is not one of {model}'s methods {gen.engine.methods}")
    schemas = load_schemas()[:settings.schemas]
    prompts = [gen.encode_chat([{"role": "user", "content": s["prompt"] + " Reply with JSON only."}]) for s in schemas]
    guided = [Guided(json_schema=s["schema"]) for s in schemas]
    plain, spec = SpeculativeParams("none"), SpeculativeParams(settings.method)
    rows = []
    for mode in ("greedy", "sampled") if settings.sampled else ("greedy",):
        temperature = 0.0 if mode == "greedy" else 0.8
        # each constrained run, then the same request unconstrained, cut at the constrained
        # reply's length: a short reply's rate carries more of a request's fixed cost
        configs = {"plain_json": (plain, True), "plain": (plain, False), "spec_json": (spec, True),
                   "spec": (spec, False)}
        rates = {name: [] for name in configs}
        valid, total, mask_ms = 0, 0, []
        for repeat in range(settings.repeats):
            tokens_s = {name: [0, 0.0] for name in configs}
            for i, ids in enumerate(prompts):
                length = settings.max_tokens
                for name, (spec_params, constrained) in configs.items():  # interleaved per prompt
                    sampling = SamplingParams(max_tokens=settings.max_tokens if constrained else length,
                                              temperature=temperature,
                                              seed=1000 * repeat + i if temperature else None,
                                              guided=guided[i] if constrained else None)
                    tokens, seconds, _ = _timed(gen, ids, sampling, spec_params)
                    tokens_s[name][0] += len(tokens)
                    tokens_s[name][1] += seconds
                    if constrained:
                        length = max(len(tokens), 1)
                        total += 1
                        valid += _valid(gen.tokenizer.decode(tokens), schemas[i]["schema"])
                        if repeat == 0 and name == "plain_json":
                            mask_ms.append(mask_ms_per_token(gen, guided[i], tokens))
            for name, (n, s) in tokens_s.items():
                rates[name].append(n / s if s else 0.0)
        med = {name: statistics.median(r) for name, r in rates.items()}
        speedup = med["spec"] / med["plain"] if med["plain"] else 0.0
        speedup_json = med["spec_json"] / med["plain_json"] if med["plain_json"] else 0.0
        row = {"model": model, "mode": mode, "schemas": len(schemas), "valid_pct": 100.0 * valid / max(total, 1),
               "plain_tps": med["plain"], "plain_json_tps": med["plain_json"],
               "json_slowdown_pct": 100.0 * (1 - med["plain_json"] / med["plain"]) if med["plain"] else 0.0,
               "method": settings.method, "speedup": speedup, "speedup_json": speedup_json,
               "speedup_kept_pct": 100.0 * speedup_json / speedup if speedup else 0.0,
               "mask_ms_per_token": statistics.median(mask_ms) if mask_ms else 0.0}
        log(f"{model} {mode}: {row['valid_pct']:.0f} % valid, plain {row['plain_tps']:.1f} vs "
            f"{row['plain_json_tps']:.1f} tok/s constrained, {settings.method} speed-up {speedup:.2f}x vs "
            f"{speedup_json:.2f}x constrained, mask {row['mask_ms_per_token']:.3f} ms/token")
        rows.append(row)
    return rows


def run_constrained_bench(settings: ConstrainedSettings, log: Callable[[str], None] = print) -> BenchResult:
    rows = [row for model in settings.models for row in run_model(settings, model, log)]
    columns = [Column("model"), Column("mode"), Column("schemas", "schemas", "d"),
               Column("valid_pct", "schema-valid %", ".0f"), Column("plain_tps", "plain tok/s", ".1f"),
               Column("plain_json_tps", "plain + schema tok/s", ".1f"),
               Column("json_slowdown_pct", "schema slowdown %", ".1f"), Column("method"),
               Column("speedup", "speed-up", ".2f"), Column("speedup_json", "speed-up + schema", ".2f"),
               Column("speedup_kept_pct", "speed-up kept %", ".0f"),
               Column("mask_ms_per_token", "mask ms/token", ".3f")]
    return BenchResult("constrained", asdict(settings), rows, columns, key_fields=["model", "mode"],
                       metrics=[Metric("valid_pct", "higher"), Metric("json_slowdown_pct", "lower"),
                                Metric("speedup_kept_pct", "higher"), Metric("mask_ms_per_token", "lower")],
                       notes=[f"in process, {settings.threads} threads, max_tokens {settings.max_tokens}, "
                              f"{settings.repeats} interleaved repeats (median of the summed rates over the "
                              "prompts); tok/s: generated tokens / (wall - prompt read); each unconstrained "
                              "request is cut at its constrained reply's length (free text, at most as "
                              "long); mask: a fresh grammar replaying the "
                              "constrained plain reply, one mask per position"])


def check_targets(result: BenchResult, slowdown_pct: float = 10.0, kept_pct: float = 90.0) -> list[str]:
    """The rows that miss a target: 100 % valid; on SmolLM2 (spec_lm), greedy and sampled, a
    schema at most ``slowdown_pct`` slower than plain and speculation keeping ``kept_pct`` of
    its speed-up."""
    missed = []
    for row in result.rows:
        where = f"{row['model']} {row['mode']}"
        if row["valid_pct"] < 100.0:
            missed.append(f"{where}: {row['valid_pct']:.0f} % schema-valid")
        if row["model"] == "spec_lm":
            if row["json_slowdown_pct"] > slowdown_pct:
                missed.append(f"{where}: the schema costs {row['json_slowdown_pct']:.1f} % of plain decoding's rate")
            if row["speedup_kept_pct"] < kept_pct:
                missed.append(f"{where}: speculation keeps {row['speedup_kept_pct']:.0f} % of its speed-up")
    return missed


def optional_models(value: Optional[str]) -> tuple[str, ...]:
    return tuple(m.strip() for m in value.split(",") if m.strip()) if value else MODELS
