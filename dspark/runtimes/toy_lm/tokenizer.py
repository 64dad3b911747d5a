"""Byte-level BPE tokenizer of the speculative LM pair (pure Python; trained by
``tests/fixtures/toy_lm/train_tokenizer.py``).

Every byte is a token, so any text encodes; merges never cross a newline, so a line is
encoded on its own and encoding cost stays linear in the number of lines.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from dspark.runtimes.protocol import Tokenizer


class BPETokenizer(Tokenizer):
    """``encode(str) -> list[int]`` and ``decode(list[int]) -> bytes`` over a merge table."""

    def __init__(self, tokens: list[bytes], merges: list[tuple[int, int]]):
        self.tokens = tokens
        self._id_of = {tok: i for i, tok in enumerate(tokens)}
        self._byte_ids = [self._id_of[bytes([b])] for b in range(256)]
        self._rank = {pair: r for r, pair in enumerate(merges)}
        self._merged = {pair: self._id_of[tokens[pair[0]] + tokens[pair[1]]] for pair in merges}
        self._encode_piece = lru_cache(maxsize=65536)(self._encode_piece_uncached)

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @classmethod
    def load(cls, path: Path | str) -> "BPETokenizer":
        data = json.loads(Path(path).read_text())
        return cls([bytes.fromhex(t) for t in data["tokens"]],
                   [tuple(pair) for pair in data["merges"]])

    def to_json(self) -> str:
        merges = sorted(self._rank, key=self._rank.get)
        return json.dumps({"tokens": [t.hex() for t in self.tokens],
                           "merges": [list(m) for m in merges]})

    def _encode_piece_uncached(self, piece: bytes) -> tuple[int, ...]:
        ids = [self._byte_ids[b] for b in piece]
        rank = self._rank
        while len(ids) > 1:
            best, best_rank = -1, len(rank)
            for i in range(len(ids) - 1):
                r = rank.get((ids[i], ids[i + 1]), best_rank)
                if r < best_rank:
                    best, best_rank = i, r
            if best < 0:
                break
            pair = (ids[best], ids[best + 1])
            new_id = self._merged[pair]
            out, i = [], 0
            while i < len(ids):
                if i < len(ids) - 1 and (ids[i], ids[i + 1]) == pair:
                    out.append(new_id)
                    i += 2
                else:
                    out.append(ids[i])
                    i += 1
            ids = out
        return tuple(ids)

    def encode(self, text: str | bytes) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else text
        out: list[int] = []
        for line in data.splitlines(keepends=True):
            out.extend(self._encode_piece(line))
        return out

    def decode(self, ids) -> bytes:
        return b"".join(self.tokens[i] for i in ids)

    decode_bytes = decode  # its decode is already the exact bytes
