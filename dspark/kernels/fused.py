"""Fused ``y = GELU(LayerNorm(x; gamma, beta)) @ W + b`` on float32 rows.

By default (``gemm="packed"``) W is packed once, when the layer is built, into the column
panels of our own register-blocked micro-kernels (one per instruction set), and LayerNorm+GELU
run while each cache-sized block of rows is packed for them. With ``gemm="openblas"`` they run
per row block into a scratch block (2 MiB, see default_block_rows) that feeds OpenBLAS's sgemm,
which repacks W on every call. Either way no full-size normalised or activated copy of ``x``
exists, and the GIL is released during the call. This is the order transformer layers
use (gamma/beta belong to the LayerNorm); applying gamma/beta after the MatMul
would be a different function.
"""
from __future__ import annotations

import math
import mmap

import numpy as np

from dspark._ext import fused as _fused

GELU_KINDS = {"erf": 0, "tanh": 1}


SCRATCH_BYTES = 2 << 20  # the openblas path's LayerNorm+GELU block
# Block sizes of the packed path (Zen 3: 32 KiB L1d, 512 KiB L2 per core), chosen by the
# sweep in docs/kernels.md: a 384 x 16 panel of W is 24 KiB (L1); 144 x 384 packed rows
# (216 KiB) and 384 x 128 of W (192 KiB) share L2.
DEFAULT_KC = 384
DEFAULT_MC = 144
DEFAULT_NC = 128
DEFAULT_MB = 1024  # rows activated and packed per K block: W streams once per 1024 rows


