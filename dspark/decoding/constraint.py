"""Grammar-constrained decoding with llguidance: a request's ``guided`` spec (a JSON schema, any
JSON object, a regex, a choice of strings or a Lark grammar) becomes a ``Constraint`` that says,
for the next position, which tokens keep the text inside the grammar.

llguidance computes each mask lazily from the grammar's parser state and the tokenizer's token
trie, so there is no per-schema compile step over the vocabulary: a request's first mask costs
about as much as its later ones. The tokenizer side (``Grammars``) is built once per model from
the model's own token bytes (the caller, which knows the tokenizer, hands them over as a
``Vocabulary``); each request's ``Constraint`` is a matcher over it.

The engine applies ``Constraint.mask`` to every row the target scores before acceptance
(``dspark.decoding.rejection``), so a draft token the grammar forbids is rejected and the token
the target adds is drawn from the masked distribution: speculation stays lossless with respect
to constrained plain decoding.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from dspark.errors import RequestError

# compact JSON with json.dumps's separators: small models otherwise may pad with whitespace forever
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Vocabulary:
    """A model's tokens as llguidance needs them: each id's exact bytes, the end-of-sequence
    ids, the special (control) ids, and ``encode`` (text to ids, no BOS added)."""
    tokens: Sequence[bytes]
    eos_ids: Sequence[int]
    encode: Callable[[str], list[int]]
    special_ids: Sequence[int] = ()
    bos_id: Optional[int] = None


class _Wrapped:
    """The object llguidance's ``TokenizerWrapper`` reads."""

    def __init__(self, vocabulary: Vocabulary):
        self.eos_token_id = vocabulary.eos_ids[0]
        self.bos_token_id = vocabulary.bos_id
        self.tokens = list(vocabulary.tokens)
        self.special_token_ids = list(vocabulary.special_ids)
        self._encode = vocabulary.encode

    def __call__(self, text):
        return self._encode(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text)


def grammar_text(kind: str, value: Any) -> str:
    """llguidance's grammar for one ``guided`` entry (not yet checked)."""
    import llguidance

    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(value)
    raise ValueError(f"unknown guided kind {kind!r}")


def check_grammar(kind: str, value: Any) -> str:
    """The grammar of a ``guided`` entry, compiled once to check it; RequestError naming
    ``guided.<kind>`` when llguidance refuses it."""
    import llguidance

    try:
        grammar = grammar_text(kind, value)
    except (ValueError, TypeError) as error:
        raise RequestError(f"guided.{kind}", f"not usable: {error}") from None
    message = llguidance.LLMatcher.validate_grammar(grammar)
    if message:
        raise RequestError(f"guided.{kind}", f"invalid: {message}")
    return grammar


class Guided(BaseModel):
    """``sampling_parameters.guided``: exactly one of the kinds. Its grammar is compiled once
    when parsed (``compiled``), so a bad schema is refused before any model work."""
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    json_schema: Optional[dict[str, Any]] = None
    json_object: Optional[Literal[True]] = None
    regex: Optional[Annotated[str, Field(min_length=1)]] = None
    choice: Optional[Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]] = None
    grammar: Optional[Annotated[str, Field(min_length=1)]] = None
    _grammar: str = PrivateAttr("")

    @model_validator(mode="after")
    def _one_kind(self) -> "Guided":
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(KINDS)} (got {', '.join(given) or 'none'})")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def value(self) -> Any:
        return getattr(self, self.kind)

    def compiled(self) -> str:
        """The llguidance grammar, checked (RequestError naming ``guided.<kind>`` if invalid)."""
        if not self._grammar:
            self._grammar = check_grammar(self.kind, self.value)
        return self._grammar


class Grammars:
    """One model's llguidance tokenizer (built once, at load) and its request constraints."""

    def __init__(self, vocabulary: Vocabulary, n_vocab: Optional[int] = None):
        import llguidance

        self.vocab_size = len(vocabulary.tokens)
        self.eos_ids = frozenset(vocabulary.eos_ids)
        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped(vocabulary)),
                                                n_vocab=n_vocab, eos_token=list(vocabulary.eos_ids))

    def constraint(self, guided: Guided) -> "Constraint":
        """A fresh constraint for one request; RequestError naming ``guided.<kind>`` when the
        grammar does not compile against this model's tokens."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, guided.compiled(), log_level=0)
        if matcher.is_error():
            raise RequestError(f"guided.{guided.kind}", f"invalid: {matcher.get_error()}")
        return Constraint(matcher, self.tokenizer.vocab_size, self.eos_ids)


@dataclass
class Constraint:
    """One request's grammar state over the tokens committed so far. ``mask(width)`` is the
    allowed-token boolean array of the next position (``width``: the logits' length; ids past
    the tokenizer's are forbidden); ``consume`` commits a token; ``rollback`` undoes the last
    ``n``; ``fork`` copies the state (a tree branch). ``mask_s``: seconds spent computing masks."""
    matcher: Any
    vocab_size: int
    eos_ids: frozenset
    mask_s: float = 0.0
    masks: int = 0
    _words: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        self._words = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)

    def mask(self, width: Optional[int] = None) -> np.ndarray:
        start = time.perf_counter()
        words = self._words
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little").astype(bool)
        width = width or self.vocab_size
        if len(allowed) >= width:
            allowed = allowed[:width]
        else:
            allowed = np.concatenate([allowed, np.zeros(width - len(allowed), bool)])
        allowed[self.vocab_size:] = False
        if not allowed.any():  # an error state (the grammar cannot go on): only the end is left
            allowed[[i for i in self.eos_ids if i < width]] = True
        self.mask_s += time.perf_counter() - start
        self.masks += 1
        return allowed

    def consume(self, token: int) -> bool:
        """Commit ``token``; False when the grammar forbids it (the state is then an error)."""
        return bool(self.matcher.consume_token(int(token)))

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)

    def fork(self) -> "Constraint":
        return Constraint(self.matcher.deep_copy(), self.vocab_size, self.eos_ids)

    def is_accepting(self) -> bool:
        """The text so far is a complete sentence of the grammar."""
        return bool(self.matcher.is_accepting())

    def is_finished(self) -> bool:
        """Nothing but the end of the text may follow: the grammar is complete."""
        if self.matcher.is_stopped():
            return True
        if not self.matcher.is_accepting():
            return False
        others = self.mask()
        others[[i for i in self.eos_ids if i < len(others)]] = False
        return not others.any()

    @property
    def error(self) -> Optional[str]:
        return self.matcher.get_error() if self.matcher.is_error() else None


def apply_mask(row: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """``row``'s logits with the forbidden tokens at -inf."""
    return np.where(allowed, row, -np.inf)
