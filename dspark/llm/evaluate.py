"""Quality checks of a target runtime: teacher-forced perplexity on held-out text, greedy decoding.

The held-out text is CPython's own reference documentation (``pydoc_data.topics``, shipped with
every CPython), which nothing in dspark trains on.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

# Topics of pydoc_data.topics used as held-out text, in this order.
HELDOUT_TOPICS = ("assignment", "import", "class", "exceptions", "with")


def heldout_text(topics: Sequence[str] = HELDOUT_TOPICS) -> str:
    import pydoc_data.topics

    return "\n\n".join(pydoc_data.topics.topics[name] for name in topics)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def window_nll(logits: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
    """Negative log-likelihood of tokens[1:] given the logits of tokens[:-1]."""
    logp = _log_softmax(logits[:-1])
    return -logp[np.arange(len(tokens) - 1), np.asarray(tokens[1:])]


def perplexity(logits_of: Callable[[Sequence[int]], np.ndarray], tokens: Sequence[int],
               window: int = 512) -> float:
    """exp(mean NLL) over consecutive windows of ``window`` tokens, each evaluated from an empty
    context (``logits_of(window_tokens) -> [len, vocab]``), predicting tokens 1.. of a window."""
    nll = [window_nll(logits_of(tokens[i:i + window]), tokens[i:i + window])
           for i in range(0, len(tokens) - 1, window) if len(tokens[i:i + window]) > 1]
    return math.exp(float(np.concatenate(nll).mean()))


def runtime_logits(runtime) -> Callable[[Sequence[int]], np.ndarray]:
    """``logits_of`` for a target runtime: one pass over the window in a fresh cache."""
    def logits_of(tokens: Sequence[int]) -> np.ndarray:
        cache = runtime.new_cache(len(tokens))
        return runtime.forward(cache, tokens, np.arange(len(tokens)))
    return logits_of


def greedy(runtime, prompt: Sequence[int], max_new: int, eos_id: int | None = None) -> list[int]:
    """Plain greedy decoding, one token per call after the prompt."""
    cache = runtime.new_cache(len(prompt) + max_new)
    logits = runtime.forward(cache, prompt, np.arange(len(prompt)), logit_rows=[len(prompt) - 1])
    out: list[int] = []
    while len(out) < max_new:
        token = int(np.argmax(logits[-1]))
        out.append(token)
        if token == eos_id or len(out) == max_new:
            break
        logits = runtime.forward(cache, [token], [len(prompt) + len(out) - 1])
    return out
