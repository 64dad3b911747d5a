"""Log-probabilities through the OpenAI-compatible API in front of the real server's spec_lm
(SmolLM2), with the real `openai` SDK: chat (`logprobs`, `top_logprobs`) and legacy completions
(`logprobs: N`), streamed and not; the same values as Triton's generate endpoint reports, for
every speculative method; and a seeded sampled text that does not depend on the method."""
from __future__ import annotations

import json
import math

import openai
import pytest
import requests

from tests.integration.test_openai_endpoint import MODEL, QUESTION

PROMPT = "The three primary colours are"


def _check_entries(tokens, chosen, tops, greedy=True):
    """Each token's logprob finite and <= 0, its top list sorted, holding the chosen token
    when greedy (the argmax is the most likely token)."""
    assert tokens
    for token, logprob, top in zip(tokens, chosen, tops):
        assert math.isfinite(logprob) and logprob <= 0
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True) and all(math.isfinite(v) and v <= 0 for v in values)
        if greedy:
            assert top[0][0] == token and top[0][1] == pytest.approx(logprob)


def test_chat_logprobs_not_streamed_and_streamed_agree(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=16,
                  temperature=0, logprobs=True, top_logprobs=3)
    reply = client.chat.completions.create(**kwargs)
    content = reply.choices[0].logprobs.content
    assert "".join(c.token for c in content) == reply.choices[0].message.content
    _check_entries([c.token for c in content], [c.logprob for c in content],
                   [[(t.token, t.logprob) for t in c.top_logprobs] for c in content])
    assert all(len(c.top_logprobs) == 3 and bytes(c.bytes).decode() == c.token for c in content)
    streamed = [c for chunk in client.chat.completions.create(**kwargs, stream=True)
                for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_chat_without_logprobs_has_none(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=4, temperature=0)
    assert reply.choices[0].logprobs is None


def test_completion_logprobs_not_streamed_and_streamed(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2)
    reply = client.completions.create(**kwargs)
    lp = reply.choices[0].logprobs
    assert "".join(lp.tokens) == reply.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    _check_entries(lp.tokens, lp.token_logprobs,
                   [sorted(top.items(), key=lambda kv: -kv[1]) for top in lp.top_logprobs])
    assert all(len(top) == 2 for top in lp.top_logprobs)
    streamed_tokens, streamed_values = [], []
    for chunk in client.completions.create(**kwargs, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed_tokens += chunk.choices[0].logprobs.tokens
            streamed_values += chunk.choices[0].logprobs.token_logprobs
    assert streamed_tokens == lp.tokens and streamed_values == lp.token_logprobs


def test_logprobs_out_of_range_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=MODEL, prompt="hi", logprobs=6)


def _generate(triton_server, method, **sampling):
    body = {"text_input": PROMPT + " red, green and blue. The three primary colours are",
            "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"max_tokens": 16, **sampling, "speculative": {"method": method}})}
    reply = requests.post(f"http://{triton_server.http_url}/v2/models/{MODEL}/generate", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_generate_seeded_text_and_logprobs_are_the_same_for_every_method(triton_server):
    plain = _generate(triton_server, "none", temperature=0.8, seed=42, logprobs=1)
    entries = json.loads(plain["logprobs"])
    assert "".join(e["text"] for e in entries) == plain["text_output"]
    assert all(len(e["top_logprobs"]) == 1 and e["logprob"] <= e["top_logprobs"][0]["logprob"] for e in entries)
    for method in ("ngram", "suffix", "hybrid", "suffix"):
        other = _generate(triton_server, method, temperature=0.8, seed=42, logprobs=1)
        assert other["text_output"] == plain["text_output"], method
        assert json.loads(other["logprobs"]) == entries, method
