"""SentencePiece BPE tokenization as llama.cpp does it for a GGUF ``llama`` vocabulary (Gemma).

The algorithm: control and user-defined tokens are cut out of the text first; in each remaining
piece spaces become ``▁`` (with a leading ``▁`` when ``add_space_prefix``), the piece starts as
its characters, and the adjacent pair whose joined text is a token with the best score is merged
again and again (ties: the leftmost); a character that is no token becomes its UTF-8 bytes'
``<0xAB>`` tokens. Written here rather than run on HF ``tokenizers``: its BPE needs the merges
spelled out, 514 k for Gemma's vocabulary, which held ~300 MB resident per loaded model; this
keeps the vocabulary alone (~40 MB) and gives llama.cpp's tokens (tests compare them).
"""
from __future__ import annotations

import heapq
import json
import re
from functools import cached_property
from pathlib import Path
from typing import Sequence

SPACE = "\u2581"
UNKNOWN, CONTROL, USER_DEFINED, BYTE = 2, 3, 4, 6  # tokenizer.ggml.token_type values


class SentencePieceBPE:
    def __init__(self, tokens: Sequence[str], scores: Sequence[float], types: Sequence[int],
                 add_space_prefix: bool = False):
        self.tokens, self.scores, self.types = list(tokens), list(scores), list(types)
        self.add_space_prefix = add_space_prefix
        self.ids = {t: i for i, t in enumerate(self.tokens) if types[i] not in (CONTROL, BYTE)}
        self.byte_ids = {int(t[3:5], 16): i for i, t in enumerate(self.tokens)
                         if types[i] == BYTE and len(t) == 6 and t.startswith("<0x")}
        self.unk = next((i for i, kind in enumerate(self.types) if kind == UNKNOWN), 0)
        special = sorted({t for t, kind in zip(self.tokens, self.types) if kind in (CONTROL, USER_DEFINED) and t},
                         key=len, reverse=True)
        self.special = {t: i for i, t in enumerate(self.tokens) if self.types[i] in (CONTROL, USER_DEFINED)}
        self._split = re.compile("(" + "|".join(map(re.escape, special)) + ")") if special else None

    # -- files -------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"model": "sentencepiece-bpe", "tokens": self.tokens, "scores": self.scores,
                                          "types": self.types, "add_space_prefix": self.add_space_prefix},
                                         ensure_ascii=False))

    @classmethod
    def load(cls, path: str | Path) -> "SentencePieceBPE":
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if data.get("model") != "sentencepiece-bpe":
            raise ValueError("not a dspark SentencePiece vocabulary")
        return cls(data["tokens"], data["scores"], data["types"], data["add_space_prefix"])

    # -- encode / decode ---------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        parts = self._split.split(text) if self._split else [text]
        first = True
        for k, part in enumerate(parts):
            if k % 2:  # a special token
                out.append(self.special[part])
            elif part:
                if first and self.add_space_prefix:
                    part = " " + part
                self._merge(part.replace(" ", SPACE), out)
            first = False
        return out

    def _merge(self, text: str, out: list[int]) -> None:
        symbols = list(text)
        n = len(symbols)
        prev, nxt = list(range(-1, n - 1)), list(range(1, n + 1))
        heap: list[tuple[float, int, str, str]] = []

        def push(left: int) -> None:
            right = nxt[left]
            if left < 0 or right >= n:
                return
            joined = symbols[left] + symbols[right]
            token = self.ids.get(joined)
            if token is not None:
                heapq.heappush(heap, (-self.scores[token], left, symbols[left], symbols[right]))

        for i in range(n - 1):
            push(i)
        while heap:
            _, left, a, b = heapq.heappop(heap)
            right = nxt[left]
            if right >= n or symbols[left] != a or symbols[right] != b:
                continue  # a stale pair: one side was merged since
            symbols[left], symbols[right] = a + b, ""
            nxt[left] = nxt[right]
            if nxt[left] < n:
                prev[nxt[left]] = left
            if prev[left] >= 0:
                push(prev[left])
            push(left)
        i = 0
        while i < n:
            piece = symbols[i]
            token = self.ids.get(piece)
            if token is not None:
                out.append(token)
            else:
                out.extend(self.byte_ids.get(b, self.unk) for b in piece.encode("utf-8"))
            i = nxt[i]

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """Each token's bytes: ``<0xAB>`` the byte, ``▁`` a space, control tokens their text."""
        out = []
        for text, kind in zip(self.tokens, self.types):
            if kind == BYTE and len(text) == 6 and text.startswith("<0x"):
                out.append(bytes([int(text[3:5], 16)]))
            elif kind == CONTROL:
                out.append(text.encode())
            else:
                out.append(text.replace(SPACE, " ").encode())
        return out

    def decode(self, ids: Sequence[int]) -> str:
        table = self.token_bytes
        return b"".join(table[i] for i in ids).decode("utf-8", errors="replace")
