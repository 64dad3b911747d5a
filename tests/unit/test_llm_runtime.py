"""The imported SmolLM2-135M-Instruct (make setup runs tools/build_llm.py) on OnnxLlama: greedy
speculation's requirement (a verified chain, a batch of requests and plain decoding give the
same bits), trees, the cache, perplexity against a stored reference, the tokenizer against
llama.cpp's token ids."""
from __future__ import annotations

import numpy as np
import pytest

from dspark.errors import RequestError
from dspark.llm.evaluate import heldout_text, perplexity, runtime_logits
from dspark.llm.importer import smollm2_dir
from dspark.llm.onnx_runtime import OnnxLlama
from dspark.llm.tokenizer import LlamaTokenizer

# Teacher-forced perplexity on the first 512 tokens of dspark.llm.evaluate.heldout_text()
# (CPython 3.11's reference docs), measured by tools/bench_llm.py quality: our import, and
# llama.cpp (llama-cpp-python 0.3.36, logits_all) on the same GGUF. A broken import (RoPE
# pairing, Q4_1 offsets, norms) lands far from both.
PPL_OURS = 16.195
PPL_LLAMA_CPP = 16.117
PPL_TOLERANCE = 0.01  # int8 activation rounding differs a little between instruction sets


@pytest.fixture(scope="module")
def folder():
    path = smollm2_dir()
    assert (path / "model.onnx").is_file(), f"{path} missing: run make setup (tools/build_llm.py)"
    return path


@pytest.fixture(scope="module")
def runtime(folder):
    return OnnxLlama(folder / "model.onnx", max_context=1024)


@pytest.fixture(scope="module")
def tokenizer(folder):
    return LlamaTokenizer.load(folder / "tokenizer.json")


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(100, 40000, n)]


def _prefilled(runtime, prompt):
    cache = runtime.new_cache()
    runtime.forward(cache, prompt, np.arange(len(prompt)), logit_rows=[len(prompt) - 1])
    return cache


def test_chain_verification_equals_plain_decoding_bitwise(runtime):
    prompt, chain = _prompt(37), _prompt(8, seed=1)
    p = len(prompt)
    plain_cache = _prefilled(runtime, prompt)
    plain = np.stack([runtime.forward(plain_cache, [tok], [p + j])[0] for j, tok in enumerate(chain)])
    cache = _prefilled(runtime, prompt)
    whole = runtime.forward(cache, chain, p + np.arange(8))
    assert np.array_equal(whole, plain)
    cache = _prefilled(runtime, prompt)  # accepted 3, then a chain of 5 from there
    first = runtime.forward(cache, chain[:3], p + np.arange(3))
    second = runtime.forward(cache, chain[3:], p + 3 + np.arange(5))
    assert np.array_equal(np.concatenate([first, second]), plain)
    assert cache.length == plain_cache.length == p + 8


def test_batched_requests_equal_single_requests_bitwise(runtime):
    prompts = [_prompt(n, seed=n) for n in (30, 12, 21)]
    drafts = [_prompt(t, seed=10 + t) for t in (4, 1, 6)]
    single = []
    for prompt, draft in zip(prompts, drafts):
        cache = _prefilled(runtime, prompt)
        single.append(runtime.forward(cache, draft, len(prompt) + np.arange(len(draft)), want_taps=True))
    caches = [_prefilled(runtime, prompt) for prompt in prompts]
    batched = runtime.forward_batch([(c, d, len(p) + np.arange(len(d)), None)
                                     for c, p, d in zip(caches, prompts, drafts)], want_taps=True)
    for (logits, taps), (ref_logits, ref_taps) in zip(batched, single):
        assert np.array_equal(logits, ref_logits) and np.array_equal(taps, ref_taps)
    assert [c.length for c in caches] == [len(p) + len(d) for p, d in zip(prompts, drafts)]


