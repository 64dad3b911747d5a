"""Best-fit-with-coalescing memory pool (BFC) handing out numpy arrays.

``MemoryPool.empty(shape, dtype)`` returns a C-contiguous, 64-byte aligned array whose
block goes back to the pool when the array (and every view of it) is collected.
Arenas are mmap'ed up front (``initial_bytes``) and grown in ``arena_bytes`` steps up to
``max_bytes``; ``lock_pages`` mlocks them (page-locked), ``huge_pages`` asks for
transparent huge pages, ``prefault`` touches every page from the creating thread so a
pinned thread's first touch places them on its NUMA node. ``policy="first_fit"`` is the
baseline the benchmark compares against. Thread-safe (one mutex in the C pool).
"""
from __future__ import annotations

from dataclasses import dataclass

from dspark._ext.pool import PoolError, RawPool

__all__ = ["MemoryPool", "PoolError", "PoolStats"]


@dataclass(frozen=True)
class PoolStats:
    bytes_in_use: int
    peak_bytes_in_use: int
    bytes_reserved: int
    num_allocs: int
    num_frees: int
    num_arenas: int
    num_free_chunks: int
    largest_free_block_bytes: int
    total_free_bytes: int
    fragmentation: float  # external: 1 - largest_free_block / total_free


class MemoryPool(RawPool):
    """See the module docstring; ``stats()`` returns :class:`PoolStats`."""

    def stats(self) -> PoolStats:  # type: ignore[override]
        return PoolStats(**super().stats())
