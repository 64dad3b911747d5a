"""The GGUF model's tokenizer on HF ``tokenizers`` (Rust), and its chat template.

Built from the GGUF's vocabulary the way llama.cpp tokenizes it, for its two kinds:

* ``gpt2`` (SmolLM2, Qwen, Llama 3): byte-level BPE from ``tokenizer.ggml.merges``. The
  pre-tokenizer follows ``tokenizer.ggml.pre``: ``smollm``/``default`` split digits one by one
  and apply GPT-2's regex; ``qwen2`` and ``llama-bpe`` (and the other Llama-3-style names) use
  their own regex, digits in runs of at most three.
* ``llama`` (Gemma): SentencePiece BPE, best-scored pair first, byte fallback to ``<0xXX>``
  tokens, on dspark's own :mod:`dspark.llm.spm` (HF's BPE would need 514 k merges spelled out
  for Gemma, ~300 MB resident).

The control tokens (type 3, e.g. ``<|im_start|>``, ``<start_of_turn>``) and user-defined ones
(type 4) are special tokens, matched in the text as llama.cpp's ``tokenize(..., special=True)``
does. The result is saved as one ``tokenizer.json`` next to the model, so serving loads it
without the GGUF.

The chat template is the model's own Jinja program from ``tokenizer.chat_template``, rendered
by jinja2 in a sandbox as HF transformers does.
"""
from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Sequence

from dspark.errors import ConfigError, RequestError
from dspark.llm.spm import CONTROL, USER_DEFINED, SentencePieceBPE
from dspark.runtimes.protocol import Tokenizer

# A GGUF without tokenizer.chat_template (a base model, e.g. Gemma 3 270M) chats in a plain
# question/answer format, which base models continue sensibly, and stops where it would ask itself
# the next question.
PLAIN_CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
                       "{% elif m['role'] == 'user' %}Question: {{ m['content'] }}\n"
                       "{% else %}Answer: {{ m['content'] }}\n{% endif %}{% endfor %}"
                       "{% if add_generation_prompt %}Answer:{% endif %}")
PLAIN_CHAT_STOP = ("\nQuestion:",)
META_FILE = "tokenizer_meta.json"  # beside tokenizer.json: bos/eos ids, the kind, the chat format
# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp) by tokenizer.ggml.pre
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_REGEX = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX, "llama-v3": _LLAMA3_REGEX,
              "qwen2": _QWEN2_REGEX, "deepseek-r1-qwen": _QWEN2_REGEX}
_GPT2_PRE = ("default", "smollm", "gpt-2", "gpt2")


def _special_tokens(tokens: Sequence[str], token_types: Sequence[int]):
    from tokenizers import AddedToken

    return [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, token_types)
            if kind in (CONTROL, USER_DEFINED)]


