"""The speculative backend serving the real models (SmolLM2-135M-Instruct, `spec_lm`; Gemma 3
270M Q4_K_M, `gemma_lm`, for greedy identity) on the real server: chat template, end of
sequence, stop strings, every method against plain decoding, streaming, batched concurrent
requests. Serving behaviour that does not depend on the model (bad inputs, cancellation,
unload) is tested on the fast fixture in test_spec_serving.py."""
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.integration.spec_client import completion, generate, metric, stream_once

MODEL = "spec_lm"
QUESTION = "What is the capital of France? Answer in one sentence."
CODE = "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n"
REWRITE = ("Rewrite this sentence in plain words: The committee has reached a consensus that the "
           "proposal should be deferred until further data becomes available.")


@pytest.fixture(scope="module")
def server(triton_server):
    return triton_server


def chat(server, messages, **sampling):
    body = {"messages": json.dumps(messages), "sampling_parameters": json.dumps(sampling)}
    reply = requests.post(f"http://{server.http_url}/v2/models/{MODEL}/generate", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["text_output"]


def test_a_chat_request_gets_the_assistants_answer_ended_by_the_model(server):
    answer = chat(server, [{"role": "user", "content": QUESTION}], max_tokens=32)
    assert "Paris" in answer and "<|im" not in answer
    # the model's end-of-turn token ended it: a larger budget gives the same text
    assert chat(server, [{"role": "user", "content": QUESTION}], max_tokens=64) == answer


def test_chat_true_applies_the_template_to_text_input(server):
    body = {"text_input": QUESTION, "sampling_parameters": json.dumps({"max_tokens": 32, "chat": True})}
    reply = requests.post(f"http://{server.http_url}/v2/models/{MODEL}/generate", json=body, timeout=120)
    assert reply.status_code == 200
    assert reply.json()["text_output"] == chat(server, [{"role": "user", "content": QUESTION}], max_tokens=32)
    assert completion(server, MODEL, QUESTION, max_tokens=32) != reply.json()["text_output"]  # no template


@pytest.mark.parametrize("model, prompt", [(MODEL, CODE), (MODEL, REWRITE), ("gemma_lm", CODE), ("gemma_lm", REWRITE)])
def test_greedy_text_is_identical_for_every_method(server, model, prompt):
    """SmolLM2 (Q4_1) and Gemma 3 (Q4_K_M, its K-quant blocks run as stored): every method's
    greedy text is plain decoding's."""
    methods = requests.post(f"http://{server.http_url}/v2/models/{model}/generate", timeout=60, json={
        "text_input": "x", "sampling_parameters": json.dumps({"speculative": {"method": "?"}})}).json()["error"]
    plain = completion(server, model, prompt, max_tokens=24, speculative={"method": "none"})
    assert len(plain) > 20
    names = [m for m in ("ngram", "suffix", "dspark", "hybrid", "draft", "tree") if f"'{m}'" in methods]
    assert {"ngram", "suffix"} <= set(names)
    for method in names:
        assert completion(server, model, prompt, max_tokens=24, speculative={"method": method}) == plain, (model, method)


def test_stop_string_ends_the_text_before_it(server):
    whole = completion(server, MODEL, CODE, max_tokens=24)
    stop = whole[12:16]
    assert completion(server, MODEL, CODE, max_tokens=24, stop=[stop]) == whole[:whole.index(stop)]


def test_requests_ended_by_stop_strings_while_others_decode_leave_the_server_up(server):
    """A request that ends at a stop string is answered while the round batcher may be asking
    whether it was cancelled; Triton 2.51 dies if that question reaches it after the answer."""
    whole = completion(server, MODEL, CODE, max_tokens=24)
    stops = [whole[i:i + 3] for i in range(4, 20, 2)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda stop: completion(server, MODEL, CODE, max_tokens=24, stop=[stop]),
                            stops * 4))
    assert got == [whole[:whole.index(stop)] for stop in stops * 4]
    assert completion(server, MODEL, CODE, max_tokens=24) == whole


def test_streamed_deltas_add_up_to_the_text(server):
    streamed = stream_once(server, MODEL, CODE, {"max_tokens": 24})
    assert streamed.final and len(streamed.pieces) > 1
    assert streamed.text == completion(server, MODEL, CODE, max_tokens=24)
    events = []
    body = {"text_input": CODE, "stream": True, "sampling_parameters": json.dumps({"max_tokens": 24})}
    with requests.post(f"http://{server.http_url}/v2/models/{MODEL}/generate_stream", json=body,
                       stream=True, timeout=120) as reply:
        for line in reply.iter_lines():
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:])["text_output"])
    assert "".join(events) == streamed.text


def test_concurrent_requests_verified_together_get_their_own_text(server):
    prompts = [CODE, REWRITE, "The three primary colors are", "import numpy as np\n\n"]
    expected = [completion(server, MODEL, p, max_tokens=16) for p in prompts]
    passes = metric(server, MODEL, "dspark_speculative_target_passes_total")
    calls = metric(server, MODEL, "dspark_speculative_target_calls_total")
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: completion(server, MODEL, p, max_tokens=16), prompts))
    assert got == expected
    passes = metric(server, MODEL, "dspark_speculative_target_passes_total") - passes
    calls = metric(server, MODEL, "dspark_speculative_target_calls_total") - calls
    assert calls < 0.8 * passes, f"{passes:.0f} passes in {calls:.0f} calls: not batched"


def test_a_prompt_longer_than_the_context_is_refused(server):
    reply = generate(server, MODEL, "the cat sat on the mat. " * 600, max_tokens=4)
    assert reply.status_code == 400 and reply.json()["error"].startswith("text_input: prompt is")
