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
GENERATE_PROMPT = "def read_config(path):\n    \"\"\"Read the configuration file"
CLASSES = ("setosa-like", "versicolor-like", "virginica-like", "other")


def sample_features(rows: int = 2, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, FEATURES)).astype(np.float32)


def classify(client_module, url: str, model: str, input_name: str, features: np.ndarray) -> np.ndarray:
    """One classification call through tritonclient.http or tritonclient.grpc (same API)."""
    tensor = client_module.InferInput(input_name, list(features.shape), "FP32")
    tensor.set_data_from_numpy(features)
    return client_module.InferenceServerClient(url).infer(model, [tensor]).as_numpy("probabilities")


def generate_http(url: str, model: str, prompt: str, **sampling) -> tuple[str, float]:
    """Triton's generate endpoint, as LLM clients call it: the continuation and the seconds it took."""
    body = json.dumps({"text_input": prompt, "exclude_input_in_output": True,
                       "sampling_parameters": json.dumps(sampling)}).encode()
    request = urllib.request.Request(f"http://{url}/v2/models/{model}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        text = json.loads(response.read())["text_output"]
    return text, time.perf_counter() - start


def _describe(row: np.ndarray) -> str:
    return f"  class={CLASSES[int(row.argmax())]:<16} probabilities=[{', '.join(f'{p:.4f}' for p in row)}]"


def run_samples(http_url: str, grpc_url: str, echo: Callable[[str], None] = print) -> None:
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
    plain, plain_s = generate_http(http_url, "spec_lm", GENERATE_PROMPT, max_tokens=64,
                                   speculative={"method": "none"})
    draft, draft_s = generate_http(http_url, "spec_lm", GENERATE_PROMPT, max_tokens=64,
                                   speculative={"method": "draft"})
    echo(f"spec_lm over HTTP /generate, greedy, 64 tokens: plain {plain_s * 1e3:.0f} ms, "
         f"draft speculation {draft_s * 1e3:.0f} ms, identical text: {plain == draft}")
    echo("  " + (GENERATE_PROMPT + draft).replace("\n", "\n  "))