def _probs(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_tree_verification_matches_the_chain(runtime, tokenizer):
    """Tree rows see only their ancestors: the same predictions as the chain, up to rounding
    (not bitwise: attention sums a row's keys from other cache slots than plain decoding does,
    and int8 activations turn last-bit differences into small logit changes). keep_rows
    compacts the accepted path, and decoding continues as after the chain."""
    text = tokenizer.encode(heldout_text(("class",)))
    prompt, chain = text[:40], text[40:46]
    p = len(prompt)
    chain_cache = _prefilled(runtime, prompt)
    ref = runtime.forward(chain_cache, chain, p + np.arange(6))
    # siblings first: [s0, c0, s1, c1, ...], s_j and c_j children of c_{j-1}
    tokens, positions, parents = [], [], []
    for j, tok in enumerate(chain):
        tokens += [tok + 7, tok]
        positions += [p + j, p + j]
        parents += [2 * j - 1, 2 * j - 1]
    mask = np.eye(len(tokens), dtype=bool)
    for i in range(len(tokens)):
        a = parents[i]
        while a >= 0:
            mask[i, a], a = True, parents[a]
    cache = _prefilled(runtime, prompt)
    path = runtime.forward(cache, tokens, positions, tree_mask=mask)[1::2]
    assert np.array_equal(path.argmax(-1), ref.argmax(-1))
    assert np.abs(_probs(path) - _probs(ref)).max() < 0.1
    cache.keep_rows(p, np.arange(1, len(tokens), 2))
    assert cache.length == p + 6 and np.array_equal(cache.positions[p:p + 6], p + np.arange(6))
    nxt = runtime.forward(cache, [text[46]], [p + 6])
    ref_nxt = runtime.forward(chain_cache, [text[46]], [p + 6])
    assert nxt.argmax() == ref_nxt.argmax() and np.abs(_probs(nxt) - _probs(ref_nxt)).max() < 0.1


def test_logit_rows_and_taps(runtime):
    prompt = _prompt(20)
    full, taps = runtime.forward(runtime.new_cache(), prompt, np.arange(20), want_taps=True)
    last = runtime.forward(runtime.new_cache(), prompt, np.arange(20), logit_rows=[19, 3])
    assert np.array_equal(last, full[[19, 3]])
    assert runtime.tap_layers == (3, 15, 27)
    assert taps.shape == (20, 3 * runtime.config.hidden) and np.isfinite(taps).all()
    # the residual stream grows with depth in this model: the deepest tap is the largest
    norms = np.linalg.norm(taps.reshape(20, 3, -1), axis=-1).mean(0)
    assert norms[0] < norms[1] < norms[2]


def test_cache_bounds(runtime):
    cache = runtime.new_cache(16)
    runtime.forward(cache, _prompt(10), np.arange(10))
    with pytest.raises(ValueError, match="context full"):
        runtime.forward(cache, _prompt(7), 10 + np.arange(7))
    assert cache.length == 10
    cache.truncate(4)
    assert cache.length == 4
    with pytest.raises(ValueError, match="max_context"):
        runtime.new_cache(runtime.config.ctx + 1)
    for bad in ([-1], [runtime.config.vocab]):
        with pytest.raises(ValueError, match="token ids"):
            runtime.forward(cache, bad, [4])
    with pytest.raises(ValueError, match="tree_mask"):
        runtime.forward(cache, [1, 2], [4, 5], tree_mask=np.ones((3, 3), bool))
    assert cache.length == 4


def test_perplexity_matches_the_stored_references(runtime, tokenizer):
    tokens = tokenizer.encode(heldout_text())[:512]
    ppl = perplexity(runtime_logits(runtime), tokens)
    assert abs(ppl - PPL_OURS) < PPL_TOLERANCE * PPL_OURS, ppl
    assert abs(ppl - PPL_LLAMA_CPP) < 0.02 * PPL_LLAMA_CPP, ppl  # within 2 % of llama.cpp


# Token ids from llama.cpp (llama-cpp-python 0.3.36, `tokenize(text, add_bos=False, special=True)`)
# on the same GGUF.
LLAMA_CPP_IDS = [
    ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
     [1604, 3987, 24, 94, 727, 472, 253, 28, 278, 446, 216, 32, 28, 216, 33, 472, 327, 2483, 281, 1845, 24,
      94, 727, 448, 253, 28, 278, 446, 278, 28, 253, 1232, 278, 472, 1003, 253, 198]),
    ("The year 2024 had 366 days; pi is 3.14159.",
     [504, 713, 216, 34, 32, 34, 36, 761, 216, 35, 38, 38, 2009, 43, 16916, 314, 216, 35, 30, 33, 36, 33,
      37, 41, 30]),
    ("  two spaces,\ttab,\n\n\nthree newlines   and trailing   ",
     [216, 827, 5600, 28, 197, 15999, 28, 1116, 198, 16347, 725, 5110, 256, 284, 35079, 333]),
    ("naïve café — 東京 🙂 Ünïcödé",
     [3546, 46494, 37366, 1841, 17097, 247, 126, 16736, 122, 47526, 5549, 246, 94, 25972, 83, 7466, 84, 2756]),
    ("<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n", [1, 4093, 198, 19556, 17, 2, 198, 1, 520, 9531, 198]),
    ("don't you're I'll we've they'd it's", [12420, 982, 346, 2316, 339, 3060, 392, 3543, 502, 6737, 357, 506]),
    ("x=[1,22,333]; y = {'k': -0.5e-3}",
     [104, 7407, 33, 28, 34, 34, 28, 35, 35, 35, 26695, 329, 446, 7353, 91, 1539, 731, 32, 30, 37, 85, 29, 35, 109]),
    ("<|endoftext|><repo_name>dspark<file_sep>", [0, 3, 931, 33440, 5]),
]


@pytest.mark.parametrize("text,ids", LLAMA_CPP_IDS)
def test_tokenizer_matches_llama_cpp(tokenizer, text, ids):
    assert tokenizer.encode(text) == ids
    assert tokenizer.decode(ids) == text and tokenizer.decode_bytes(ids) == text.encode()


def test_chat_template_is_the_models_own(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(messages) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    with_system = [{"role": "system", "content": "Be brief."}] + messages
    assert tokenizer.apply_chat_template(with_system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
    for bad in ([], [{"role": "user"}], ["hi"]):
        with pytest.raises(RequestError, match="messages"):
            tokenizer.apply_chat_template(bad)
    ids = tokenizer.encode_chat(messages)
    assert ids[0] == 1 and ids[-3:] == tokenizer.encode("assistant\n") and tokenizer.eos_id == 2
    # a character split across tokens: the bytes are exact, a streaming decoder can join them
    emoji = tokenizer.encode("🙂")
    assert len(emoji) > 1 and tokenizer.decode_bytes(emoji) == "🙂".encode()
