"""Prefix caching in the engine, on the tiny GGUF pair (tests/fixtures/gguf_pair.py) run by
dspark's kernels: a request whose prompt starts as an earlier one's copies those rows and
decodes exactly as a cold run does, whatever the method, batching or rejections."""
from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.prefix_cache import BLOCK_TOKENS, PrefixCache
from dspark.decoding.prompt import read_prompt
from dspark.decoding.proposers import standard_proposers
from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.decoding.stats import DecodeStats
from dspark.llm.kernel_runtime import KernelRuntime
from tests.fixtures.gguf_pair import PAIR_SHAPE, write_pair
from tests.unit.llm.llm_gguf_factory import write_llama_gguf

CTX = 512


def _runtimes():
    with tempfile.TemporaryDirectory() as scratch:
        target, first_block = write_pair(Path(scratch))
        other = write_llama_gguf(Path(scratch) / "other.gguf", "Q8_0", **{**PAIR_SHAPE, "seed": 8})
        return [KernelRuntime(path, threads=1, max_context=CTX) for path in (target, first_block, other)]


TARGET, FIRST_BLOCK, OTHER = _runtimes()
VOCAB = TARGET.config.vocab
METHODS = ("none", "suffix", "draft", "tree")


def engine(draft=FIRST_BLOCK, cache: bool = True, **options) -> SpeculativeEngine:
    return SpeculativeEngine(TARGET, standard_proposers(draft), eos_ids=[],
                             prefix_cache=PrefixCache(64 << 20) if cache else None, **options)


def run(eng, prompt, method="none", max_tokens=20, stats=None, **sampling):
    spec = SpeculativeParams(method, num_speculative_tokens=4, tree_width=3)
    return [t for chunk in eng.generate(prompt, SamplingParams(max_tokens=max_tokens, **sampling), spec, stats)
            for t in chunk]


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, n).tolist()


COLD = engine(cache=False)


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_a_repeated_prompt_reuses_its_rows_and_decodes_as_a_cold_run(method, batched):
    eng = engine(batch_verification=batched)
    tokens = prompt(200)
    expected = run(COLD, tokens, method)
    first, second = DecodeStats(), DecodeStats()
    assert run(eng, tokens, method, stats=first) == expected
    assert run(eng, tokens, method, stats=second) == expected
    assert first.cached_prompt_tokens == 0
    assert second.cached_prompt_tokens == 192  # every whole block of the 199 rows read before the root
    stats = eng.prefix_cache.stats
    assert (stats.hits, stats.misses, stats.rows_reused) == (1, 1, 192)
    eng.close()


def test_a_prompt_of_whole_blocks_plus_one_token_reads_nothing_but_its_root():
    eng = engine()
    tokens = prompt(2 * BLOCK_TOKENS + 1, seed=3)
    expected = run(COLD, tokens)
    run(eng, tokens)
    stats = DecodeStats()
    assert run(eng, tokens, stats=stats) == expected and stats.cached_prompt_tokens == 2 * BLOCK_TOKENS


def test_a_prompt_sharing_part_of_a_block_reuses_the_whole_blocks_before_it():
    eng = engine()
    first = prompt(160, seed=1)
    second = first[:100] + prompt(60, seed=2)  # one whole block shared, then half of the next
    run(eng, first, "suffix")
    stats = DecodeStats()
    assert run(eng, second, "suffix", stats=stats) == run(COLD, second, "suffix")
    assert stats.cached_prompt_tokens == BLOCK_TOKENS


def test_a_sampled_request_with_a_hit_draws_what_a_cold_one_does():
    eng = engine()
    tokens = prompt(150, seed=4)
    sampled = {"temperature": 0.8, "seed": 11}
    run(eng, tokens, "draft", **sampled)
    assert run(eng, tokens, "draft", **sampled) == run(COLD, tokens, "draft", **sampled)


def _fresh_rows(tokens: list[int]):
    cache = TARGET.new_cache(CTX)
    read_prompt(TARGET, cache, tokens + [0])
    return cache


def test_rejected_guesses_never_reach_the_cache():
    """An unrelated draft is rejected nearly every round: after its requests, every block held
    equals the rows a plain prefill of the same tokens computes, and the next turn (the prompt,
    the reply and more) decodes as a cold run."""
    eng = engine(draft=OTHER)
    tokens = prompt(90, seed=5)
    stats = DecodeStats()
    reply = run(eng, tokens, "draft", max_tokens=60, stats=stats)
    assert stats.proposed > stats.accepted  # guesses were rolled back
    history = tokens + reply
    blocks = eng.prefix_cache.lookup(history)
    assert len(blocks) == len(history) // BLOCK_TOKENS == 2  # the reply's rows were kept too
    fresh = _fresh_rows(history)
    for i, rows in enumerate(blocks):
        start, stop = i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS
        expect = fresh.read_rows(start, stop)
        assert np.array_equal(rows.keys, expect.keys) and np.array_equal(rows.values, expect.values)
        assert np.array_equal(rows.positions, np.arange(start, stop))
    follow = history + prompt(30, seed=6)
    turn = DecodeStats()
    assert run(eng, follow, "draft", stats=turn) == run(COLD, follow, "draft")
    assert turn.cached_prompt_tokens == 2 * BLOCK_TOKENS


def test_a_reply_ended_by_eos_keeps_only_its_committed_tokens():
    tokens = prompt(120, seed=7)
    reply = run(COLD, tokens, max_tokens=20)
    eos = reply[12]  # ends the reply there: its row is in the cache, the token is not in the text
    eng = SpeculativeEngine(TARGET, standard_proposers(TARGET), eos_ids=[eos],
                            prefix_cache=PrefixCache(64 << 20))
    cold = SpeculativeEngine(TARGET, standard_proposers(TARGET), eos_ids=[eos])
    out = run(eng, tokens, "draft", max_tokens=20)
    assert out == reply[:reply.index(eos)]
    follow = tokens + out + prompt(40, seed=8)
    assert run(eng, follow, "draft") == run(cold, follow, "draft")


def test_concurrent_batched_requests_sharing_a_prefix_decode_as_cold_runs():
    eng = engine(batch_verification=True)
    shared = prompt(130, seed=9)
    prompts = [shared + prompt(20 + 10 * k, seed=20 + k) for k in range(3)]
    expected = [run(COLD, p, "suffix") for p in prompts]
    run(eng, shared, "suffix")
    results, stats = [None] * 3, [DecodeStats() for _ in range(3)]

    def work(k):
        results[k] = run(eng, prompts[k], "suffix", stats=stats[k])

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == expected
    assert all(s.cached_prompt_tokens == 2 * BLOCK_TOKENS for s in stats)
    eng.close()


def test_a_runtime_that_cannot_copy_rows_gets_no_prefix_cache():
    class NoCopies(KernelRuntime):
        copies_rows = False

    runtime = object.__new__(NoCopies)
    runtime.config = TARGET.config
    with pytest.raises(TypeError, match="cannot copy cache rows"):
        SpeculativeEngine(runtime, prefix_cache=PrefixCache(1 << 20))
