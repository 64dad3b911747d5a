"""Sample requests against the demo repository, as a user would send them with tritonclient."""
from __future__ import annotations

import json
import time
import urllib.request
from typing import Callable

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

FEATURES = 16
CHAT_QUESTION = "Why is the sky blue? Answer in two sentences."
CODE_PROMPT = ("Complete this Python function. Reply with the code only.\n\n"
               "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
CLASSES = ("setosa-like", "versicolor-like", "virginica-like", "other")


def sample_features(rows: int = 2, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, FEATURES)).astype(np.float32)


def classify(client_module, url: str, model: str, input_name: str, features: np.ndarray) -> np.ndarray:
    """One classification call through tritonclient.http or tritonclient.grpc (same API)."""
    tensor = client_module.InferInput(input_name, list(features.shape), "FP32")
    tensor.set_data_from_numpy(features)
    return client_module.InferenceServerClient(url).infer(model, [tensor]).as_numpy("probabilities")


def generate_http(url: str, model: str, prompt: str, chat: bool = False, **sampling) -> tuple[str, float]:
    """Triton's generate endpoint, as LLM clients call it: the reply (a chat's answer, or the
    continuation of a prompt) and the seconds it took."""
    body = json.dumps({"text_input": prompt, "exclude_input_in_output": True,
                       "sampling_parameters": json.dumps({**sampling, "chat": chat})}).encode()
    request = urllib.request.Request(f"http://{url}/v2/models/{model}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        text = json.loads(response.read())["text_output"]
    return text, time.perf_counter() - start


# The demo repository's LLMs: model name -> what it serves.
LLMS = {"spec_lm": "SmolLM2-135M-Instruct", "gemma_lm": "Gemma 3 270M base, Q4_K_M"}


def _plain_and_speculative(http_url: str, echo: Callable[[str], None], label: str, prompt: str,
                           chat: bool, max_tokens: int, model: str = "spec_lm") -> None:
    """The same greedy request without speculation and with the model's default method."""
    plain, plain_s = generate_http(http_url, model, prompt, chat, max_tokens=max_tokens,
                                   speculative={"method": "none"})
    fast, fast_s = generate_http(http_url, model, prompt, chat, max_tokens=max_tokens)
    echo(f"{model} ({LLMS[model]}) {label} over HTTP /generate, greedy, up to {max_tokens} "
         f"tokens: plain {plain_s * 1e3:.0f} ms, speculative {fast_s * 1e3:.0f} ms, identical text: "
         f"{plain == fast}")
    echo("  " + fast.strip().replace("\n", "\n  "))


def _describe(row: np.ndarray) -> str:
    return f"  class={CLASSES[int(row.argmax())]:<16} probabilities=[{', '.join(f'{p:.4f}' for p in row)}]"


def openai_chat(openai_url: str, model: str, question: str, max_tokens: int) -> tuple[str, float]:
    """One chat completion through the OpenAI-compatible API, with the real openai SDK."""
    import openai

    client = openai.OpenAI(base_url=openai_url, api_key="unused-on-loopback", max_retries=0)
    start = time.perf_counter()
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                           max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content, time.perf_counter() - start


def openai_curl(openai_url: str, model: str, question: str) -> str:
    """The same greedy request as a curl line (without a temperature OpenAI samples at 1)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": question}],
                       "max_tokens": 64, "temperature": 0})
    return f"curl -s {openai_url}/chat/completions -H 'Content-Type: application/json' -d '{body}'"


def run_samples(http_url: str, grpc_url: str, echo: Callable[[str], None] = print,
                openai_url: str = "") -> None:
    features = sample_features()
    probabilities = classify(httpclient, http_url, "mlp_classifier", "features", features)
    echo("mlp_classifier over HTTP (2 rows of 16 standardized features):")
    for row in probabilities:
        echo(_describe(row))
    raw = features * 2.5 + 10.0  # unscaled measurements; the ensemble standardizes them first
    probabilities = classify(grpcclient, grpc_url, "scaled_classifier", "raw_features", raw)
    echo("scaled_classifier ensemble over gRPC (feature_scaler -> mlp_classifier, raw measurements):")
    for row in probabilities:
        echo(_describe(row))
    echo(f"chat question: {CHAT_QUESTION}")
    for model in LLMS:
        _plain_and_speculative(http_url, echo, "chat", CHAT_QUESTION, True, 64, model)
    echo("code completion: " + CODE_PROMPT.splitlines()[0])
    _plain_and_speculative(http_url, echo, "code completion", CODE_PROMPT, True, 96)
    if openai_url:
        for model in LLMS:
            text, seconds = openai_chat(openai_url, model, CHAT_QUESTION, 64)
            echo(f"{model} chat over the OpenAI API ({openai_url}, openai SDK), greedy: {seconds * 1e3:.0f} ms")
            echo("  " + text.strip().replace("\n", "\n  "))
        echo("  try: " + openai_curl(openai_url, "gemma_lm", CHAT_QUESTION))
