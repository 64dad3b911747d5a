"""Hostile calls to every public entry point of dspark's compiled code: each raises a Python
exception naming the argument, instead of crashing or corrupting memory.

`make sanitize` runs this file, with the kernel unit tests, against an ASan + UBSan build of
cython_ext/, where an unchecked call would be reported even when it happens not to crash."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from dspark._ext import fused as ext_fused
from dspark._ext.lm_step import LMStep
from dspark.runtimes.toy_lm.runtime import KVCache, KernelLM
from dspark.runtimes.toy_lm.graph import LMConfig, build_lm_onnx, random_weights
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


# --- dspark._ext.lm_step and KernelLM -----------------------------------------------------------

CFG = LMConfig(n_layer=2, d_model=16, n_head=2, vocab=12, ctx=32)
OTHER = LMConfig(n_layer=2, d_model=16, n_head=4, vocab=12, ctx=32)


@pytest.fixture(scope="module")
def kernel_lm():
    return KernelLM(build_lm_onnx(random_weights(CFG), CFG))


@pytest.fixture(scope="module")
def step_weights():
    from onnx import numpy_helper

    model = build_lm_onnx(random_weights(CFG), CFG)
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.parametrize("change, argument", [
    (dict(n_head=0), "n_head"), (dict(n_head=3), "n_head"), (dict(n_layer=0), "n_layer"),
    (dict(n_layer=3), "weights: missing 'h2."), (dict(vocab=13), "weights\\['tok_emb'\\]"),
])
def test_lm_step_checks_its_config_against_the_weights(step_weights, change, argument):
    args = dict(n_layer=CFG.n_layer, n_head=CFG.n_head, vocab=CFG.vocab) | change
    with pytest.raises(ValueError, match=f"^{argument}"):
        LMStep(step_weights, args["n_layer"], args["n_head"], args["vocab"])


def test_lm_step_names_a_wrong_weight_shape(step_weights):
    weights = dict(step_weights) | {"h1.fc.b": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match=r"^weights\['h1.fc.b'\]: expected shape \(64,\)"):
        LMStep(weights, CFG.n_layer, CFG.n_head, CFG.vocab)


def _step_call(lm: KernelLM, cache: KVCache, **change):
    t, length = 2, cache.length
    args = dict(keys=cache.keys, values=cache.values, tokens=np.array([1, 2], np.int64),
                positions=np.array([length, length + 1], np.int64), mask=np.ones((t, length + t), np.uint8),
                length=length, key_positions=np.arange(length + t, dtype=np.int64),
                logits=np.empty((t, CFG.vocab), np.float32)) | change
    lm._step.forward(*args.values())


@pytest.mark.parametrize("change, argument", [
    (dict(tokens=np.array([1, 12], np.int64)), "tokens: id 12"),
    (dict(tokens=np.array([-1, 2], np.int64)), "tokens: id -1"),
    (dict(tokens=np.array([], np.int64)), "tokens"),
    (dict(positions=np.array([0], np.int64)), "positions"),
    (dict(key_positions=np.arange(1, dtype=np.int64)), "key_positions"),
    (dict(mask=np.ones((2, 1), np.uint8)), "mask"),
    (dict(logits=np.empty((2, 5), np.float32)), "logits"),
    (dict(length=40, key_positions=np.arange(42, dtype=np.int64), mask=np.ones((2, 42), np.uint8)), "length"),
    (dict(length=HUGE), "length"),
    (dict(keys=[]), "keys"),
])
def test_lm_step_forward_names_the_bad_argument(kernel_lm, change, argument):
    cache = kernel_lm.new_cache(8)  # 8 + 32 padding slots
    with pytest.raises(ValueError, match=f"^{argument}"):
        _step_call(kernel_lm, cache, **change)


@pytest.mark.parametrize("tokens, positions, argument", [
    ([3, 12], [0, 1], "tokens: id 12 at 1 is outside 0..11"),
    ([3, -1], [0, 1], "tokens: id -1 at 1"),
    ([3, 4, 5], [0, 1], "positions"),
    ([3, 4, 5], [0], "positions"),
])
def test_kernel_lm_forward_refuses_bad_tokens_and_positions_and_keeps_the_cache(kernel_lm, tokens, positions, argument):
    cache = kernel_lm.new_cache()
    kernel_lm.forward(cache, [1, 2], [0, 1])
    with pytest.raises(ValueError, match=f"^{argument}"):
        kernel_lm.forward(cache, tokens, positions)
    assert cache.length == 2
    assert kernel_lm.forward(cache, [3], [2]).shape == (1, CFG.vocab)


def test_kernel_lm_refuses_a_cache_built_for_another_model(kernel_lm):
    foreign = KVCache.allocate(OTHER, 16)
    with pytest.raises(ValueError, match=r"^keys\[0\]: expected .*\(1, slots, 2, 8\), got float32 \(1, 48, 4, 4\) \(a cache made for"):
        kernel_lm.forward(foreign, [1, 2], [0, 1])
    strided = kernel_lm.new_cache(16)
    strided.keys[0] = strided.keys[0][:, ::2]
    with pytest.raises(ValueError, match=r"^keys\[0\]: expected a writeable C-order float32"):
        kernel_lm.forward(strided, [1], [0])


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