def build_hf_tokenizer(tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[str],
                       pre: str = "default", path: Path | None = None):
    """An HF ``tokenizers.Tokenizer`` for a GGUF ``gpt2`` vocabulary (see module docstring);
    errors name ``path``, the GGUF file."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=False))
    except Exception as exc:  # tokenizers raises plain Exception for merges outside the vocabulary
        raise ConfigError("tokenizer.ggml.merges", f"not usable with tokenizer.ggml.tokens ({exc})", path) from None
    if pre in _PRE_REGEX:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_REGEX[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    elif pre in _GPT2_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    else:
        raise ConfigError("tokenizer.ggml.pre", f"pre-tokenizer '{pre}' is not implemented "
                          f"(known: {', '.join(sorted(set(_PRE_REGEX) | set(_GPT2_PRE)))})", path)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(_special_tokens(tokens, token_types))
    return tok


class LlamaTokenizer(Tokenizer):
    """encode / decode / chat template of one model. ``kind`` is the GGUF tokenizer model
    ("gpt2" byte-level BPE or "llama" SentencePiece), which says how token text maps to bytes;
    ``add_bos`` whether a prompt starts with BOS."""

    def __init__(self, tokenizer, bos_id: int, eos_id: int, chat_template: str | None,
                 kind: str = "gpt2", add_bos: bool = False, chat_stop: Sequence[str] = ()):
        self._tok = tokenizer  # HF tokenizers' Tokenizer (gpt2) or a SentencePieceBPE (llama)
        self.bos_id, self.eos_id = bos_id, eos_id
        self.chat_template = chat_template
        self.kind, self.add_bos = kind, add_bos
        self.chat_stop = tuple(chat_stop)  # stop strings every chat reply gets (the plain format's)

    @classmethod
    def from_gguf(cls, model) -> "LlamaTokenizer":
        """From a :class:`dspark.llm.gguf_model.GGUFModel`."""
        v, cfg = model.vocabulary, model.config
        if v["model"] == "gpt2":
            tok = build_hf_tokenizer(v["tokens"], v["types"], v["merges"], v["pre"], model.path)
        else:
            tok = SentencePieceBPE(v["tokens"], v["scores"], v["types"], v["add_space_prefix"])
        # SentencePiece models are trained with BOS first; byte-level BPE models here are not
        add_bos = cfg.add_bos if v["model"] == "llama" else False
        if cfg.chat_template:
            return cls(tok, cfg.bos_id, cfg.eos_id, cfg.chat_template, v["model"], add_bos)
        return cls(tok, cfg.bos_id, cfg.eos_id, PLAIN_CHAT_TEMPLATE, v["model"], add_bos, PLAIN_CHAT_STOP)

    def save(self, path: str | Path) -> None:
        """``path``: HF's tokenizer.json; beside it ``tokenizer_meta.json`` (ids, chat format)."""
        path = Path(path)
        self._tok.save(str(path))
        meta = {"bos_id": self.bos_id, "eos_id": self.eos_id, "chat_template": self.chat_template,
                "kind": self.kind, "add_bos": self.add_bos, "chat_stop": list(self.chat_stop)}
        path.with_name(META_FILE).write_text(json.dumps(meta, ensure_ascii=False))

    @classmethod
    def load(cls, path: str | Path) -> "LlamaTokenizer":
        from tokenizers import Tokenizer

        path = Path(path)
        try:
            # HF's own reader: parsing the file in Python first would leave ~300 MB of a large
            # vocabulary's merges (Gemma's 514 k) in the heap
            meta = json.loads(path.with_name(META_FILE).read_text(encoding="utf-8"))
            tok = SentencePieceBPE.load(path) if meta["kind"] == "llama" else Tokenizer.from_file(str(path))
            return cls(tok, meta["bos_id"], meta["eos_id"], meta["chat_template"], meta["kind"],
                       meta["add_bos"], meta["chat_stop"])
        except Exception as exc:  # tokenizers raises plain Exception
            raise ConfigError("tokenizer", f"cannot read a dspark tokenizer ({exc})", path) from None

    @property
    def vocab_size(self) -> int:
        if self.kind == "llama":
            return len(self._tok.tokens)
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (control tokens in it matched), BOS first when the model wants it
        and the text (a chat template's output, say) did not bring it."""
        ids = self._tok.encode(text) if self.kind == "llama" else self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        if self.kind == "llama":
            return self._tok.decode(list(ids))
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The exact bytes of ``ids``: a streamed token may end inside a UTF-8 character, which
        ``decode`` would replace; feed these to an incremental UTF-8 decoder instead."""
        table = self._token_bytes
        return b"".join(table[i] for i in ids)

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Control tokens (BOS, EOS, chat markers): never text a grammar can match."""
        if self.kind == "llama":
            return frozenset(self._tok.special.values())
        return frozenset(self._tok.get_added_tokens_decoder())

    @property
    def token_bytes(self) -> list[bytes]:
        """Every token's exact bytes, by id."""
        return self._token_bytes

    @cached_property
    def _token_bytes(self) -> list[bytes]:
        if self.kind == "llama":
            return self._tok.token_bytes
        special = set(self._tok.get_added_tokens_decoder())
        vocab = sorted(self._tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        return [text.encode() if i in special else bytes(_BYTE_DECODER[c] for c in text) for text, i in vocab]

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
