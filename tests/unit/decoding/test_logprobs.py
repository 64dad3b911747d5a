"""Log-probabilities are the target's at each emitted token (its raw log-softmax), the same for
every speculative method, greedy or seeded sampled."""
import numpy as np
import pytest

from dspark.decoding.sampling import SamplingParams, SpeculativeParams, log_softmax
from tests.unit.decoding.test_spec_engine import ENGINES

METHODS = ("none", "draft", "tree", "ngram", "suffix", "hybrid")
PROMPT = [1, 5, 9, 1, 5, 9, 1, 5]  # repeats: the lookup methods propose


def _spec(method):
    return SpeculativeParams(method, num_speculative_tokens=3, tree_width=3)


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
