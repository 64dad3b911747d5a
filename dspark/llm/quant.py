"""GGML weight blocks as ONNX Runtime ``com.microsoft::MatMulNBits`` inputs, without rounding.

A GGML matrix row ``n`` is cut into blocks of 32 inputs, each stored with its scale ``d``:

* ``Q4_0``: ``w = d * (q - 8)``      → 4-bit, zero point 8 (MatMulNBits' default)
* ``Q4_1``: ``w = d * q + m``        → 4-bit, zero point 8, plus ``m + 8 d`` per block (below)
* ``Q8_0``: ``w = d * q``, q int8   → 8-bit, q + 128, zero point 128 (the default)

Q4_1's offset ``m`` is ``(q - zp) d`` with the fractional ``zp = -m/d``; ORT accepts a float zero
point, but its CPU kernel then dequantizes the whole matrix on every call (about 20x slower,
measured). So the integer part goes to MatMulNBits (zero point 8) and the rest is an exact
low-rank term: ``y = MatMulNBits(x) + blocksums(x) @ offsets.T`` with ``offsets[n, b] = m + 8 d``
and ``blocksums(x)[t, b]`` the sum of x over block b; see :class:`NBitsWeight`.

Nibbles: GGML packs element ``j`` in the low and ``j + 16`` in the high nibble of byte ``j``;
MatMulNBits packs elements ``2i`` (low) and ``2i + 1`` (high) in byte ``i``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK = 32  # GGML's block length for Q4_0, Q4_1, Q8_0
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
NBITS_TYPES = tuple(_BLOCK_BYTES)


@dataclass
class NBitsWeight:
    """Inputs of one MatMulNBits node for a weight ``[n, k]`` (``y = x @ W.T``).

    ``packed``: uint8 ``[n, k / 32, 32 * bits / 8]``; ``scales``: float32 ``[n * k / 32]``;
    ``offsets``: float32 ``[n, k / 32]`` or None, the per-block constant Q4_1 adds.
    """
    bits: int
    n: int
    k: int
    packed: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None = None


def _blocks(raw: np.ndarray, kind: str, n: int, k: int) -> np.ndarray:
    if k % QK:
        raise ValueError(f"{kind} row length {k} is not a multiple of {QK}")
    return np.ascontiguousarray(raw).reshape(n, k // QK, _BLOCK_BYTES[kind])


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _ggml_nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes → [..., 32] values in element order."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def to_nbits(raw: np.ndarray, kind: str, n: int, k: int) -> NBitsWeight:
    """Convert GGML blocks (``raw``: uint8 ``[n, bytes per row]``) of type ``kind``."""
    blocks = _blocks(raw, kind, n, k)
    d = _half(blocks, 0)
    if kind == "Q8_0":
        q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128
        return NBitsWeight(8, n, k, q.astype(np.uint8), d.reshape(-1))
    if kind == "Q4_0":
        return NBitsWeight(4, n, k, _pack_nibbles(_ggml_nibbles(blocks[..., 2:])), d.reshape(-1))
    if kind == "Q4_1":
        m = _half(blocks, 2)
        packed = _pack_nibbles(_ggml_nibbles(blocks[..., 4:]))
        return NBitsWeight(4, n, k, packed, d.reshape(-1), m + 8.0 * d)
    raise ValueError(f"no MatMulNBits form for {kind}")


def dequantize(weight: NBitsWeight) -> np.ndarray:
    """The float32 ``[n, k]`` matrix a :class:`NBitsWeight` stands for (tests, reference)."""
    if weight.bits == 8:
        q = weight.packed.astype(np.float32) - 128.0
    else:
        p = weight.packed
        q = np.empty(p.shape[:-1] + (2 * p.shape[-1],), np.float32)
        q[..., 0::2], q[..., 1::2] = p & 0x0F, p >> 4
        q -= 8.0
    w = q * weight.scales.reshape(weight.n, -1, 1)
    if weight.offsets is not None:
        w += weight.offsets[..., None]
    return w.reshape(weight.n, weight.k)


def concat_rows(weights: list[NBitsWeight]) -> NBitsWeight:
    """One weight from several with the same input (Q, K, V → QKV; gate, up → gate_up)."""
    first = weights[0]
    if any(w.bits != first.bits or w.k != first.k for w in weights):
        raise ValueError("can only fuse weights of one bit width and input size")
    offsets = None
    if any(w.offsets is not None for w in weights):
        offsets = np.concatenate([w.offsets if w.offsets is not None
                                  else np.zeros((w.n, w.k // QK), np.float32) for w in weights])
    return NBitsWeight(first.bits, sum(w.n for w in weights), first.k,
                       np.concatenate([w.packed for w in weights]),
                       np.concatenate([w.scales for w in weights]), offsets)
