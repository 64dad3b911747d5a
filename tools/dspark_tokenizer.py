"""SmolLM2's tokenizer and chat format for the training tools (HF `tokenizers`, from the GGUF).

Serving uses dspark.llm.tokenizer (llm-core); this copy lets tools/train_dspark.py run on its
own branch. Built as ../shared/facts.md records (ids identical to llama.cpp's): BPE from
`tokenizer.ggml.tokens`/`merges`, digits split one by one then byte-level pre-tokenizing, the
control tokens (type 3) as special tokens.
"""
from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def build_tokenizer(reader) -> Tokenizer:
    def strings(key):
        f = reader.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    tokens = strings("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    f = reader.fields["tokenizer.ggml.token_type"]
    types = [int(f.parts[i][0]) for i in f.data]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([t for t, ty in zip(tokens, types) if ty == 3])
    return tok


def chat_text(user: str, system: str = DEFAULT_SYSTEM) -> str:
    """SmolLM2's template (its GGUF metadata) for one user turn, ready for the answer."""
    return (f"<|im_start|>system\n{system}<|im_end|>\n"
            f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
