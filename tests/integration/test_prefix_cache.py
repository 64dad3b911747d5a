"""Prefix caching on the real server's spec_lm (SmolLM2, the cache on by default): the same long
prompt twice over /generate gives the same text with the second's rows copied, as /metrics
shows, and a 3-turn chat over the OpenAI API (the real `openai` SDK) reuses the earlier turns'
rows."""
from __future__ import annotations

import uuid


from tests.integration.spec_client import completion, metric

MODEL = "spec_lm"
ROWS = "dspark_speculative_prefix_cache_rows_reused_total"
HITS = "dspark_speculative_prefix_cache_hits_total"


def _passage(tag: str, sentences: int) -> str:
    """Text no other test sends (``tag``), about 20 tokens a sentence."""
    return " ".join(f"Entry {i} of log {tag}: the pump in room {i % 7} was checked and found working."
                    for i in range(sentences))


def test_a_long_prompt_sent_twice_gives_the_same_text_from_cached_rows(triton_server):
    prompt = _passage(uuid.uuid4().hex[:8], 40) + "\nSummary:"  # ~800 tokens
    rows, hits = metric(triton_server, MODEL, ROWS), metric(triton_server, MODEL, HITS)
    first = completion(triton_server, MODEL, prompt, max_tokens=24, speculative={"method": "none"})
    assert metric(triton_server, MODEL, ROWS) == rows  # a prompt never seen: nothing to reuse
    second = completion(triton_server, MODEL, prompt, max_tokens=24, speculative={"method": "none"})
    assert second == first and len(first) > 10
    reused = metric(triton_server, MODEL, ROWS) - rows
    assert reused >= 640 and reused % 64 == 0  # whole 64-token blocks of the ~800-token prompt
    assert metric(triton_server, MODEL, HITS) == hits + 1
    assert metric(triton_server, MODEL, "dspark_speculative_prefix_cache_bytes") > 0


def test_each_turn_of_a_chat_reuses_the_turns_before_it(client, triton_server):
    tag = uuid.uuid4().hex[:8]
    messages = [{"role": "system", "content": "You are a maintenance assistant. " + _passage(tag, 8)}]
    reused = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"Question {turn}: " + _passage(f"{tag}-{turn}", 4)
                         + " Which rooms were checked?"})
        before = metric(triton_server, MODEL, ROWS)
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
        reused.append(metric(triton_server, MODEL, ROWS) - before)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert reused[0] == 0  # the first turn is new
    # each later turn starts with the whole conversation before it: at least the rows of the
    # system message and the first question (~240 tokens), growing with the turns
    assert 192 <= reused[1] < reused[2]
