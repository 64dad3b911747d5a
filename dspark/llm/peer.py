"""llama.cpp's figures for a GGUF, for checking dspark's runtime against the reference
implementation: teacher-forced perplexity on held-out text, greedy tokens after a prompt.

Needs the optional benchmark set (``make bench-deps``: ``llama-cpp-python``); the tests read the
stored result (``dspark llm reference GGUF --out FILE`` writes it), so CI never needs llama.cpp.
llama.cpp's weight repacking ("extra buffer types", its AMX kernels) stays off: on the Sapphire
Rapids VMs seen here its AMX kernel dies with SIGILL.
"""
from __future__ import annotations

import platform
from pathlib import Path

import numpy as np

from dspark.llm.evaluate import heldout_text, window_nll

GREEDY_PROMPT = "Question: Why is the sky blue?\nAnswer:"
# Texts whose tokens (control tokens matched, BOS first) the tokenizer tests compare.
TOKENIZE_CHECKS = ("<start_of_turn>user\nhi 你好 🦙\t\t<end_of_turn>\n", "  two  spaces,\n\nnew lines and ü ñ ß",
                   "def f(x):\n    return x ** 2  # 12345 67.8", "<|im_start|>system\nYou are helpful.<|im_end|>")


def plain_llama_cpp_buffers() -> None:
    """Turn llama.cpp's "extra buffer types" (weight repacking, its AMX kernels) off for the
    models loaded after: built with GGML_NATIVE on a Sapphire Rapids VM its AMX Q4_1 kernel died
    with SIGILL; off, the weights run on its AVX-512/AVX2 dot products, as on CPUs without AMX."""
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


def llama_cpp_reference(gguf: Path, topics=("class",), n_tokens: int = 512, greedy_tokens: int = 32,
                        threads: int = 2) -> dict:
    """{"tokens": the first ``n_tokens`` of the held-out text as llama.cpp tokenizes it (BOS
    first), "ppl": its teacher-forced perplexity over them in one window, "greedy_prompt",
    "greedy_prompt_tokens", "greedy": llama.cpp's first ``greedy_tokens`` greedy tokens}."""
    import llama_cpp
    from llama_cpp import Llama

    plain_llama_cpp_buffers()
    llm = Llama(model_path=str(gguf), n_ctx=n_tokens, n_batch=n_tokens, n_threads=threads,
                n_threads_batch=threads, logits_all=True, verbose=False)
    tokens = llm.tokenize(heldout_text(topics).encode(), add_bos=True, special=False)[:n_tokens]
    llm.reset()
    llm.eval(tokens)
    logits = np.array(llm.scores[:len(tokens)], np.float32)
    ppl = float(np.exp(window_nll(logits, tokens).mean()))
    prompt = llm.tokenize(GREEDY_PROMPT.encode(), add_bos=True, special=False)
    llm.reset()
    llm.eval(prompt)
    greedy = []
    while len(greedy) < greedy_tokens:
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy.append(token)
        llm.eval([token])
    checks = {text: [int(t) for t in llm.tokenize(text.encode(), add_bos=True, special=True)]
              for text in TOKENIZE_CHECKS}
    return {"gguf": Path(gguf).name, "tokenize": checks, "llama_cpp": llama_cpp.__version__, "cpu": platform.processor() or
            platform.machine(), "topics": list(topics), "tokens": [int(t) for t in tokens], "ppl": ppl,
            "greedy_prompt": GREEDY_PROMPT, "greedy_prompt_tokens": [int(t) for t in prompt], "greedy": greedy}
