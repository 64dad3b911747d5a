"""The imported SmolLM2-135M-Instruct's tokenizer (make setup runs tools/build_llm.py) against
llama.cpp's token ids, and its chat template."""
from __future__ import annotations

import pytest

from dspark.errors import RequestError
from dspark.llm.importer import smollm2_dir
from dspark.llm.tokenizer import LlamaTokenizer


@pytest.fixture(scope="module")
def tokenizer():
    path = smollm2_dir() / "tokenizer.json"
    assert path.is_file(), f"{path} missing: run make setup (tools/build_llm.py)"
    return LlamaTokenizer.load(path)


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
