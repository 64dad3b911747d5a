"""The GGUF model's tokenizer on HF ``tokenizers`` (Rust), and its chat template.

Built from ``tokenizer.ggml.tokens`` / ``merges`` the way llama.cpp tokenizes a ``gpt2``-style
vocabulary: digits split one by one, then GPT-2's byte-level pre-tokenizer regex (no prefix
space), byte-level BPE, a byte-level decoder; the control tokens (type 3, e.g.
``<|im_start|>``) are special tokens, matched in the text as llama.cpp's
``tokenize(..., special=True)`` does. The result is saved as one ``tokenizer.json`` next to the
model, so serving loads it without the GGUF.

The chat template is the model's own Jinja program from ``tokenizer.chat_template``, rendered
by jinja2 in a sandbox as HF transformers does.
"""
from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Sequence

from dspark.errors import ConfigError, RequestError

CONTROL_TOKEN_TYPE = 3
_META_KEY = "dspark"  # tokenizer.json entry holding bos/eos ids and the chat template


def build_hf_tokenizer(tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[str]):
    """An HF ``tokenizers.Tokenizer`` for a GGUF ``gpt2`` vocabulary (see module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, token_types) if kind == CONTROL_TOKEN_TYPE])
    return tok


class LlamaTokenizer:
    """encode / decode / chat template of one model; interface of contract C1."""

    def __init__(self, hf_tokenizer, bos_id: int, eos_id: int, chat_template: str | None):
        self._tok = hf_tokenizer
        self.bos_id, self.eos_id = bos_id, eos_id
        self.chat_template = chat_template

    @classmethod
    def from_gguf(cls, model) -> "LlamaTokenizer":
        """From a :class:`dspark.llm.gguf_model.GGUFModel`."""
        tokens, types, merges = model.vocabulary
        cfg = model.config
        return cls(build_hf_tokenizer(tokens, types, merges), cfg.bos_id, cfg.eos_id, cfg.chat_template)

    def save(self, path: str | Path) -> None:
        data = json.loads(self._tok.to_str())
        data[_META_KEY] = {"bos_id": self.bos_id, "eos_id": self.eos_id,
                           "chat_template": self.chat_template}
        Path(path).write_text(json.dumps(data, ensure_ascii=False))

    @classmethod
    def load(cls, path: str | Path) -> "LlamaTokenizer":
        from tokenizers import Tokenizer

        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            meta = data.pop(_META_KEY)
            tok = Tokenizer.from_str(json.dumps(data))
        except (OSError, ValueError, KeyError, Exception) as exc:  # tokenizers raises plain Exception
            raise ConfigError("tokenizer", f"cannot read a dspark tokenizer.json ({exc})", path) from None
        return cls(tok, meta["bos_id"], meta["eos_id"], meta["chat_template"])

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The exact bytes of ``ids``: a streamed token may end inside a UTF-8 character, which
        ``decode`` would replace; feed these to an incremental UTF-8 decoder instead."""
        table = self._token_bytes
        return b"".join(table[i] for i in ids)

    @cached_property
    def _token_bytes(self) -> list[bytes]:
        special = set(self._tok.get_added_tokens_decoder())
        vocab = sorted(self._tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        return [text.encode() if i in special else bytes(_BYTE_DECODER[c] for c in text)
                for text, i in vocab]

    @cached_property
    def _template(self):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not self.chat_template:
            raise RequestError("chat", "this model has no chat template (tokenizer.chat_template)")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_template_error
        try:
            return env.from_string(self.chat_template)
        except TemplateError as exc:
            raise ConfigError("tokenizer.chat_template", f"not a valid Jinja template ({exc})") from None

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (a list of ``{"role", "content"}``), with the
        assistant's turn opened when ``add_generation_prompt``."""
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or not isinstance(message.get("content"), str):
                raise RequestError(f"messages[{i}]", "needs string fields 'role' and 'content'")
        if not messages:
            raise RequestError("messages", "empty list: a chat needs at least one message")
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     bos_token=self.decode([self.bos_id]),
                                     eos_token=self.decode([self.eos_id]))

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))


def _raise_template_error(message: str):
    raise RequestError("messages", f"rejected by the model's chat template: {message}")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to the printable characters byte-level tokens are spelled in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}
