"""The target LLM on dspark's own C kernels: a GGUF of the llama family run
straight from its 4/8-bit blocks by ``dspark._ext.llama`` (cython_ext/llama/llama_*.c).

Why it exists: speculative decoding on a CPU pays off only if verifying n draft rows costs
little more than decoding one. The kernels stream each weight block once for all rows of a
step (int8 activations against the 4-bit blocks, register-blocked over rows), so a step of
4-16 rows stays close to the cost of one while decoding is memory-bound. docs/llm_kernels.md
has the layout, the measurements and the commands behind them.

Greedy identity by construction: a row's logits never depend on the other rows of the step,
on how many rows run together, on masked cache slots or on the instruction set (every path
rounds the same operations in the same order; tests/unit/test_llm_kernel.py checks it bit
for bit). Plain decoding, chain and tree verification therefore agree exactly.

Taps: ``forward(..., want_taps=True)`` returns ``(logits, taps)``,
taps [T, len(TAP_LAYERS) * hidden] float32, the residual stream after each block of
``TAP_LAYERS``; nothing is kept between calls.

Threads: ``threads`` (default 2) run each step; concurrent calls are serialized inside the
extension, and ``forward_batch`` puts several requests' rows into one step instead.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np

from dspark._ext import llama as _llama
from dspark.errors import ConfigError, RequestError
from dspark.llm.gguf_model import BLOCK_MATRICES, GGUFModel, LlamaConfig
from dspark.runtimes.protocol import CacheRows, TargetRuntime
from dspark.llm.taps import TAP_LAYERS

DEFAULT_MAX_CONTEXT = 2048  # new_cache()'s default capacity
# the kernels' weight formats, run as stored (pack_matrix: the others)
PACKED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q5_1": 24}  # GGUF bytes per 32 weights
K_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # GGUF bytes per 256-weight super-block
# A packed block's fields in order, each (rows, bytes per column): a field is rows x 16 columns
# x that many bytes (llama_kernels.h); K-quant blocks repeat their sub-blocks' fields 8 times.
BLOCK_FIELDS = {"Q4_0": ((4, 4), (1, 2)), "Q4_1": ((4, 4), (2, 2)), "Q8_0": ((8, 4), (1, 2)),
                "Q5_0": ((5, 4), (1, 2)), "Q5_1": ((5, 4), (2, 2)), "Q4_K": ((16, 1), (2, 2), (32, 4)),
                "Q5_K": ((16, 1), (2, 2), (40, 4)), "Q6_K": ((16, 1), (1, 2), (48, 4))}


def pack_blocks(raw: np.ndarray, fmt: str, n: int, k: int) -> "_llama.PackedMatrix":
    """GGUF rows of ``fmt`` blocks (uint8 [n, k / 32 * block bytes]) -> the kernels' tiles.

    Rows are padded with zero blocks to a multiple of 16 (zero scale: zero outputs)."""
    kb, bs = k // 32, BLOCK_BYTES[fmt]
    raw = np.asarray(raw, np.uint8).reshape(n, kb, bs)
    pad = -n % 16
    if pad:
        raw = np.concatenate([raw, np.zeros((pad, kb, bs), np.uint8)])
    nt = (n + pad) // 16

    def per_column(field: np.ndarray, width: int) -> np.ndarray:
        # [nt * 16, kb, width] -> [nt, kb, 16 * width]: the 16 columns side by side per block
        return field.reshape(nt, 16, kb, width).transpose(0, 2, 1, 3).reshape(nt, kb, 16 * width)

    if fmt == "Q8_0":
        q = (raw[:, :, 2:] ^ 0x80).reshape(nt, 16, kb, 8, 4)  # stored unsigned: q + 128
        quants = q.transpose(0, 2, 3, 1, 4).reshape(nt, kb, 512)
        parts = [quants, per_column(raw[:, :, 0:2], 2)]
    else:
        off = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[fmt]  # GGUF: d, m (Q4_1, Q5_1), qh (Q5), qs
        q = raw[:, :, off:off + 16].reshape(nt, 16, kb, 4, 4)  # byte j = input j | input j+16 << 4
        quants = q.transpose(0, 2, 3, 1, 4).reshape(nt, kb, 256)
        parts = [quants]
        if fmt in ("Q5_0", "Q5_1"):  # the fifth bits: bit g of plane byte (column, i) is input 4g + i's
            high = np.ascontiguousarray(raw[:, :, off - 4:off]).view("<u4")[..., 0]  # [rows, kb], bit j: input j
            bits = (high[..., None] >> np.arange(32, dtype=np.uint32)) & 1  # [rows, kb, 32]
            plane = (bits.reshape(-1, kb, 8, 4) << np.arange(8, dtype=np.uint32)[:, None]).sum(2).astype(np.uint8)
            parts.append(per_column(plane, 4))
        parts.append(per_column(raw[:, :, 0:2], 2))
        if fmt in ("Q4_1", "Q5_1"):
            parts.append(per_column(raw[:, :, 2:4], 2))
    packed = np.ascontiguousarray(np.concatenate(parts, axis=2))
    return _llama.PackedMatrix(packed, fmt, n + pad, k)


def _tile_quants(u: np.ndarray, nt: int) -> np.ndarray:
    """Unsigned quants [nt * 16, kb, 32] -> the nibble bytes of each block of 32 in the tile
    layout [nt, kb, 256]: byte (L, column, i) = input 4L + i | input 16 + 4L + i << 4."""
    kb = u.shape[1]
    nibbles = (u[..., :16] & 15) | ((u[..., 16:] & 15) << 4)
    return nibbles.reshape(nt, 16, kb, 4, 4).transpose(0, 2, 3, 1, 4).reshape(nt, kb, 256).astype(np.uint8)


def _tile_plane(bits: np.ndarray, nt: int, width: int) -> np.ndarray:
    """High bits [nt * 16, kb, 32] of ``width`` bits each -> planes [nt, kb, 64 * width]: byte
    (column, i) of plane p holds input 16p + 4L + i's bits at bit width * L (width 2), or input
    4g + i's bit at bit g (width 1)."""
    rows, kb = bits.shape[:2]
    per_byte = 8 // width
    groups = bits.reshape(rows, kb, 32 // (4 * per_byte), per_byte, 4).astype(np.uint32)
    shift = (width * np.arange(per_byte, dtype=np.uint32))[:, None]
    planes = (groups << shift).sum(3).astype(np.uint8)  # [rows, kb, planes, 4]
    return planes.reshape(nt, 16, kb, -1, 4).transpose(0, 2, 3, 1, 4).reshape(nt, kb, -1)


def k_quants(raw: np.ndarray, fmt: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """GGUF K-quant super-blocks (uint8 [rows, super-blocks * bytes]) -> the unsigned quants
    [rows, super-blocks * 8, 32] in input order and the per-super-block fields: ``sc`` and ``m``
    [rows, sb, 8] (Q4_K, Q5_K; six-bit, decoded from their 12 bytes) or ``sc`` [rows, sb, 16] int8
    bytes (Q6_K), and the fp16 bytes of ``d`` (and ``dmin``) [rows, sb, 2]."""
    rows = raw.shape[0]
    blocks = np.asarray(raw, np.uint8).reshape(rows, -1, K_BLOCK_BYTES[fmt])
    nsb = blocks.shape[1]
    if fmt == "Q6_K":
        ql = blocks[..., :128].reshape(rows, nsb, 2, 2, 32)  # [half, ql[0:32] / ql[32:64], l]
        low = np.concatenate([ql & 15, ql >> 4], axis=3)  # [half, quarter, l]
        qh = blocks[..., 128:192].reshape(rows, nsb, 2, 1, 32)
        high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
        u = (low | (high << 4)).reshape(rows, nsb * 8, 32)
        return u, {"sc": blocks[..., 192:208], "d": blocks[..., 208:210]}
    sc, mn = _k_scales(blocks[..., 4:16])
    qs = blocks[..., -128:].reshape(rows, nsb, 4, 1, 32)  # chunk j: sub-block 2j low, 2j + 1 high nibbles
    u = ((qs >> np.array([0, 4], np.uint8)[:, None]) & 15).reshape(rows, nsb, 8, 32)
    if fmt == "Q5_K":
        qh = blocks[..., 16:48].reshape(rows, nsb, 1, 32)
        u = u | (((qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
    return u.reshape(rows, nsb * 8, 32), {"sc": sc, "m": mn, "d": blocks[..., 0:2], "dmin": blocks[..., 2:4]}


def pack_k_blocks(raw: np.ndarray, fmt: str, n: int, k: int) -> "_llama.PackedMatrix":
    """GGUF rows of K-quant super-blocks -> the kernels' tiles (llama_kernels.h: each block's
    per-column scales first, then its 8 sub-blocks' quants), rows padded
    with zero blocks to a multiple of 16. The quants and scales are the file's, bit for bit."""
    if k % 256:
        raise ConfigError(fmt, f"row length {k} is not a multiple of the 256-weight super-block")
    raw = np.asarray(raw, np.uint8).reshape(n, -1)
    pad = -n % 16
    if pad:
        raw = np.concatenate([raw, np.zeros((pad, raw.shape[1]), np.uint8)])
    nt, nsb = (n + pad) // 16, k // 256
    u, fields = k_quants(raw, fmt)
    subs = [_tile_quants(u, nt)]
    if fmt == "Q5_K":
        subs.append(_tile_plane(u >> 4, nt, 1))
    elif fmt == "Q6_K":
        subs.append(_tile_plane(u >> 4, nt, 2))
    quants = np.concatenate(subs, axis=2).reshape(nt, nsb, -1)  # 8 sub-blocks side by side

    def per_column(field: np.ndarray) -> np.ndarray:
        # [nt * 16, nsb, rows, width] -> [nt, nsb, rows * 16 * width]
        r, w = field.shape[2:]
        return field.reshape(nt, 16, nsb, r, w).transpose(0, 2, 3, 1, 4).reshape(nt, nsb, -1)

    parts = [per_column(fields["sc"][..., None])]
    if fmt != "Q6_K":
        parts.append(per_column(fields["m"][..., None]))
    parts.append(per_column(fields["d"][:, :, None]))
    if fmt != "Q6_K":
        parts.append(per_column(fields["dmin"][:, :, None]))
    parts.append(quants)
    packed = np.ascontiguousarray(np.concatenate(parts, axis=2))
    return _llama.PackedMatrix(packed, fmt, n + pad, k)


@dataclass
class KernelCache(CacheRows):
    """One sequence's fp16 KV cache: ``length`` rows valid, room for ``capacity``.

    keys [n_layer, n_kv, slots / 16, head_dim, 16] (blocks of 16 slots, transposed), values
    [n_layer, n_kv, slots, head_dim], both fp16 bits in uint16; rows past ``length`` are stale
    and never read."""
    keys: np.ndarray
    values: np.ndarray
    positions: np.ndarray
    length: int = 0
    capacity: int = 0

    def keep_rows(self, start: int, rows: np.ndarray) -> None:
        """Keep cache slots ``start + rows`` (ascending) as slots ``start, start+1, ...``."""
        rows = np.asarray(rows, np.int64)
        n = len(rows)
        if n and not np.array_equal(rows, np.arange(n)):
            src, dst = start + rows, start + np.arange(n)
            self.keys[:, :, dst // 16, :, dst % 16] = self.keys[:, :, src // 16, :, src % 16]
            self.values[:, :, dst] = self.values[:, :, src]
            self.positions[dst] = self.positions[src]
        self.length = start + n

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.positions.nbytes

    def read_rows(self, start: int, stop: int) -> "KernelRows":
        """A copy of rows ``start:stop`` (both multiples of 16: whole key blocks)."""
        if start % 16 or stop % 16 or not 0 <= start < stop <= self.length:
            raise ValueError(f"rows {start}:{stop} of {self.length}: expected whole blocks of 16 cached rows")
        return KernelRows(self.keys[:, :, start // 16:stop // 16].copy(),
                          self.values[:, :, start:stop].copy(), self.positions[start:stop].copy())

    def write_rows(self, start: int, rows: "KernelRows") -> None:
        """Put ``rows`` (from ``read_rows`` of a cache of the same model) at ``start`` (a multiple
        of 16, at most ``length``); the cache then ends after them."""
        n = len(rows.positions)
        if start % 16 or not 0 <= start <= self.length:
            raise ValueError(f"cannot write rows at {start} of a cache of length {self.length}")
        self.check_room(start + n - self.length)
        self.keys[:, :, start // 16:(start + n) // 16] = rows.keys
        self.values[:, :, start:start + n] = rows.values
        self.positions[start:start + n] = rows.positions
        self.length = start + n

    @classmethod
    def empty(cls, model: "_llama.LlamaModel", capacity: int) -> "KernelCache":
        """An empty cache of ``model`` with room for ``capacity`` rows."""
        kshape, vshape = model.cache_shapes(capacity)
        return cls(np.zeros(kshape, np.uint16), np.zeros(vshape, np.uint16),
                   np.zeros(vshape[2], np.int64), 0, capacity)


@dataclass
class KernelRows:
    """Rows copied out of a ``KernelCache`` (``read_rows``), in its layout."""
    keys: np.ndarray
    values: np.ndarray
    positions: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.positions.nbytes


def pack_float(weights: np.ndarray) -> "_llama.PackedMatrix":
    """A float matrix [n outputs, k inputs] quantized to Q8_0 blocks, in the kernels' layout."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    weights = np.asarray(weights, np.float32)
    return pack_blocks(quantize(weights, GGMLQuantizationType.Q8_0), "Q8_0", *weights.shape)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs of each Q4_K/Q5_K super-block's 12 bytes."""
    s = scales.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


PACK_CHUNK_ROWS = 8192  # a multiple of 16: each chunk is whole tiles, contiguous in the packed bytes


def _in_chunks(pack, raw: np.ndarray, fmt: str, k: int) -> "_llama.PackedMatrix":
    """``pack(raw, fmt, rows, k)`` a chunk of rows at a time into one buffer: packing a large
    head (Gemma 3's 262144 rows) holds a chunk's temporaries, not the whole matrix's three times."""
    n = raw.shape[0]
    if n <= PACK_CHUNK_ROWS:
        return pack(raw, fmt, n, k)
    first = pack(raw[:PACK_CHUNK_ROWS], fmt, PACK_CHUNK_ROWS, k).data
    per_tile = first.nbytes // (PACK_CHUNK_ROWS // 16)
    padded = n + -n % 16
    out = np.empty(padded // 16 * per_tile, np.uint8)
    out[:first.nbytes] = first
    for start in range(PACK_CHUNK_ROWS, n, PACK_CHUNK_ROWS):
        chunk = raw[start:start + PACK_CHUNK_ROWS]
        data = pack(chunk, fmt, len(chunk), k).data  # the last chunk's rows padded to a tile
        out[start // 16 * per_tile:start // 16 * per_tile + data.nbytes] = data
    return _llama.PackedMatrix(out, fmt, padded, k)


def pack_matrix(model: GGUFModel, name: str, rows: np.ndarray | None = None) -> "_llama.PackedMatrix":
    """One GGUF matrix (only its ``rows`` when given) in the kernels' layout. Q4_0/Q4_1/Q8_0/
    Q5_0/Q5_1 and Q4_K/Q5_K/Q6_K blocks run as stored; F32/F16/BF16 are quantized to Q8_0 at
    load, so every product runs on the int8 kernels."""
    kind = model.tensor_type(name)
    n, k = model.shape(name)
    if kind in PACKED_TYPES:
        raw = np.asarray(model.raw(name)).reshape(n, -1)  # [n, k / block * block bytes]
        raw = raw if rows is None else raw[rows]
        pack = pack_k_blocks if kind in K_BLOCK_BYTES else pack_blocks
        return _in_chunks(pack, raw, kind, k)
    weights = model.dequantized(name)  # [n, k]
    return pack_float(weights if rows is None else weights[rows])


def pack_weights(model: GGUFModel) -> dict:
    """Every weight of the model, packed (matrices) or float32 (norms, biases), by the names the
    binding takes. All are copies: nothing keeps the GGUF's memory map (and its pages) alive."""
    cfg = model.config

    def vector(name: str) -> np.ndarray:
        return np.array(model.dequantized(name), np.float32)  # a copy, not a view of the map

    weights = {"embed": pack_matrix(model, "token_embd.weight"), "out_norm": vector("output_norm.weight")}
    weights["head"] = weights["embed"] if cfg.tied_embeddings else pack_matrix(model, "output.weight")
    if model.has("rope_freqs.weight"):
        weights["rope_factors"] = vector("rope_freqs.weight")
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        for norm in ("attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"):
            if model.has(p + norm + ".weight"):
                weights[p + norm] = vector(p + norm + ".weight")
        if cfg.arch.qkv_bias:
            weights[p + "qkv_bias"] = np.concatenate([vector(p + f"attn_{x}.bias") for x in "qkv"])
        for name in BLOCK_MATRICES:
            weights[p + name] = pack_matrix(model, p + name + ".weight")
    return weights


def kernel_config(cfg: LlamaConfig) -> dict:
    """The extension's model description (sizes and architecture switches) of a config."""
    arch = cfg.arch
    return {"n_layer": cfg.n_layer, "hidden": cfg.hidden, "ffn": cfg.ffn, "n_head": cfg.n_head,
            "n_kv": cfg.n_kv_head, "head_dim": cfg.head_dim, "vocab": cfg.vocab, "rms_eps": cfg.rms_eps,
            "rope_base": cfg.rope_base, "rope_neox": arch.rope_neox, "ffn_gelu": arch.ffn_gelu,
            "embed_scale": cfg.embed_scale, "rope_base_local": arch.local_rope_base,
            "windows": [cfg.layer_window(i) for i in range(cfg.n_layer)],
            "local_rope": [cfg.layer_window(i) > 0 for i in range(cfg.n_layer)]}


@lru_cache(maxsize=64)
def _causal(t: int) -> np.ndarray:
    return np.tri(t, dtype=bool)


def default_threads() -> int:
    """2 (the kernels' design point), fewer on a 1-core machine."""
    return max(1, min(2, len(os.sched_getaffinity(0))))


class KernelRuntime(TargetRuntime):
    """A llama GGUF on dspark's C kernels, with the target-runtime interface (config, new_cache, forward,
    want_taps, logit_rows, forward_batch) plus ``project`` through the head or a vocabulary
    subset of it (``head_subset``)."""
    exact_trees = True  # a tree row's logits are bitwise a chain's (docs/llm_kernels.md)
    skips_logits = True  # forward(logit_rows=()) runs no head product (a prompt's chunks)
    copies_rows = True  # KernelCache.read_rows / write_rows

    def __init__(self, model: GGUFModel | str | Path, threads: int | None = None,
                 isa: str | None = None, max_context: int = DEFAULT_MAX_CONTEXT):
        model = model if isinstance(model, GGUFModel) else GGUFModel(model)
        self.config: LlamaConfig = replace(model.config, ctx=min(model.config.ctx, max_context))
        weights = pack_weights(model)
        c = self.config
        self._model = _llama.LlamaModel(kernel_config(c), weights, threads or default_threads(), isa)
        self.weights = weights  # the packed matrices (the extension holds them too)
        self._head = weights["head"]
        # the tapped layers this model has (a small test model may lack the deeper ones)
        self.tap_layers = tuple(layer for layer in TAP_LAYERS if layer < c.n_layer)

    @property
    def isa(self) -> str:
        return self._model.isa

    @isa.setter
    def isa(self, name: str) -> None:
        self._model.isa = name

    @property
    def threads(self) -> int:
        return self._model.threads

    def new_cache(self, capacity: int | None = None) -> KernelCache:
        capacity = int(capacity or self.config.ctx)
        if not 0 < capacity <= self.config.ctx:
            raise RequestError("capacity", f"{capacity}: expected 1..{self.config.ctx} rows (max_context)")
        return KernelCache.empty(self._model, capacity)

    def _segment(self, where: str, cache, tokens, positions, tree_mask, past_visible):
        if not isinstance(cache, KernelCache):
            raise RequestError(where + "cache", f"expected a cache from new_cache(), got {type(cache).__name__}")
        tokens = np.asarray(tokens)
        t, length = (tokens.shape[0] if tokens.ndim == 1 else 0), cache.length
        cache.check_room(t)
        mask = np.empty((t, length + t), bool)
        if past_visible is None:
            mask[:, :length] = True
        else:
            past_visible = np.asarray(past_visible)
            if past_visible.shape != (t, length):
                raise RequestError(where + "past_visible", f"expected shape ({t}, {length}), got {past_visible.shape}")
            mask[:, :length] = past_visible
        if tree_mask is None:
            mask[:, length:] = _causal(t)
        else:
            tree_mask = np.asarray(tree_mask)
            if tree_mask.shape != (t, t):
                raise RequestError(where + "tree_mask", f"expected shape ({t}, {t}), got {tree_mask.shape}")
            if not np.all(np.diagonal(tree_mask)):
                raise RequestError(where + "tree_mask", "every token must see itself (the diagonal must be True)")
            mask[:, length:] = tree_mask
        return (cache.keys, cache.values, length, tokens, positions, mask, cache.positions)

    def _run(self, items: list, logit_rows: Sequence[int] | None, head) -> tuple[np.ndarray, np.ndarray]:
        caches = [id(item[0]) for item in items]
        if len(set(caches)) < len(caches):
            dup = next(i for i, c in enumerate(caches) if c in caches[:i])
            raise RequestError(f"items[{dup}].cache", "the same cache appears twice in one batch")
        segs = [self._segment(f"items[{i}]." if len(items) > 1 else "", *item) for i, item in enumerate(items)]
        rows = sum(len(s[3]) for s in segs)
        lr = np.arange(rows) if logit_rows is None else np.asarray(logit_rows, np.int64)
        head = head or self._head
        logits = np.empty((len(lr), head.n), np.float32)
        taps = np.empty((rows, len(self.tap_layers) * self.config.hidden), np.float32)
        self._model.forward(segs, lr, logits, taps, self.tap_layers, head)
        for (cache, _, positions, *_), seg in zip(items, segs):
            t = len(seg[3])
            cache.positions[cache.length:cache.length + t] = positions
            cache.length += t
        return logits, taps

    def forward(self, cache: KernelCache, tokens, positions, tree_mask: np.ndarray | None = None,
                past_visible: np.ndarray | None = None, want_taps: bool = False,
                logit_rows: Sequence[int] | None = None):
        """Run T new tokens against the cache; return logits [T, vocab] float32 (only the rows
        in ``logit_rows``, in that order, when given: a prompt needs only its last row).

        ``tree_mask`` (T x T, default causal) says which new tokens see which; ``past_visible``
        (T x length, default all) which cached rows they see. The new rows are appended to the
        cache. With ``want_taps`` the result is ``(logits, taps)``."""
        if len(tokens) == 0:
            empty = np.zeros((0, self.config.vocab), np.float32)
            return (empty, np.zeros((0, len(self.tap_layers) * self.config.hidden), np.float32)) \
                if want_taps else empty
        logits, taps = self._run([(cache, tokens, positions, tree_mask, past_visible)], logit_rows, None)
        logits = logits[:, :self.config.vocab]
        return (logits, taps) if want_taps else logits

    def forward_batch(self, items: Sequence[tuple], want_taps: bool = False,
                      skip_logits: Sequence[int] = ()) -> list:
        """Several requests' new rows in one step: items of (cache, tokens, positions,
        tree_mask[, past_visible]) with distinct caches; results in item order, as ``forward``
        returns them (bitwise the same as separate calls). The items numbered in
        ``skip_logits`` (a prompt's rows) get no logits (zero rows) and cost no head product."""
        if not items:
            return []
        full = [tuple(item) + (None,) * (5 - len(item)) for item in items]
        counts = [len(np.asarray(item[1])) for item in full]
        starts = np.cumsum([0] + counts)
        skip = set(skip_logits)
        logit_rows = None if not skip else np.concatenate(
            [np.arange(starts[i], starts[i + 1]) for i in range(len(full)) if i not in skip] + [np.zeros(0, np.int64)])
        logits, taps = self._run(full, logit_rows, None)
        out, row = [], 0
        for i, t in enumerate(counts):
            n = 0 if i in skip else t
            part = logits[row:row + n, :self.config.vocab]
            row += n
            out.append((part, taps[starts[i]:starts[i + 1]]) if want_taps else part)
        return out

    def head_subset(self, vocab_ids: Sequence[int]) -> "_llama.PackedMatrix":
        """The head restricted to ``vocab_ids`` (e.g. a drafter's frequency-ranked vocabulary),
        for ``project``; column j of its logits is vocabulary id vocab_ids[j]."""
        ids = np.asarray(vocab_ids)
        if ids.ndim != 1 or not len(ids) or ids.dtype.kind not in "iu" \
                or ids.min() < 0 or ids.max() >= self.config.vocab:
            raise RequestError("vocab_ids", f"expected a non-empty 1-D list of ids in [0, {self.config.vocab})")
        return gather_columns(self._head, ids)

    def project(self, hidden: np.ndarray, head: "_llama.PackedMatrix | None" = None,
                norm: bool = True) -> np.ndarray:
        """Logits [n, columns] of hidden states [n, hidden] through the final RMSNorm (unless
        ``norm`` is False) and the head (or a ``head_subset``)."""
        head = head or self._head
        hidden = np.asarray(hidden)
        if hidden.ndim != 2 or hidden.shape[1] != self.config.hidden or not len(hidden):
            raise RequestError("hidden", f"expected [n, {self.config.hidden}] hidden states, got {hidden.shape}")
        logits = np.empty((hidden.shape[0], head.n), np.float32)
        self._model.project(np.ascontiguousarray(hidden, np.float32), logits, head, norm)
        return logits[:, :self.config.vocab] if head is self._head else logits


def gather_columns(matrix: "_llama.PackedMatrix", columns: np.ndarray) -> "_llama.PackedMatrix":
    """A packed matrix of the given output columns of another (padded with zero columns)."""
    fmt, n, k = matrix.fmt, matrix.n, matrix.k
    fields = BLOCK_FIELDS[fmt]
    nt, block = n // 16, sum(r * 16 * w for r, w in fields)
    data = matrix.data.reshape(nt, -1, block)
    kb = data.shape[1]
    tile, lane = columns // 16, columns % 16
    m = len(columns)
    pad = -m % 16
    mt = (m + pad) // 16
    parts, start = [], 0
    for r, w in fields:
        field = data[:, :, start:start + r * 16 * w].reshape(nt, kb, r, 16, w)[tile, :, :, lane]  # [m, kb, r, w]
        field = np.concatenate([field, np.zeros((pad,) + field.shape[1:], np.uint8)])
        parts.append(field.reshape(mt, 16, kb, r, w).transpose(0, 2, 3, 1, 4).reshape(mt, kb, r * 16 * w))
        start += r * 16 * w
    packed = np.concatenate(parts, axis=2)
    return _llama.PackedMatrix(np.ascontiguousarray(packed), fmt, m + pad, k)
