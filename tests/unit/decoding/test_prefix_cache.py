"""The prefix cache's index with no model: blocks by hash chain, longest prefix, LRU within the
budget, eviction of leaves first, and concurrent use."""
from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from dspark.decoding.prefix_cache import PrefixCache, block_digests

BLOCK = 16


@dataclass
class Rows:
    """A block's stand-in: which rows it was read from, and a size."""
    start: int
    stop: int
    tokens: tuple
    nbytes: int = 100


def reader(tokens, log=None):
    def read(start, stop):
        if log is not None:
            log.append((start, stop))
        return Rows(start, stop, tuple(tokens[start:stop]))
    return read


def held(cache, tokens):
    return [(r.start, r.stop, r.tokens) for r in cache.lookup(tokens)]


def test_longest_whole_block_prefix_is_found_and_a_changed_block_misses():
    cache = PrefixCache(10_000, BLOCK)
    first = list(range(100, 150))  # 3 whole blocks and 2 tokens
    assert cache.insert(first, reader(first)) == 3
    same_start = first[:40] + [7] * 30  # shares 2 whole blocks and half of the third
    assert held(cache, same_start) == [(0, 16, tuple(first[:16])), (16, 32, tuple(first[16:32]))]
    assert held(cache, first[:15]) == []  # not one whole block
    assert held(cache, [1] + first[1:]) == []  # the first token differs: every block does
    stats = cache.stats
    assert (stats.hits, stats.misses, stats.rows_reused, stats.blocks, stats.bytes_held) == (1, 2, 32, 3, 300)


def test_a_block_is_named_by_its_whole_prefix():
    a, b = [1] * 16 + [2] * 16, [3] * 16 + [2] * 16  # same second block, different first
    assert block_digests(a, BLOCK)[1] != block_digests(b, BLOCK)[1]
    assert block_digests(a, BLOCK)[0] == block_digests(a[:20], BLOCK)[0]
    cache = PrefixCache(10_000, BLOCK)
    cache.insert(a, reader(a))
    assert held(cache, b) == []


def test_only_missing_blocks_are_read():
    cache = PrefixCache(10_000, BLOCK)
    tokens = list(range(64))
    cache.insert(tokens[:32], reader(tokens))
    log = []
    assert cache.insert(tokens, reader(tokens, log)) == 2
    assert log == [(32, 48), (48, 64)]


def test_least_recently_used_chains_are_evicted_within_the_budget():
    cache = PrefixCache(400, BLOCK)  # four blocks of 100 bytes
    a, b, c = ([k] * 32 for k in (1, 2, 3))
    cache.insert(a, reader(a))
    cache.insert(b, reader(b))
    assert len(cache.lookup(a)) == 2  # a is now the more recent
    cache.insert(c, reader(c))  # room for two: b goes
    assert len(cache.lookup(a)) == 2 and len(cache.lookup(c)) == 2 and cache.lookup(b) == []
    stats = cache.stats
    assert stats.evictions == 2 and stats.bytes_held == 400 and stats.blocks == 4


def test_eviction_takes_a_chains_leaf_before_its_prefix():
    cache = PrefixCache(300, BLOCK)
    long = list(range(48))
    cache.insert(long, reader(long))  # three blocks, the budget's all
    other = [9] * 16
    cache.insert(other, reader(other))  # one must go: the longest prefix's last block
    assert len(cache.lookup(long)) == 2 and len(cache.lookup(other)) == 1


def test_a_block_larger_than_the_budget_is_not_held():
    cache = PrefixCache(50, BLOCK)
    tokens = list(range(32))
    assert cache.insert(tokens, reader(tokens)) == 0
    assert cache.lookup(tokens) == [] and cache.stats.bytes_held == 0


def test_a_chain_longer_than_the_budget_keeps_its_start():
    cache = PrefixCache(200, BLOCK)
    tokens = list(range(64))
    cache.insert(tokens, reader(tokens))
    assert [r.start for r in cache.lookup(tokens)] == [0, 16]


def test_concurrent_inserts_and_lookups_keep_the_budget_and_the_counts():
    cache = PrefixCache(2_000, BLOCK)
    prompts = [[k] * 16 + list(range(k, k + 48)) for k in range(12)]
    errors = []

    def work(k):
        try:
            for _ in range(30):
                tokens = prompts[(k * 7) % len(prompts)]
                cache.insert(tokens, reader(tokens))
                found = cache.lookup(tokens)
                assert all(r.tokens == tuple(tokens[r.start:r.stop]) for r in found)
                k += 1
        except BaseException as error:  # noqa: BLE001 - reported by the test thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    stats = cache.stats
    assert stats.hits + stats.misses == 6 * 30
    assert stats.bytes_held == 100 * stats.blocks <= 2_000


def test_block_size_must_match_the_kernels_key_blocks():
    with pytest.raises(ValueError, match="multiple of 16"):
        PrefixCache(1000, 24)
