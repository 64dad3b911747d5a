"""The BFC pool: alignment, return on collection, best fit, coalescing, limits, threads, mlock."""
import gc
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

from dspark.kernels.pool import MemoryPool, PoolError

MiB = 1 << 20


def test_arrays_are_aligned_sized_and_disjoint():
    pool = MemoryPool(initial_bytes=4 * MiB)
    arrays = [pool.empty((n, 3), dtype) for n, dtype in [(1, np.float32), (7, np.float64), (100, np.int8),
                                                         (33, np.float32), (0, np.float32)]]
    for i, a in enumerate(arrays):
        assert a.ctypes.data % 64 == 0
        assert a.flags.c_contiguous and a.flags.writeable
        a.fill(i)
    for i, a in enumerate(arrays):
        assert (a == i).all()
    assert arrays[1].dtype == np.float64 and arrays[1].shape == (7, 3)
    assert pool.empty(5).shape == (5,)


def test_block_returns_when_the_last_view_is_collected():
    pool = MemoryPool(initial_bytes=4 * MiB)
    a = pool.empty((1000,), np.float32)
    view = a[10:20]
    del a
    gc.collect()
    assert pool.stats().bytes_in_use == 4032  # 4000 rounded up to 64 bytes, still held by the view
    del view
    gc.collect()
    stats = pool.stats()
    assert stats.bytes_in_use == 0 and stats.num_frees == 1 and stats.peak_bytes_in_use == 4032


def test_freed_neighbours_coalesce_into_one_block():
    pool = MemoryPool(initial_bytes=4 * MiB)
    blocks = [pool.empty(64 * 1024, np.uint8) for _ in range(5)]
    for i in (1, 3, 0, 4, 2):  # free out of order: both-sided merges happen
        blocks[i] = None
    stats = pool.stats()
    assert stats.num_free_chunks == 1
    assert stats.largest_free_block_bytes == stats.bytes_reserved == 4 * MiB
    assert stats.fragmentation == 0.0


def _holes(policy: str):
    """Arena with a 256 KiB hole followed by a 64 KiB hole, separated by live blocks."""
    pool = MemoryPool(policy=policy, initial_bytes=2 * MiB, max_bytes=2 * MiB)
    big, sep1, small, sep2 = (pool.empty(n, np.uint8) for n in (256 << 10, 4096, 64 << 10, 4096))
    big_addr, small_addr = big.ctypes.data, small.ctypes.data
    del big, small
    return pool, (sep1, sep2), big_addr, small_addr


def test_best_fit_takes_the_smallest_hole_and_first_fit_the_first():
    pool, keep, big_addr, small_addr = _holes("best_fit")
    assert pool.empty(60 << 10, np.uint8).ctypes.data == small_addr
    pool, keep, big_addr, small_addr = _holes("first_fit")
    assert pool.empty(60 << 10, np.uint8).ctypes.data == big_addr


def test_fragmentation_is_one_minus_largest_over_total_free():
    pool, keep, _, _ = _holes("best_fit")
    s = pool.stats()
    assert s.total_free_bytes == s.bytes_reserved - s.bytes_in_use
    assert s.fragmentation == pytest.approx(1 - s.largest_free_block_bytes / s.total_free_bytes)
    assert 0 < s.fragmentation < 1


def test_small_remainders_are_not_split_off():
    pool, keep, _, small_addr = _holes("best_fit")
    a = pool.empty((64 << 10) - 128, np.uint8)  # leaves 128 bytes: not worth a chunk
    assert a.ctypes.data == small_addr
    assert pool.stats().bytes_in_use == 2 * 4096 + (64 << 10)


def test_pool_grows_by_arenas_and_stops_at_max_bytes():
    pool = MemoryPool(arena_bytes=2 * MiB, max_bytes=4 * MiB)
    a = pool.empty(MiB, np.uint8)
    b = pool.empty(1536 << 10, np.uint8)
    assert pool.stats().num_arenas == 2 and pool.stats().bytes_reserved == 4 * MiB
    with pytest.raises(PoolError, match="do not fit under max_bytes=4194304"):
        pool.empty(3 * MiB, np.uint8)
    del a, b


def test_concurrent_alloc_and_free_leave_a_consistent_pool():
    pool = MemoryPool(arena_bytes=8 * MiB)
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        held = []
        try:
            for _ in range(1500):
                if held and rng.random() < 0.5:
                    a, value = held.pop(int(rng.integers(len(held))))
                    assert (a == value).all()
                else:
                    value = int(rng.integers(255))
                    a = pool.empty(int(rng.integers(1, 20000)), np.uint8)
                    a.fill(value)
                    held.append((a, value))
        except AssertionError as error:
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    s = pool.stats()
    assert not errors
    assert s.bytes_in_use == 0 and s.num_allocs == s.num_frees
    assert s.num_free_chunks == s.num_arenas  # everything merged back, one block per arena


def test_page_locked_and_huge_page_pool_works_when_allowed():
    pool = MemoryPool(initial_bytes=4 * MiB, lock_pages=True, huge_pages=True, prefault=True)
    a = pool.empty(MiB, np.uint8)
    a.fill(1)
    assert pool.lock_pages and a.sum() == MiB


@pytest.mark.skipif(not (shutil.which("prlimit") and shutil.which("setpriv")), reason="needs util-linux")
def test_refused_mlock_names_rlimit_memlock():
    code = ("from dspark.kernels.pool import MemoryPool, PoolError\n"
            "try:\n    MemoryPool(initial_bytes=4 << 20, lock_pages=True)\n"
            "except PoolError as e:\n    print(e)\n")
    # Without CAP_IPC_LOCK (root keeps it otherwise) and with a 64 KiB limit, mlock must fail.
    out = subprocess.run(["prlimit", "--memlock=65536:65536", "setpriv", "--bounding-set=-ipc_lock",
                          "--inh-caps=-ipc_lock", sys.executable, "-c", code],
                         capture_output=True, text=True, env=os.environ, timeout=60)
    assert "RLIMIT_MEMLOCK is 65536 bytes" in out.stdout, out.stdout + out.stderr
    assert "lock_pages=False" in out.stdout


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="policy='worst_fit'"):
        MemoryPool(policy="worst_fit")
    with pytest.raises(ValueError, match="negative dimension"):
        MemoryPool().empty((2, -1))
    with pytest.raises(ValueError, match="too large"):
        MemoryPool().empty((1 << 40, 1 << 40), np.float64)
