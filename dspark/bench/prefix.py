"""`dspark bench prefix`: what the prefix cache saves on the time to the first token, in process
on the demo's SmolLM2 (its kernels, greedy, method ``none``: the prompt's cost alone).

Two cases, each a ratio of medians over interleaved repeats measured in the same run:
- ``shared_prefix``: a request whose prompt shares a long prefix (``prefix_tokens``) with the
  request before it, against that first request (the cache emptied before each pair);
- ``chat_turn``: the last turn of a multi-turn chat (``turns`` user messages, each reply
  ``reply_tokens`` long) with the cache filled by the turns before it, against the same prompt on
  an engine without a cache (the same model).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from dspark.bench.results import BenchResult, Metric
from dspark.bench.table import Column
from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.prefix_cache import PrefixCache
from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.paths import project_root

SMOLLM2 = project_root() / "model_repository" / "spec_lm" / "1" / "smollm2"
TOPICS = ("rivers", "compilers", "bread", "orbits", "glaciers", "printing presses", "bees", "railways")


@dataclass
class PrefixBenchSettings:
    prefix_tokens: int = 2000
    turns: int = 5
    turn_tokens: int = 300  # tokens of each user message
    reply_tokens: int = 32
    repeats: int = 5
    threads: int = 2


def _passage(tokenizer, tokens: int, seed: int) -> str:
    """English-like text of about ``tokens`` tokens."""
    words, k = [], seed
    while len(tokenizer.encode(" ".join(words))) < tokens:
        topic = TOPICS[k % len(TOPICS)]
        words += f"Note {k} is about {topic}: how {topic} change over time and why people study them.".split()
        k += 7
    return " ".join(words)


def _ttft(engine: SpeculativeEngine, ids: list[int], max_tokens: int = 1) -> tuple[float, list[int]]:
    """Seconds to the first new token, and the tokens (``max_tokens`` of them)."""
    started = time.perf_counter()
    out, first = [], None
    for chunk in engine.generate(ids, SamplingParams(max_tokens=max_tokens), SpeculativeParams("none")):
        first = first if first is not None else time.perf_counter() - started
        out += chunk
    return first, out


def run_prefix_bench(settings: PrefixBenchSettings, log: Callable[[str], None] = lambda _: None) -> BenchResult:
    from dspark.triton.models import llm_generator

    generator = llm_generator(SMOLLM2, settings.threads, max_context=max(2048, settings.prefix_tokens + 256)
                              + settings.turns * (settings.turn_tokens + settings.reply_tokens + 32),
                              model_proposers=())
    tokenizer, target = generator.tokenizer, generator.engine.target
    cache = PrefixCache(1 << 30)
    cached = SpeculativeEngine(target, context=generator.engine.context, eos_ids=generator.engine.eos_ids,
                               prefix_cache=cache)
    uncached = SpeculativeEngine(target, context=generator.engine.context, eos_ids=generator.engine.eos_ids)

    prefix = _passage(tokenizer, settings.prefix_tokens, 1)
    first_s, second_s = [], []
    for r in range(settings.repeats):
        cache.clear()
        a = tokenizer.encode(prefix + f" Question {r}: what is note {r} about?")
        b = tokenizer.encode(prefix + f" Question {r}: which note mentions bees first?")
        first_s.append(_ttft(cached, a)[0])
        second_s.append(_ttft(cached, b)[0])
        log(f"shared prefix {r + 1}/{settings.repeats}: {first_s[-1]:.3f} s then {second_s[-1]:.3f} s")

    messages = [{"role": "system", "content": "You answer briefly."}]
    last = []
    for r in range(settings.repeats):
        cache.clear()
        messages = messages[:1]
        for turn in range(settings.turns):
            messages.append({"role": "user", "content": _passage(tokenizer, settings.turn_tokens, 3 + turn)
                             + " Summarize it."})
            ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
            if turn == settings.turns - 1:
                warm = _ttft(cached, ids)[0]
                cold = _ttft(uncached, ids)[0]
                last.append((warm, cold))
                log(f"chat turn {turn + 1} {r + 1}/{settings.repeats}: {warm:.3f} s cached, {cold:.3f} s not")
            else:
                reply = _ttft(cached, ids, settings.reply_tokens)[1]
                messages.append({"role": "assistant", "content": tokenizer.decode_bytes(reply).decode(
                    "utf-8", errors="replace")})

    def row(case: str, tokens: int, base: list[float], new: list[float], target: float) -> dict:
        base_ms, new_ms = statistics.median(base) * 1e3, statistics.median(new) * 1e3
        return {"case": case, "prompt_tokens": tokens, "without_ms": round(base_ms, 1),
                "with_ms": round(new_ms, 1), "ratio": round(new_ms / base_ms, 3), "target": f"<= {target}x"}

    rows = [row("shared_prefix", len(tokenizer.encode(prefix)), first_s, second_s, 0.15),
            row("chat_turn", len(ids), [c for _, c in last], [w for w, _ in last], 0.3)]
    columns = [Column("case", "case"), Column("prompt_tokens", "prompt tokens"),
               Column("without_ms", "TTFT without (ms)"), Column("with_ms", "TTFT with (ms)"),
               Column("ratio", "ratio"), Column("target", "target")]
    return BenchResult("prefix", asdict(settings), rows, columns, key_fields=["case"],
                       metrics=[Metric("ratio", "lower")],
                       notes=[f"SmolLM2-135M on dspark's kernels, {settings.threads} threads, greedy, method none; "
                              f"medians of {settings.repeats} interleaved repeats; shared_prefix: a second prompt "
                              "sharing the prefix against the first; chat_turn: the last turn with the earlier "
                              "turns cached against no cache"])
