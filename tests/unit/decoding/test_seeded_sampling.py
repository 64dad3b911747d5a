"""Seeded sampling draws each position's token by Gumbel-max from noise keyed by (seed,
position): the text is the same on every call and for every speculative method, and each
token is still distributed as the sampling distribution. Log-probabilities are the target's
at each emitted token, whatever the method."""
import numpy as np
import pytest

from dspark.decoding.sampling import SamplingParams, SpeculativeParams, distribution, log_softmax, seeded_token
from tests.unit.decoding.test_spec_engine import ENGINES, VOCAB, g_test_p_value, run

METHODS = ("none", "draft", "tree", "ngram", "suffix", "hybrid")
PROMPT = [1, 5, 9, 1, 5, 9, 1, 5]  # repeats: the lookup methods propose


def test_seeded_token_frequencies_over_seeds_match_p():
    """G-test at alpha 0.001 on 20000 fixed seeds (deterministic: it cannot flake); a sampler
    that ignored p's shape (e.g. uniform over its support) fails it."""
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04, 0.0])
    n = 20000
    counts = np.bincount([seeded_token(p, seed, 17) for seed in range(n)], minlength=len(p))
    assert counts[-1] == 0  # a token of probability 0 is never drawn
    assert g_test_p_value(counts.astype(float), p * n) > 1e-3
    uniform = np.where(p > 0, 1.0, 0.0) / (p > 0).sum()
    assert g_test_p_value(counts.astype(float), uniform * n) < 1e-3


def test_seeded_token_frequencies_over_positions_match_p():
    p = np.array([0.7, 0.2, 0.1])
    n = 20000
    counts = np.bincount([seeded_token(p, 3, position) for position in range(n)], minlength=3)
    assert g_test_p_value(counts.astype(float), p * n) > 1e-3


def _sampling(seed, **extra):
    return SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=seed, **extra)


def _spec(method):
    return SpeculativeParams(method, num_speculative_tokens=3, tree_width=3)


@pytest.mark.parametrize("engine_seed", [1, 3])
def test_seeded_text_is_the_same_on_every_call_and_for_every_method(engine_seed):
    engine = ENGINES[engine_seed]
    texts = {}
    for seed in range(4):
        plain = run(engine, PROMPT, _sampling(seed), _spec("none"))
        for method in METHODS:
            for _ in range(2):
                assert run(engine, PROMPT, _sampling(seed), _spec(method)) == plain, (method, seed)
        texts[seed] = plain
    assert len({tuple(t) for t in texts.values()}) > 1  # the seed does change the sample


def test_seeded_text_is_plain_gumbel_max_sampling_of_the_target():
    """The output is, token by token, argmax(log p + G(seed, position)) of the target's
    sampling distribution after the text so far."""
    engine = ENGINES[2]
    sampling = _sampling(11)
    out = run(engine, PROMPT, sampling, _spec("suffix"))
    target = engine.target
    cache = target.new_cache()
    logits = target.forward(cache, PROMPT + out[:-1], np.arange(len(PROMPT) + len(out) - 1))
    for i, token in enumerate(out):
        position = len(PROMPT) + i
        assert token == seeded_token(distribution(logits[position - 1], sampling), 11, position)


def test_seeded_sampling_keeps_the_sampling_distribution_on_the_engine():
    """The first token over many seeds, through speculation, follows p (top-k 3)."""
    engine = ENGINES[2]
    sampling = SamplingParams(max_tokens=1, temperature=1.0, top_k=3)
    target = engine.target
    p = distribution(target.forward(target.new_cache(), PROMPT, np.arange(len(PROMPT)))[-1], sampling)
    n = 1500
    counts = np.zeros(VOCAB)
    for seed in range(n):
        s = SamplingParams(max_tokens=1, temperature=1.0, top_k=3, seed=seed)
        counts[run(engine, PROMPT, s, _spec("suffix"))[0]] += 1
    assert g_test_p_value(counts, p * n) > 1e-3


def _logprobs(engine, sampling, method):
    tokens, entries = [], []
    for chunk in engine.generate(PROMPT, sampling, _spec(method)):
        tokens += chunk
        entries += chunk.logprobs
    return tokens, entries


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.9, 5)])
def test_logprobs_are_the_targets_log_softmax_for_every_method(temperature, seed):
    engine = ENGINES[1]
    sampling = SamplingParams(max_tokens=10, temperature=temperature, seed=seed, logprobs=4)
    tokens, entries = _logprobs(engine, sampling, "none")
    target = engine.target
    logits = target.forward(target.new_cache(), PROMPT + tokens[:-1],
                            np.arange(len(PROMPT) + len(tokens) - 1))
    assert [e.token for e in entries] == tokens
    for i, entry in enumerate(entries):
        logp = log_softmax(logits[len(PROMPT) - 1 + i])
        assert entry.logprob == pytest.approx(logp[entry.token], abs=1e-9)
        assert [t for t, _ in entry.top] == list(np.argsort(-logp, kind="stable")[:4])
        assert [v for _, v in entry.top] == pytest.approx(sorted(logp, reverse=True)[:4], abs=1e-9)
        if temperature == 0.0:
            assert entry.top[0][0] == entry.token
    for method in METHODS[1:]:
        assert _logprobs(engine, sampling, method) == (tokens, entries), method


def test_no_logprobs_unless_asked():
    chunks = list(ENGINES[0].generate(PROMPT, SamplingParams(max_tokens=4), _spec("draft")))
    assert all(chunk.logprobs is None for chunk in chunks)
    top0 = [e for c in ENGINES[0].generate(PROMPT, SamplingParams(max_tokens=4, logprobs=0),
                                           _spec("draft")) for e in c.logprobs]
    assert len(top0) == 4 and all(e.top == () and e.logprob <= 0 for e in top0)
