"""llama.cpp (``llama-cpp-python``, the optional benchmark set: ``make bench-deps``) on the same
GGUF as dspark: loading it, greedy decoding, timed generation (plain or prompt lookup), and the
reference figures the tests store (``dspark llm reference``), so CI never needs llama.cpp.

llama.cpp's "extra buffer types" (weight repacking, its AMX kernels) stay off unless asked for:
built with GGML_NATIVE on a Sapphire Rapids VM its AMX Q4_1 kernel died with SIGILL
(``tilezero`` in an OpenMP worker); off, the weights run on its AVX-512/AVX2 dot products, as on
CPUs without AMX.
"""
from __future__ import annotations

import platform
import time
from pathlib import Path

import numpy as np

from dspark.llm.evaluate import heldout_text, window_nll

GREEDY_PROMPT = "Question: Why is the sky blue?\nAnswer:"
# Texts whose tokens (control tokens matched, BOS first) the tokenizer tests compare.
TOKENIZE_CHECKS = ("<start_of_turn>user\nhi 你好 🦙\t\t<end_of_turn>\n", "  two  spaces,\n\nnew lines and ü ñ ß",
                   "def f(x):\n    return x ** 2  # 12345 67.8", "<|im_start|>system\nYou are helpful.<|im_end|>")


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def version() -> str:
    import llama_cpp

    return llama_cpp.__version__


def plain_buffers() -> None:
    """Turn llama.cpp's extra buffer types off for the models loaded after (see the module)."""
    from llama_cpp import llama_cpp as raw

    if getattr(raw, "_dspark_plain_buffers", False):
        return
    defaults = raw.llama_model_default_params

    def params():
        p = defaults()
        if hasattr(p, "use_extra_bufts"):
            p.use_extra_bufts = False
        return p

    raw.llama_model_default_params = params
    raw._dspark_plain_buffers = True


def load(gguf: str | Path, threads: int, n_ctx: int = 2048, extra_buffers: bool = False, **options):
    """A ``Llama`` on ``gguf`` with ``threads`` for decoding and prompts; ``logits_all`` on, without
    which llama-cpp-python 0.3 no longer copies logits into ``scores``."""
    from llama_cpp import Llama

    if not extra_buffers:
        plain_buffers()
    options = {"n_batch": 512, "logits_all": True, "verbose": False, **options}
    return Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, **options)


def greedy(llm, prompt: list[int], n: int) -> tuple[list[int], float]:
    """``n`` greedy tokens after ``prompt`` (argmax of ``scores``) and the decode rate after the
    first token (tokens/s)."""
    llm.reset()
    llm.eval(prompt)
    out = [int(np.argmax(llm.scores[llm.n_tokens - 1]))]
    t0 = time.perf_counter()
    while len(out) < n:
        llm.eval([out[-1]])
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
    return out, (n - 1) / (time.perf_counter() - t0)


def timed_generations(gguf: Path, prompt_tokens: list[list[int]], max_tokens: int, threads: int,
                      temperature: float, seed: int, prompt_lookup: bool, eos: int,
                      repeats: int = 1, extra_buffers: bool = False) -> list[dict]:
    """Per prompt (the same tokens and threads as dspark's run) its tokens, seconds to the first
    token and decode seconds (median of repeats). ``prompt_lookup``: llama-cpp-python's
    prompt-lookup speculative mode (``LlamaPromptLookupDecoding``)."""
    options = {}
    if prompt_lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        options["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=10)
    llm = load(gguf, threads, extra_buffers=extra_buffers, seed=seed, **options)
    out = []
    for ids in prompt_tokens:
        runs = []
        for _ in range(repeats):
            llm.reset()
            tokens, first = [], None
            start = time.perf_counter()
            sampler = dict(temp=temperature, top_k=1 if temperature == 0 else 0, top_p=1.0, min_p=0.0,
                           repeat_penalty=1.0)
            for token in llm.generate(ids, reset=True, **sampler):
                if first is None:
                    first = time.perf_counter()
                if token == eos:
                    break
                tokens.append(token)
                if len(tokens) >= max_tokens:
                    break
            end = time.perf_counter()
            runs.append({"tokens": tokens, "ttft_s": (first or end) - start, "decode_s": end - (first or end)})
        runs.sort(key=lambda r: r["decode_s"])
        out.append(runs[len(runs) // 2])
    return out


def reference(gguf: Path, topics=("class",), n_tokens: int = 512, greedy_tokens: int = 32,
              threads: int = 2) -> dict:
    """llama.cpp's figures for checking dspark's runtime: {"tokens": the first ``n_tokens`` of the
    held-out text as llama.cpp tokenizes it (BOS first), "ppl": its teacher-forced perplexity over
    them in one window, "greedy_prompt", "greedy_prompt_tokens", "greedy": its first
    ``greedy_tokens`` greedy tokens, "tokenize": the ids of TOKENIZE_CHECKS}."""
    llm = load(gguf, threads, n_ctx=n_tokens, n_batch=n_tokens)
    tokens = llm.tokenize(heldout_text(topics).encode(), add_bos=True, special=False)[:n_tokens]
    llm.reset()
    llm.eval(tokens)
    logits = np.array(llm.scores[:len(tokens)], np.float32)
    ppl = float(np.exp(window_nll(logits, tokens).mean()))
    prompt = llm.tokenize(GREEDY_PROMPT.encode(), add_bos=True, special=False)
    llm.reset()
    llm.eval(prompt)
    greedy_ids = []
    while len(greedy_ids) < greedy_tokens:
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy_ids.append(token)
        llm.eval([token])
    checks = {text: [int(t) for t in llm.tokenize(text.encode(), add_bos=True, special=True)]
              for text in TOKENIZE_CHECKS}
    return {"gguf": Path(gguf).name, "tokenize": checks, "llama_cpp": version(), "cpu": platform.processor() or
            platform.machine(), "topics": list(topics), "tokens": [int(t) for t in tokens], "ppl": ppl,
            "greedy_prompt": GREEDY_PROMPT, "greedy_prompt_tokens": [int(t) for t in prompt], "greedy": greedy_ids}