def default_block_rows(d: int) -> int:
    """Rows per LayerNorm+GELU block: a 2 MiB scratch block (multiple of 8 rows).

    OpenBLAS repacks W on every sgemm call, so blocks much smaller than its own
    M-blocking cost more in repacking than they save in cache misses (measured in
    docs/kernels.md); 2 MiB stays in L3 and gives 512 rows at d=1024."""
    return max(8, SCRATCH_BYTES // (4 * d) // 8 * 8)


def _as_rows(name: str, a: np.ndarray, d: int | None = None) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.float32:
        raise TypeError(f"{name}: expected float32, got {a.dtype}")
    if a.ndim == 0 or (d is not None and a.shape[-1] != d):
        raise ValueError(f"{name}: expected last dimension {d}, got shape {a.shape}")
    return np.ascontiguousarray(a.reshape(-1, a.shape[-1]))


def _vector(name: str, a: np.ndarray | None, n: int, optional: bool = False) -> np.ndarray | None:
    if a is None:
        if optional:
            return None
        raise ValueError(f"{name}: required")
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.shape != (n,):
        raise ValueError(f"{name}: expected shape ({n},), got {a.shape}")
    return a


GEMMS = ("packed", "openblas")
MAX_THREADS = 64  # the packed driver's limit


def _size(name: str, value: int, default: int, lowest: int = 1, highest: int = _fused.MAX_BLOCK_SIZE) -> int:
    """An integer argument in [lowest, highest]; ``default`` when it says "default" (0 or -1)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an integer, got {value!r}")
    value = default if value == (lowest - 1) else int(value)
    if not lowest <= value <= highest:
        raise ValueError(f"{name}: must be between {lowest} and {highest}, got {value}")
    return value


HUGE_PAGE = 2 << 20


def _aligned_empty(n_floats: int) -> np.ndarray:
    """A float32 vector on a 64-byte boundary; from 2 MiB up, on 2 MiB boundaries in memory
    advised for transparent huge pages, so streaming a packed W does not walk the page
    tables every 4 KiB (Linux; elsewhere the advice is skipped)."""
    if n_floats * 4 < HUGE_PAGE:
        buf = np.empty(n_floats + 16, np.float32)
        start = (-buf.ctypes.data % 64) // 4
        return buf[start:start + n_floats]
    region = mmap.mmap(-1, n_floats * 4 + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = np.frombuffer(region, np.uint8)
    start = -buf.ctypes.data % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE, start, len(region) - start)
    return buf[start:start + n_floats * 4].view(np.float32)


class FusedLNGeluMatMul:
    """One fused layer; call it on (..., d) float32 input.

    ``gemm="packed"`` (the default) packs W once, here, into the column panels of our
    register-blocked micro-kernels and fuses LayerNorm+GELU into the packing of each block of
    rows; ``gemm="openblas"`` runs the row blocks through OpenBLAS's sgemm (which repacks W on
    every call) and keeps W as given. Measured in docs/kernels.md: packed is 1.3-1.8x faster at
    16 rows and level elsewhere, except 512x1024->4096 where the OpenBLAS path was ~9% faster. ``kc``/``mc`` are the packed
    path's K and row block sizes, ``nc`` its column block (0: all columns), ``mb`` the rows
    activated per K block (defaults: DEFAULT_KC, DEFAULT_MC, DEFAULT_NC, DEFAULT_MB)."""

    def __init__(self, gamma: np.ndarray, beta: np.ndarray, weight: np.ndarray,
                 bias: np.ndarray | None = None, *, eps: float = 1e-5, gelu: str = "erf",
                 threads: int = 1, block_rows: int | None = None, gemm: str = "packed",
                 kc: int = 0, mc: int = 0, nc: int = -1, mb: int = 0) -> None:
        if gelu not in GELU_KINDS:
            raise ValueError(f"gelu={gelu!r}: expected one of {sorted(GELU_KINDS)}")
        if gemm not in GEMMS:
            raise ValueError(f"gemm={gemm!r}: expected one of {list(GEMMS)}")
        weight = np.asarray(weight)
        if weight.ndim != 2 or 0 in weight.shape:
            raise ValueError(f"weight: expected 2-D (d, n) with d, n >= 1, got shape {weight.shape}")
        self.d, self.n = weight.shape
        self.gamma = _vector("gamma", gamma, self.d)
        self.beta = _vector("beta", beta, self.d)
        self.bias = _vector("bias", bias, self.n, optional=True)
        self.eps = float(eps)
        self.gelu = gelu
        self.threads = _size("threads", threads, 1, highest=MAX_THREADS)
        self.gemm = gemm
        self.block_rows = _size("block_rows", block_rows or 0, default_block_rows(self.d))
        self.kc = _size("kc", kc, DEFAULT_KC)
        self.mc = _size("mc", mc, DEFAULT_MC)
        self.nc = _size("nc", nc, DEFAULT_NC, lowest=0)
        self.mb = _size("mb", mb, DEFAULT_MB)
        weight = np.ascontiguousarray(weight, dtype=np.float32)
        if self.gemm == "openblas":
            self.weight = weight
            return
        self.weight_packed = _aligned_empty(_fused.packed_weights_size(self.d, self.n))
        _fused.pack_weights(weight, self.weight_packed, self.kc)
        self.bias_padded = None
        if self.bias is not None:
            self.bias_padded = np.zeros(-(-self.n // _fused.PANEL_WIDTH) * _fused.PANEL_WIDTH, np.float32)
            self.bias_padded[:self.n] = self.bias

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        rows = _as_rows("x", x, self.d)
        shape = tuple(np.shape(x)[:-1]) + (self.n,)
        if out is None:
            out = np.empty(shape, np.float32)
        elif out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"out: expected C-contiguous float32 {shape}, got {out.dtype} {out.shape}")
        if self.gemm == "packed":
            _fused.fused_forward_packed(rows, self.gamma, self.beta, self.weight_packed, self.n,
                                        self.bias_padded, out.reshape(-1, self.n), self.eps,
                                        GELU_KINDS[self.gelu], self.kc, self.mc, self.nc, self.mb,
                                        self.threads)
        else:
            _fused.fused_forward(rows, self.gamma, self.beta, self.weight, self.bias,
                                 out.reshape(-1, self.n), self.eps, GELU_KINDS[self.gelu],
                                 self.block_rows, self.threads)
        return out

    @property
    def simd_path(self) -> str:
        return _fused.simd_info()["chosen"]


def fused_ln_gelu_matmul(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, weight: np.ndarray,
                         bias: np.ndarray | None = None, *, eps: float = 1e-5, gelu: str = "erf",
                         threads: int = 1, block_rows: int | None = None) -> np.ndarray:
    """One-shot form of :class:`FusedLNGeluMatMul`."""
    layer = FusedLNGeluMatMul(gamma, beta, weight, bias, eps=eps, gelu=gelu, threads=threads,
                              block_rows=block_rows)
    return layer(x)


def ln_gelu(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, *, eps: float = 1e-5,
            gelu: str = "erf") -> tuple[np.ndarray, str]:
    """GELU(LayerNorm(x)) alone on the selected SIMD path; returns (result, path name)."""
    if gelu not in GELU_KINDS:
        raise ValueError(f"gelu={gelu!r}: expected one of {sorted(GELU_KINDS)}")
    rows = _as_rows("x", x)
    d = rows.shape[1]
    out = np.empty_like(rows)
    path = _fused.ln_gelu(rows, _vector("gamma", gamma, d), _vector("beta", beta, d), out,
                          float(eps), GELU_KINDS[gelu])
    return out.reshape(np.shape(x)), path


_erf_object = np.frompyfunc(math.erf, 1, 1)


def reference_ln_gelu(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float = 1e-5,
                      gelu: str = "erf") -> np.ndarray:
    """float64 GELU(LayerNorm(x)): the reference every SIMD path is measured against."""
    x = np.asarray(x, np.float64)
    h = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)
    h = h * np.asarray(gamma, np.float64) + np.asarray(beta, np.float64)
    if gelu == "tanh":
        return 0.5 * h * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h ** 3)))
    return 0.5 * h * (1.0 + _erf_object(h / math.sqrt(2.0)).astype(np.float64))


def reference_fused(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, weight: np.ndarray,
                    bias: np.ndarray | None = None, eps: float = 1e-5, gelu: str = "erf") -> np.ndarray:
    """float64 GELU(LayerNorm(x)) @ W + b."""
    y = reference_ln_gelu(x, gamma, beta, eps, gelu) @ np.asarray(weight, np.float64)
    return y if bias is None else y + np.asarray(bias, np.float64)


def sgemm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b through the fused layer's own BLAS (to measure its sgemm peak)."""
    a = np.ascontiguousarray(a, np.float32)
    b = np.ascontiguousarray(b, np.float32)
    for name, array in (("a", a), ("b", b)):
        if array.ndim != 2:
            raise ValueError(f"{name}: expected a 2-D array, got shape {array.shape}")
    c = np.empty((a.shape[0], b.shape[1]), np.float32)
    _fused.sgemm(a, b, c)
    return c
