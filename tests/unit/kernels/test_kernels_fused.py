"""The fused LayerNorm+GELU+MatMul layer against float64, on every SIMD path."""
import threading
import time

import numpy as np
import pytest

from dspark.kernels.dispatch import SIMD_ENV, available_isas
from dspark.kernels.fused import FusedLNGeluMatMul, fused_ln_gelu_matmul, reference_fused


def _layer(d: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    gamma = (1 + 0.2 * rng.standard_normal(d)).astype(np.float32)
    beta = (0.2 * rng.standard_normal(d)).astype(np.float32)
    w = (rng.standard_normal((d, n)) / np.sqrt(d)).astype(np.float32)
    b = (0.1 * rng.standard_normal(n)).astype(np.float32)
    return gamma, beta, w, b


def _rel_err(y, ref):
    return np.abs(y - ref).max() / np.abs(ref).max()


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("gemm", ["packed", "openblas"])
@pytest.mark.parametrize("rows,d,n,block_rows", [(1, 64, 96, None), (17, 100, 33, 8), (300, 256, 512, 64)])
@pytest.mark.parametrize("gelu", ["erf", "tanh"])
def test_matches_float64_on_each_path(monkeypatch, isa, gemm, rows, d, n, block_rows, gelu):
    monkeypatch.setenv(SIMD_ENV, isa)
    gamma, beta, w, b = _layer(d, n)
    x = (2 * np.random.default_rng(1).standard_normal((rows, d)) + 1).astype(np.float32)
    layer = FusedLNGeluMatMul(gamma, beta, w, b, gelu=gelu, block_rows=block_rows, gemm=gemm)
    assert layer.simd_path == isa
    assert _rel_err(layer(x), reference_fused(x, gamma, beta, w, b, gelu=gelu)) < 1e-5


# Odd tails of every loop of the packed GEMM: rows not a multiple of the micro-tile (4/6/14
# rows), n not a multiple of the 16-wide panel (and n < 16), d not a multiple of kc (and
# d < 8, below one vector), one row (the four-panel path), and block sizes small enough that
# every level of the loop nest runs several times with a short last block.
TAIL_SHAPES = [(1, 7, 1), (1, 33, 200), (2, 5, 17), (3, 129, 64), (5, 64, 15), (7, 385, 47),
               (13, 31, 130), (29, 100, 81)]


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("rows,d,n", TAIL_SHAPES)
@pytest.mark.parametrize("blocks", [{}, {"kc": 24, "mc": 12, "nc": 32, "mb": 24}])
def test_packed_gemm_tails_match_float64(monkeypatch, isa, rows, d, n, blocks):
    monkeypatch.setenv(SIMD_ENV, isa)
    gamma, beta, w, b = _layer(d, n, seed=rows + d + n)
    x = (2 * np.random.default_rng(rows).standard_normal((rows, d)) + 1).astype(np.float32)
    layer = FusedLNGeluMatMul(gamma, beta, w, b, gemm="packed", **blocks)
    assert _rel_err(layer(x), reference_fused(x, gamma, beta, w, b)) < 1e-5
    # Without a bias the first K block writes the tile instead of adding to it.
    nobias = FusedLNGeluMatMul(gamma, beta, w, None, gemm="packed", **blocks)
    assert _rel_err(nobias(x), reference_fused(x, gamma, beta, w)) < 1e-5


def test_packed_and_openblas_paths_agree_on_a_layer_sized_shape():
    gamma, beta, w, b = _layer(768, 3072)
    x = np.random.default_rng(5).standard_normal((40, 768)).astype(np.float32)
    packed = FusedLNGeluMatMul(gamma, beta, w, b, gemm="packed")(x)
    openblas = FusedLNGeluMatMul(gamma, beta, w, b, gemm="openblas")(x)
    assert _rel_err(packed, openblas) < 1e-5


def test_packed_layer_keeps_only_the_packed_weights():
    gamma, beta, w, b = _layer(64, 40)
    layer = FusedLNGeluMatMul(gamma, beta, w, b)
    w[:] = 0  # the layer owns its packed copy; the caller's array may change afterwards
    assert layer.gemm == "packed" and not hasattr(layer, "weight")
    assert layer.weight_packed.size == 64 * 48 and layer.weight_packed.ctypes.data % 64 == 0
    assert np.abs(layer(np.ones((2, 64), np.float32) * np.arange(64, dtype=np.float32))).max() > 0


def test_batched_input_keeps_leading_dims_and_bias_is_optional():
    gamma, beta, w, _ = _layer(32, 48)
    x = np.random.default_rng(2).standard_normal((3, 5, 32)).astype(np.float32)
    y = fused_ln_gelu_matmul(x, gamma, beta, w)
    assert y.shape == (3, 5, 48)
    assert _rel_err(y, reference_fused(x, gamma, beta, w)) < 1e-5


@pytest.mark.parametrize("gemm", ["packed", "openblas"])
def test_thread_count_does_not_change_the_result(gemm):
    gamma, beta, w, b = _layer(128, 250)  # 16 panels, the last one short
    x = np.random.default_rng(3).standard_normal((64, 128)).astype(np.float32)
    one = FusedLNGeluMatMul(gamma, beta, w, b, threads=1, gemm=gemm)(x)
    for threads in (2, 3, 40):  # 40 > panels: capped at one panel per thread
        many = FusedLNGeluMatMul(gamma, beta, w, b, threads=threads, gemm=gemm)(x)
        np.testing.assert_allclose(one, many, rtol=1e-5, atol=1e-6)


def test_out_buffer_is_filled_in_place():
    gamma, beta, w, b = _layer(16, 24)
    x = np.ones((4, 16), np.float32) * np.arange(16, dtype=np.float32)
    out = np.full((4, 24), np.nan, np.float32)
    assert FusedLNGeluMatMul(gamma, beta, w, b)(x, out=out) is out
    assert np.isfinite(out).all()


def test_gil_is_released_during_the_call():
    """This thread keeps ticking while another runs the layer: with the GIL held no tick could
    fall inside a call (a GIL-holding sorted() in its place gets 0). Counting ticks inside
    the calls, not their rate, holds on a loaded machine."""
    gamma, beta, w, b = _layer(512, 2048)
    x = np.random.default_rng(4).standard_normal((256, 512)).astype(np.float32)
    layer = FusedLNGeluMatMul(gamma, beta, w, b)
    calls = []

    def run():
        for _ in range(5):
            start = time.perf_counter()
            layer(x)
            calls.append((start, time.perf_counter()))

    worker = threading.Thread(target=run)
    ticks = []
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
        time.sleep(0.001)
    worker.join()
    # the middle 80 % of each call: a thread switch at a call's first or last bytecode is not "inside"
    middles = [(start + 0.1 * (end - start), end - 0.1 * (end - start)) for start, end in calls]
    inside = sum(any(low < tick < high for low, high in middles) for tick in ticks)
    assert inside >= 5, f"{inside} of {len(ticks)} ticks fell inside the 5 calls"


@pytest.mark.parametrize("bad,error,match", [
    (np.ones((2, 16), np.float64), TypeError, "x: expected float32, got float64"),
    (np.ones((2, 15), np.float32), ValueError, r"x: expected last dimension 16, got shape \(2, 15\)"),
])
def test_bad_input_is_named(bad, error, match):
    gamma, beta, w, b = _layer(16, 8)
    with pytest.raises(error, match=match):
        FusedLNGeluMatMul(gamma, beta, w, b)(bad)


def test_bad_weights_are_named():
    gamma, beta, w, b = _layer(16, 8)
    with pytest.raises(ValueError, match=r"gamma: expected shape \(16,\)"):
        FusedLNGeluMatMul(gamma[:3], beta, w, b)
    with pytest.raises(ValueError, match=r"bias: expected shape \(8,\)"):
        FusedLNGeluMatMul(gamma, beta, w, b[:2])
    with pytest.raises(ValueError, match="gelu='relu'"):
        FusedLNGeluMatMul(gamma, beta, w, b, gelu="relu")
    with pytest.raises(ValueError, match=r"gemm='mkl': expected one of \['packed', 'openblas'\]"):
        FusedLNGeluMatMul(gamma, beta, w, b, gemm="mkl")
