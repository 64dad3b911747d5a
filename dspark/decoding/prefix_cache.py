"""Prefix caching: the target's KV rows of earlier requests, kept by the tokens they encode, so a
new request that starts with the same tokens copies those rows instead of computing them again.

Rows are kept in blocks of ``block_tokens`` tokens (64). A block is named by a hash chain: the
digest of its parent block's digest and its own tokens, so one name stands for the whole prefix
up to the block's end (rows of a block depend on every token before it). A lookup walks the
chain from the first block and stops at the first block not held: the longest cached prefix of
whole blocks. A prompt that shares only part of a block gets the blocks before it; a changed
tail just misses.

What a block holds is the runtime's business (``CacheRows.read_rows`` makes it, ``write_rows``
puts it back); this module only needs its ``nbytes``. The blocks held stay within
``budget_bytes``; when a new block does not fit, the least recently used go first. A lookup
touches a chain's blocks from its end to its start, so a parent is always more recent than its
children and eviction takes leaves before the prefixes they extend. All methods are thread-safe
(one lock; a block's rows are copied under it).
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

BLOCK_TOKENS = 64  # a multiple of the kernels' 16-slot key blocks


@dataclass
class PrefixCacheStats:
    """Counts since the cache was made: lookups that reused rows (``hits``) or none
    (``misses``), rows reused, blocks evicted; ``bytes_held``: what the blocks hold now."""
    hits: int = 0
    misses: int = 0
    rows_reused: int = 0
    evictions: int = 0
    bytes_held: int = 0
    blocks: int = 0


def block_digests(tokens: Sequence[int], block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    """The chain of digests of ``tokens``' whole blocks: entry i names tokens[: (i + 1) * block]."""
    ids = np.asarray(tokens, dtype="<i8")
    parent, out = b"", []
    for end in range(block_tokens, len(ids) + 1, block_tokens):
        parent = hashlib.blake2b(parent + ids[end - block_tokens:end].tobytes(), digest_size=16).digest()
        out.append(parent)
    return out


class PrefixCache:
    """Blocks of KV rows by the token prefix they encode, LRU within ``budget_bytes``."""

    def __init__(self, budget_bytes: int, block_tokens: int = BLOCK_TOKENS):
        if block_tokens <= 0 or block_tokens % 16:
            raise ValueError(f"block_tokens must be a positive multiple of 16, got {block_tokens}")
        self.budget_bytes = int(budget_bytes)
        self.block_tokens = block_tokens
        self._blocks: "OrderedDict[bytes, Any]" = OrderedDict()  # digest -> rows, oldest first
        self._lock = threading.Lock()
        self._stats = PrefixCacheStats()

    @property
    def stats(self) -> PrefixCacheStats:
        with self._lock:
            return PrefixCacheStats(**vars(self._stats))

    def _touch(self, chain: Sequence[bytes]) -> None:
        for digest in reversed(chain):  # parents end up more recent than their children
            self._blocks.move_to_end(digest)

    def lookup(self, tokens: Sequence[int]) -> list[Any]:
        """The held blocks of ``tokens``' longest cached prefix, in order (block i: rows
        i * block_tokens ...). Only whole blocks of ``tokens`` count: pass the rows wanted."""
        digests = block_digests(tokens, self.block_tokens)
        with self._lock:
            found = []
            for digest in digests:
                rows = self._blocks.get(digest)
                if rows is None:
                    break
                found.append(rows)
            self._touch(digests[:len(found)])
            if found:
                self._stats.hits += 1
                self._stats.rows_reused += len(found) * self.block_tokens
            else:
                self._stats.misses += 1
            return found

    def insert(self, tokens: Sequence[int], read_rows: Callable[[int, int], Any]) -> int:
        """Hold ``tokens``' whole blocks not held yet; ``read_rows(start, stop)`` copies the rows of
        one (its result has ``nbytes``). Returns the blocks added. A block that cannot fit the
        budget, and every block after it, is not held."""
        digests = block_digests(tokens, self.block_tokens)
        added = 0
        with self._lock:
            for i, digest in enumerate(digests):
                if digest in self._blocks:
                    continue
                start = i * self.block_tokens
                rows = read_rows(start, start + self.block_tokens)
                if rows.nbytes > self.budget_bytes:
                    break
                if not self._make_room(rows.nbytes, digests[:i]):
                    break  # only this chain's own blocks are left to drop: keep its start
                self._blocks[digest] = rows
                self._stats.bytes_held += rows.nbytes
                self._stats.blocks += 1
                added += 1
            self._touch([d for d in digests if d in self._blocks])
        return added

    def _make_room(self, nbytes: int, chain: Sequence[bytes]) -> bool:
        """Evict least recently used blocks until ``nbytes`` more fit, never one of ``chain``
        (the blocks before the one being inserted); False when only those are left."""
        self._touch(chain)  # the most recent now: the oldest block is another chain's while any is
        keep = set(chain)
        while self._stats.bytes_held + nbytes > self.budget_bytes:
            oldest = next(iter(self._blocks), None)
            if oldest is None or oldest in keep:
                return False
            rows = self._blocks.pop(oldest)
            self._stats.bytes_held -= rows.nbytes
            self._stats.blocks -= 1
            self._stats.evictions += 1
        return True

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._stats.bytes_held = self._stats.blocks = 0
