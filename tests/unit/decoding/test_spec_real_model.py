"""Speculation on the demo's real model (SmolLM2-135M, imported by `make setup`) with itself as
its own GGUF draft, assembled as the speculative backend does: every method's greedy text is
plain decoding's, and a model that copies lets the lookup methods accept."""
from __future__ import annotations

import pytest

from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.prefix_cache import PrefixCache
from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.decoding.stats import DecodeStats
from dspark.paths import project_root
from dspark.triton.models import llm_generator

SMOLLM2 = project_root() / "model_repository" / "spec_lm" / "1" / "smollm2"
PROMPT = ("The Python standard library offers modules for text processing, data types, file access and "
          "networking. ")


@pytest.fixture(scope="module")
def generator():
    return llm_generator(SMOLLM2, threads=2, max_context=512, model_proposers=(), draft=SMOLLM2)


def _ids(generator, text: str, method: str, stats: DecodeStats | None = None, **spec) -> list[int]:
    ids = generator.tokenizer.encode(text)
    sampling = SamplingParams(max_tokens=24)
    return [t for chunk in generator.engine.generate(ids, sampling, SpeculativeParams(method, **spec), stats)
            for t in chunk]


def test_every_method_gives_plain_greedy_text_with_the_model_as_its_own_draft(generator):
    plain = _ids(generator, PROMPT, "none")
    for method in ("draft", "tree", "ngram", "suffix", "hybrid"):
        stats = DecodeStats()
        assert _ids(generator, PROMPT, method, stats, num_speculative_tokens=4, tree_width=3) == plain, method
        if method in ("draft", "tree"):  # the draft is the target: it guesses every token
            assert stats.accepted == stats.proposed > 0 and stats.rounds < len(plain), method


def test_lookup_and_draft_chains_share_a_pass_on_a_repeated_passage(generator):
    """The continuation of a repeated passage is in the prompt: ngram accepts it, and hybrid,
    verifying the lookup and the draft chains in one pass, needs fewer passes than the lookup
    and no more than the (perfect) draft."""
    text = PROMPT + generator.complete(PROMPT, SamplingParams(max_tokens=24), SpeculativeParams("none")) + \
        " " + PROMPT[:40]
    expected = _ids(generator, text, "none")
    stats = {m: DecodeStats() for m in ("draft", "ngram", "hybrid")}
    for method, s in stats.items():
        assert _ids(generator, text, method, s, num_speculative_tokens=4, adaptive=False) == expected, method
    assert stats["ngram"].accepted > 0
    assert stats["hybrid"].rounds <= stats["draft"].rounds and stats["hybrid"].rounds < stats["ngram"].rounds


def test_seeded_sampled_text_is_the_same_for_every_method_and_call(generator):
    """A seed fixes the sampled text: the same on every call and for every method, equal to
    plain sampling with that seed (a repeated passage lets the lookup methods accept)."""
    text = PROMPT + PROMPT[:60]
    ids = generator.tokenizer.encode(text)
    sampling = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=1234)

    def sample(method):
        spec = SpeculativeParams(method, num_speculative_tokens=4, tree_width=3)
        return [t for chunk in generator.engine.generate(ids, sampling, spec) for t in chunk]

    plain = sample("none")
    for method in ("draft", "tree", "ngram", "suffix", "hybrid", "suffix"):
        assert sample(method) == plain, method
    assert sample("none") != [t for chunk in generator.engine.generate(
        ids, SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=1235),
        SpeculativeParams("none")) for t in chunk]
def test_a_prefix_cache_hit_decodes_as_a_cold_run_for_each_method(generator):
    cold = generator.engine
    cached = SpeculativeEngine(cold.target, cold.proposers.values(), cold.context, eos_ids=cold.eos_ids,
                               prefix_cache=PrefixCache(64 << 20))
    ids = generator.tokenizer.encode(PROMPT * 8)  # ~160 tokens: two whole blocks
    for method in ("none", "suffix", "draft"):
        spec = SpeculativeParams(method, num_speculative_tokens=4)
        expected = [t for chunk in cold.generate(ids, SamplingParams(max_tokens=24), spec) for t in chunk]
        cached.prefix_cache.clear()
        for run in range(2):
            stats = DecodeStats()
            got = [t for chunk in cached.generate(ids, SamplingParams(max_tokens=24), spec, stats) for t in chunk]
            assert got == expected, (method, run)
            assert stats.cached_prompt_tokens == (0 if run == 0 else (len(ids) - 1) // 64 * 64), (method, run)


def test_a_chats_next_turn_starts_with_the_tokens_of_its_last_prompt(generator):
    """The chat template renders the earlier turns unchanged and the tokenizer splits at the
    turn boundary, so turn n + 1's tokens start with turn n's prompt (the prefix cache's hit)."""
    tokenizer = generator.tokenizer
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "Name a river in Europe."}]
    first = tokenizer.encode(tokenizer.apply_chat_template(messages))
    messages += [{"role": "assistant", "content": "The Danube."},
                 {"role": "user", "content": "And one in Asia?"}]
    second = tokenizer.encode(tokenizer.apply_chat_template(messages))
    assert len(second) > len(first) and second[:len(first)] == first
