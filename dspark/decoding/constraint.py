"""Grammar-constrained decoding: a request's ``guided`` spec (a JSON schema, any JSON object, a
regex, a choice of strings or a Lark grammar) compiled by llguidance into a matcher that gives
the tokens allowed at the next position.

Speculation stays lossless under a constraint because the mask is applied where tokens are
chosen, not where they are proposed: ``dspark.decoding.rejection.verify`` masks each row the
target scored along the path it walks, so a draft token the grammar forbids has probability 0
and is rejected, and the bonus token comes from the masked distribution. The output is
therefore the output of plain constrained decoding, whatever the method.

llguidance computes each mask lazily from the grammar's lexer state over a token trie (no
per-schema compilation of the whole vocabulary), which is what makes a fresh schema per request
cheap; see the README for why it was picked.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from dspark.errors import RequestError

MAX_CHOICES = 256
# JSON as OpenAI's API writes it: one space after ':' and ',', no other whitespace (a flexible
# whitespace rule lets a small model pad forever); a schema's own "x-guidance" overrides it
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_VALUES = ("const", "enum", "default", "examples", "required")


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists its
    ``properties`` and says nothing of others (as xgrammar's strict mode in vLLM): output that
    follows the result follows ``schema`` too, without the extra keys a small model invents."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        elif key in _VALUES:
            out[key] = value
        else:
            out[key] = closed_objects(value)
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


class Guided(BaseModel):
    """``sampling_parameters.guided``: exactly one kind of constraint."""
    model_config = ConfigDict(extra="forbid", strict=True)

    json_schema: Optional[dict[str, Any]] = None
    json_object: Optional[StrictBool] = None
    regex: Optional[str] = Field(None, min_length=1, max_length=16_384)
    choice: Optional[list[str]] = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: Optional[str] = Field(None, min_length=1, max_length=262_144)

    @model_validator(mode="after")
    def _exactly_one(self) -> "Guided":
        given = [k for k, v in self if v is not None and v is not False]
        if len(given) != 1:
            raise ValueError("give exactly one of json_schema, json_object (true), regex, choice, "
                             f"grammar (got {', '.join(given) or 'none'})")
        return self

    @property
    def kind(self) -> str:
        return next(k for k, v in self if v is not None and v is not False)

    def lark(self) -> str:
        """The constraint as llguidance grammar text."""
        from llguidance import LLMatcher

        kind = self.kind
        if kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(json.dumps(closed_objects(self.json_schema)),
                                                      defaults=JSON_STYLE)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_STYLE)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar)


class Grammars:
    """Compiles ``Guided`` specs for one model's vocabulary. The llguidance tokenizer (a trie of
    every token's bytes) is built on the first constrained request and kept."""

    def __init__(self, token_bytes: Callable[[], Sequence[bytes]], encode: Callable[[str], list[int]],
                 eos_ids: Iterable[int], special_ids: Iterable[int] = ()):
        self._token_bytes, self._encode = token_bytes, encode
        self.eos_ids = sorted(eos_ids)
        self.special_ids = sorted(special_ids)
        self._tokenizer = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                tokens = list(self._token_bytes())
                self._tokenizer = llguidance.LLTokenizer(
                    _Vocabulary(tokens, self._encode, self.eos_ids[0], self.special_ids), n_vocab=len(tokens),
                    eos_token=self.eos_ids)
            return self._tokenizer

    def compile(self, guided: Guided) -> "Constraint":
        """A fresh matcher; an invalid schema, regex or grammar is a RequestError naming
        ``guided.<kind>``."""
        from llguidance import LLMatcher

        field = f"guided.{guided.kind}"
        try:
            grammar = guided.lark()
        except (ValueError, TypeError) as error:
            raise RequestError(field, f"cannot be compiled ({_one_line(str(error))})") from None
        tokenizer = self.tokenizer
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise RequestError(field, f"cannot be compiled ({_one_line(messages[0])})")
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(field, f"cannot be compiled ({_one_line(matcher.get_error())})")
        return Constraint(matcher, tokenizer.vocab_size)


def _one_line(message: str) -> str:
    """llguidance's error without its drawing of the grammar: the first line and the "error:"
    lines of a regex parser's report."""
    lines = [line.strip() for line in message.splitlines()]
    return "; ".join([lines[0], *(line for line in lines[1:] if line.startswith("error:"))])


class Constraint:
    """One request's grammar state: ``mask`` the next position's logits, ``advance`` by the
    token chosen there."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self._vocab = vocab_size

    def allowed(self) -> np.ndarray:
        """A boolean per token: may it come next?"""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[:self._vocab].view(bool)  # 0/1 bytes: no copy

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` with every token the grammar forbids next at -inf (a copy). Logit rows
        wider than the grammar's vocabulary (padding) are forbidden past it."""
        allowed = self.allowed()
        n = min(len(allowed), len(logits))
        out = logits.copy()
        np.copyto(out[:n], logits.dtype.type(-np.inf), where=~allowed[:n])
        out[n:] = -np.inf
        return out

    def allows(self, token: int) -> bool:
        """May ``token`` come next? One token's check: cheaper than the whole mask."""
        return self._matcher.validate_tokens([int(token)]) == 1

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(int(token)):
            raise RuntimeError(f"the grammar refused token {token} it allowed: {self._matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar allows nothing more (only the end of the sequence)."""
        return self._matcher.is_stopped()

    def steer(self, guesses: list[int], limit: int) -> list[int]:
        """A lookup's chain of guesses fitted to the grammar, at most ``limit`` long: cut before
        the first guess the grammar forbids (its row would be verified for nothing); when none
        is, followed by the tokens the grammar forces next (a JSON schema's keys and
        punctuation: llguidance's tokenization of the forced bytes, guesses the target takes
        unless it splits those bytes otherwise). The state is left as it was."""
        matcher = self._matcher
        guesses = list(guesses[:limit])
        valid = matcher.validate_tokens(guesses)
        if valid < len(guesses) or valid == limit:
            return guesses[:valid]
        if not matcher.consume_tokens(guesses):
            raise RuntimeError(f"the grammar refused tokens it validated: {matcher.get_error()}")
        forced = [] if matcher.is_stopped() else matcher.compute_ff_tokens()
        matcher.rollback(len(guesses))
        return guesses + forced[:limit - len(guesses)]


class _Vocabulary:
    """What ``llguidance.LLTokenizer`` reads of a tokenizer: each token's bytes, the special
    tokens (never matched as text) and the model's encoder (for a grammar's literals)."""

    def __init__(self, tokens: list[bytes], encode: Callable[[str], list[int]], eos_id: int,
                 special_ids: Sequence[int]):
        self.tokens, self._encode = tokens, encode
        self.eos_token_id = eos_id
        self.bos_token_id = None
        self.special_token_ids = list(special_ids)
        self.is_tokenizer_wrapper = True

    def __call__(self, text: "str | bytes") -> list[int]:
        return self._encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)
