"""Hostile calls to every public entry point of dspark's compiled code: each raises a Python
exception naming the argument, instead of crashing or corrupting memory.

`make sanitize` runs this file, with the kernel unit tests, against an ASan + UBSan build of
cython_ext/, where an unchecked call would be reported even when it happens not to crash."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from dspark._ext import fused as ext_fused
from dspark.kernels.fused import FusedLNGeluMatMul, ln_gelu, sgemm
from dspark.kernels.pool import MemoryPool, PoolError

HUGE = 2**64 - 2**20  # wraps to 0 when rounded up to a block size
D, N = 16, 24


def f32(*shape):
    return np.ones(shape, np.float32)


# --- dspark._ext.fused -------------------------------------------------------------------------

LN_CALLS = {
    "gamma short": (lambda: ext_fused.ln_gelu(f32(2, D), f32(D - 1), f32(D), f32(2, D)), "gamma"),
    "beta long": (lambda: ext_fused.ln_gelu(f32(2, D), f32(D), f32(D + 1), f32(2, D)), "beta"),
    "out too small": (lambda: ext_fused.ln_gelu(f32(2, D), f32(D), f32(D), f32(1, D)), "out"),
    "d = 0": (lambda: ext_fused.ln_gelu(f32(2, 0), f32(0), f32(0), f32(2, 0)), "x columns"),
    "gelu_kind 7": (lambda: ext_fused.ln_gelu(f32(2, D), f32(D), f32(D), f32(2, D), 1e-5, 7), "gelu_kind"),
}
FUSED_CALLS = {
    "w rows != d": (lambda: ext_fused.fused_forward(f32(2, D), f32(D), f32(D), f32(D + 1, N), None, f32(2, N)), "w"),
    "bias short": (lambda: ext_fused.fused_forward(f32(2, D), f32(D), f32(D), f32(D, N), f32(N - 1), f32(2, N)),
                   "bias"),
    "out narrow": (lambda: ext_fused.fused_forward(f32(2, D), f32(D), f32(D), f32(D, N), None, f32(2, N - 1)), "out"),
    "block_rows 0": (lambda: ext_fused.fused_forward(f32(2, D), f32(D), f32(D), f32(D, N), None, f32(2, N),
                                                     block_rows=0), "block_rows"),
    "n = 0": (lambda: ext_fused.fused_forward(f32(2, D), f32(D), f32(D), f32(D, 0), None, f32(2, 0)), "w columns"),
}


def _packed(kc: int = 8) -> np.ndarray:
    packed = np.empty(ext_fused.packed_weights_size(D, N), np.float32)
    ext_fused.pack_weights(f32(D, N), packed, kc)
    return packed


PACKED_CALLS = {
    "pack kc = 0": (lambda: ext_fused.pack_weights(f32(D, N), np.empty(ext_fused.packed_weights_size(D, N),
                                                                       np.float32), 0), "kc"),
    "pack into a short buffer": (lambda: ext_fused.pack_weights(f32(D, N), f32(10), 8), "packed"),
    "size overflows": (lambda: ext_fused.packed_weights_size(2**40, 2**40), "d"),
    "n = 0": (lambda: ext_fused.fused_forward_packed(f32(2, D), f32(D), f32(D), _packed(), 0, None, f32(2, 0)), "n"),
    "n larger than packed": (lambda: ext_fused.fused_forward_packed(f32(2, D), f32(D), f32(D), _packed(), N + 16,
                                                                   None, f32(2, N + 16)), "w_packed"),
    "bias_padded short": (lambda: ext_fused.fused_forward_packed(f32(2, D), f32(D), f32(D), _packed(), N, f32(N),
                                                                f32(2, N)), "bias_padded"),
    "out short": (lambda: ext_fused.fused_forward_packed(f32(2, D), f32(D), f32(D), _packed(), N, None, f32(1, N)),
                  "out"),
    **{f"{name} near 2**64": (lambda name=name: ext_fused.fused_forward_packed(
        f32(2, D), f32(D), f32(D), _packed(), N, None, f32(2, N), **{name: HUGE}), name)
       for name in ("kc", "mc", "nc", "mb")},
    "mc = 0": (lambda: ext_fused.fused_forward_packed(f32(2, D), f32(D), f32(D), _packed(), N, None, f32(2, N),
                                                     mc=0), "mc"),
    "sgemm inner dimension": (lambda: ext_fused.sgemm(f32(3, 4), f32(5, 6), f32(3, 6)), "b: has 5 rows"),
    "sgemm c": (lambda: ext_fused.sgemm(f32(3, 4), f32(4, 6), f32(3, 5)), "c"),
    "sgemm empty": (lambda: ext_fused.sgemm(f32(0, 4), f32(4, 6), f32(0, 6)), "a rows"),
}


@pytest.mark.parametrize("call, argument", [*LN_CALLS.values(), *FUSED_CALLS.values(), *PACKED_CALLS.values()],
                         ids=[*LN_CALLS, *FUSED_CALLS, *PACKED_CALLS])
def test_ext_fused_entry_points_name_the_bad_argument(call, argument):
    with pytest.raises(ValueError, match=f"^{argument}"):
        call()


def test_ext_fused_takes_no_none_for_sgemm():
    with pytest.raises(TypeError):
        ext_fused.sgemm(None, f32(4, 6), f32(3, 6))


# --- dspark.kernels.fused -----------------------------------------------------------------------

@pytest.mark.parametrize("argument, value", [("kc", HUGE), ("mc", HUGE), ("mb", HUGE), ("nc", HUGE), ("kc", -5),
                                             ("block_rows", 2**40), ("threads", 10**6), ("threads", -1)])
def test_fused_layer_refuses_block_sizes_that_would_wrap_or_loop(argument, value):
    with pytest.raises(ValueError, match=f"^{argument}: must be between"):
        FusedLNGeluMatMul(f32(D), f32(D), f32(D, N), **{argument: value})


def test_fused_layer_refuses_a_float_block_size():
    with pytest.raises(TypeError, match="^kc: expected an integer"):
        FusedLNGeluMatMul(f32(D), f32(D), f32(D, N), kc=2.5)


def test_sgemm_checks_the_inner_dimension_and_ranks():
    with pytest.raises(ValueError, match=r"^b: has 5 rows, a has 4 columns"):
        sgemm(f32(3, 4), f32(5, 6))
    with pytest.raises(ValueError, match=r"^a: expected a 2-D array"):
        sgemm(f32(4), f32(4, 6))
    np.testing.assert_allclose(sgemm(f32(3, 4), f32(4, 6)), np.full((3, 6), 4.0))


def test_ln_gelu_names_an_unknown_gelu():
    with pytest.raises(ValueError, match="^gelu='relu'"):
        ln_gelu(f32(2, D), f32(D), f32(D), gelu="relu")


# --- dspark.kernels.pool ------------------------------------------------------------------------

@pytest.mark.parametrize("argument", ["initial_bytes", "arena_bytes", "max_bytes"])
def test_pool_refuses_sizes_past_any_address_space(argument):
    with pytest.raises(ValueError, match=f"^{argument}="):
        MemoryPool(**{argument: HUGE})


def test_pool_refuses_object_arrays_and_stays_usable():
    pool = MemoryPool(initial_bytes=1 << 20)
    for dtype in (object, np.dtype([("a", np.float32), ("b", object)])):
        with pytest.raises(TypeError, match="holds Python objects"):
            pool.empty((4,), dtype)
    with pytest.raises(ValueError, match="too large"):
        pool.empty((2**40, 2**40), np.float32)
    with pytest.raises(PoolError):
        pool.empty((2**62,), np.uint8)  # passes the size check, no address space has it
    a = pool.empty((8,), np.float32)
    a[:] = 1
    assert a.sum() == 8 and pool.stats().num_allocs == 1


def test_pool_has_no_raw_handle_api():
    """alloc_raw/free_raw took integers as block handles (double frees, garbage handles): removed."""
    assert not hasattr(MemoryPool, "alloc_raw") and not hasattr(MemoryPool, "free_raw")
    pool = MemoryPool(initial_bytes=1 << 20)
    blocks = [pool.empty((1000,), np.uint8) for _ in range(3)]
    del blocks
    gc.collect()
    assert pool.stats().bytes_in_use == 0


# --- dspark._ext.llama -----------------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(2**63, 32), (16, 2**63), (2**40, 2**40), (2**32, 32)])
def test_packed_matrix_refuses_sizes_whose_byte_count_would_wrap(n, k):
    from dspark._ext import llama as ext_llama
    from dspark.errors import ConfigError

    with pytest.raises(ConfigError, match="shape|data"):
        ext_llama.PackedMatrix(np.zeros(0, np.uint8), "Q8_0", n, k)


def test_llama_model_refuses_a_vocabulary_past_int32():
    from dspark._ext import llama as ext_llama
    from dspark.errors import ConfigError

    config = {"n_layer": 1, "hidden": 64, "ffn": 64, "n_head": 1, "n_kv": 1, "head_dim": 64,
              "vocab": 2**31, "rms_eps": 1e-5, "rope_base": 1e4}
    with pytest.raises(ConfigError, match="vocab"):
        ext_llama.LlamaModel(config, {}, 1)


LLAMA_CONFIG = {"n_layer": 1, "hidden": 64, "ffn": 64, "n_head": 1, "n_kv": 1, "head_dim": 64,
                "vocab": 100, "rms_eps": 1e-5, "rope_base": 1e4}


@pytest.mark.parametrize("change, threads, message", [
    ({}, 2**31, r"^threads: 2147483648: expected 1\.\.64"),  # was a bare OverflowError naming nothing
    ({}, 2.5, r"^threads: 2\.5: expected a whole number in 1\.\.64"),
    ({"n_layer": 2**64}, 1, r"^n_layer: 18446744073709551616: expected 1\.\.2147483647"),
    ({"hidden": -1}, 1, r"^hidden: -1: expected 1\.\.2147483647"),
    ({"rms_eps": float("nan")}, 1, r"^rms_eps: nan: expected a finite positive number"),  # was accepted
    ({"rms_eps": 0.0}, 1, r"^rms_eps: 0\.0: expected a finite positive number"),
    ({"rms_eps": 1e39}, 1, r"^rms_eps: 1e\+39: expected a finite positive number"),  # inf as a C float
    ({"rope_base": -1.0}, 1, r"^rope_base: -1\.0: expected a finite positive number"),  # was accepted
    ({"rope_base": float("inf")}, 1, r"^rope_base: inf: expected a finite positive number"),
    ({"rope_base": "10000"}, 1, r"^rope_base: '10000': expected a number"),
    ({"embed_scale": float("nan")}, 1, r"^embed_scale: nan: expected a finite number"),
    ({"windows": [2**70]}, 1, r"^windows: 1180591620717411303424: expected 0\.\.2147483647"),
])
def test_llama_model_names_a_bad_size_count_or_float_argument(change, threads, message):
    from dspark._ext import llama as ext_llama
    from dspark.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        ext_llama.LlamaModel({**LLAMA_CONFIG, **change}, {}, threads)


@pytest.mark.parametrize("n, k, message", [(-16, 32, r"^n: -16: expected 0\.\."), (16, 2**64, r"^k: 18446744073709551616"),
                                           (16.0, 32, r"^n: 16\.0: expected a whole number")])
def test_packed_matrix_names_a_size_that_is_no_size(n, k, message):
    from dspark._ext import llama as ext_llama
    from dspark.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        ext_llama.PackedMatrix(np.zeros(0, np.uint8), "Q8_0", n, k)
