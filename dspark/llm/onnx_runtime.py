"""The target runtime (the interface KernelRuntime also has) on ONNX Runtime: a graph from :mod:`dspark.llm.onnx_graph`.

``OnnxLlama(path)`` serves one imported model. Its KV caches live in a pool of ``max_batch``
slots per layer (``[slots, kv_heads, rows, head_dim]``, float32: ORT's CPU attention casts a float16
cache whole on every call); a cache is one
slot, and ORT's attention writes new rows straight into it (the graph's past and present
tensors are bound to the same memory), so a call copies no cache. The pool is allocated
zeroed and untouched, so memory becomes resident only as rows are written.

Taps: ``forward(..., want_taps=True)`` returns ``(logits, taps)``, taps ``[T, len(tap_layers) *
hidden]`` float32: the residual stream after the blocks in ``self.tap_layers``
(``dspark.llm.taps.TAP_LAYERS`` for SmolLM2), so no state is kept between calls.
``forward_batch`` runs several requests' rows in one call when their caches share the pool
(it pays because decoding is bound by reading the weights).

All calls on one runtime are serialised by a lock: the ORT call already uses every core given
to it, and batch calls write scratch rows past other slots' valid lengths.
"""
from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np
import onnxruntime as ort

from dspark.runtimes.onnx_session import make_session_options
from dspark.errors import ConfigError
from dspark.llm.gguf_model import LlamaConfig
from dspark.runtimes.protocol import CacheRows, TargetRuntime
from dspark.llm.onnx_graph import GRAPH_FORMAT

# Every call runs at least this many rows: ORT's kernels take another path for one row, which
# changes the last bits; with two, a decode step and a verification row see the same kernels.
MIN_ROWS = 2
DEFAULT_MAX_CONTEXT = 2048
DEFAULT_MAX_BATCH = 4


@lru_cache(maxsize=64)
def _causal(t: int) -> np.ndarray:
    return np.tri(t, dtype=bool)


class _CachePool:
    """``slots`` caches of ``rows`` rows each, per layer, plus ORT views of slot ranges."""

    def __init__(self, cfg: LlamaConfig, slots: int, rows: int, dtype: np.dtype):
        shape = (slots, cfg.n_kv_head, rows, cfg.head_dim)
        self.keys = [np.zeros(shape, dtype) for _ in range(cfg.n_layer)]
        self.values = [np.zeros(shape, dtype) for _ in range(cfg.n_layer)]
        self.rows = rows
        self._free = list(range(slots))
        self._bindings: dict[tuple[int, int], ort.IOBinding] = {}
        self._lock = threading.Lock()

    def take(self) -> int | None:
        with self._lock:
            return self._free.pop(0) if self._free else None

    def give_back(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)
            self._free.sort()

    def binding(self, session: ort.InferenceSession, lo: int, hi: int) -> ort.IOBinding:
        """An IOBinding whose past/present tensors are slots ``lo..hi-1`` (built once)."""
        io = self._bindings.get((lo, hi))
        if io is None:
            io = session.io_binding()
            for i, (k, v) in enumerate(zip(self.keys, self.values)):
                for name, arr in ((f"key_{i}", k), (f"value_{i}", v)):
                    value = ort.OrtValue.ortvalue_from_numpy(arr[lo:hi])
                    io.bind_ortvalue_input("past_" + name, value)
                    io.bind_ortvalue_output("present_" + name, value)
            self._bindings[(lo, hi)] = io
        return io


class LlamaKVCache(CacheRows):
    """One request's cache: a pool slot. ``length`` rows are valid; rollback sets a shorter
    length; rows past it may hold stale data and are never attended to."""

    def __init__(self, pool: _CachePool, slot: int, capacity: int):
        self.pool, self.slot = pool, slot
        self.capacity = capacity
        self.length = 0
        self.positions = np.zeros(pool.rows, np.int64)
        self._release = weakref.finalize(self, pool.give_back, slot)

    def keep_rows(self, start: int, rows) -> None:
        """Keep cache rows ``start + rows`` (ascending) as rows ``start, start+1, ...``."""
        rows = np.asarray(rows, np.int64)
        n = len(rows)
        if n and not np.array_equal(rows, np.arange(n)):
            src = start + rows
            for arr in (*self.pool.keys, *self.pool.values):
                arr[self.slot, :, start:start + n] = arr[self.slot][:, src]
            self.positions[start:start + n] = self.positions[src]
        self.length = start + n


@dataclass
class _Rows:
    """One request's part of a call, padded to the call's row count."""
    cache: LlamaKVCache
    t: int
    ids: np.ndarray
    positions: np.ndarray
    tree_mask: np.ndarray | None
    past_visible: np.ndarray | None


def graph_metadata(session: ort.InferenceSession, path) -> tuple[LlamaConfig, str, tuple[int, ...]]:
    """The graph's config, cache dtype and tap layers; refuses graphs of another format."""
    props = session.get_modelmeta().custom_metadata_map
    if props.get("dspark_llm_format") != GRAPH_FORMAT:
        raise ConfigError("dspark_llm_format", f"found {props.get('dspark_llm_format')!r}, this dspark "
                          f"needs {GRAPH_FORMAT!r}: re-import the GGUF (make setup, or dspark llm import)",
                          path)
    if props.get("dspark_llm_attention") != "gqa":
        raise ConfigError("dspark_llm_attention", f"found {props.get('dspark_llm_attention')!r}: the "
                          "runtime serves graphs with GroupQueryAttention only", path)
    return (LlamaConfig.from_json(props["dspark_llm_config"]), props["dspark_llm_cache_dtype"],
            tuple(json.loads(props["dspark_llm_tap_layers"])))


class OnnxLlama(TargetRuntime):
    """The target runtime on ONNX Runtime (see module docstring).

    ``max_context`` bounds a cache (``config.ctx`` reports it); ``max_batch`` is the number of
    pooled caches that can share one call (further caches get a pool of their own).
    """

    def __init__(self, path: str | Path, threads: int = 2, max_context: int = DEFAULT_MAX_CONTEXT,
                 max_batch: int = DEFAULT_MAX_BATCH, spinning: bool = False):
        options = make_session_options(intra_op_threads=threads, inter_op_threads=1,
                                       allow_spinning=spinning)
        try:
            self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # ORT raises its own Fail/InvalidGraph/NoSuchFile types
            raise ConfigError("model", f"ONNX Runtime cannot load the graph ({exc})", path) from None
        cfg, cache_dtype, self.tap_layers = graph_metadata(self.session, path)
        self._max_position = cfg.ctx  # the graph's RoPE tables end there
        self.config = replace(cfg, ctx=min(cfg.ctx, max_context))
        self.cache_dtype = np.dtype(cache_dtype)
        self.max_batch = max_batch
        self._pool = self._new_pool(max_batch)
        self._lock = threading.Lock()

    def _new_pool(self, slots: int, capacity: int | None = None) -> _CachePool:
        return _CachePool(self.config, slots, (capacity or self.config.ctx) + MIN_ROWS, self.cache_dtype)

    def new_cache(self, capacity: int | None = None) -> LlamaKVCache:
        capacity = capacity or self.config.ctx
        if capacity > self.config.ctx:
            raise ValueError(f"cache capacity {capacity} > max_context {self.config.ctx}")
        slot = self._pool.take()
        if slot is None:  # all pooled slots busy: a pool of its own (runs alone)
            pool = self._new_pool(1, capacity)
            return LlamaKVCache(pool, pool.take(), capacity)
        return LlamaKVCache(self._pool, slot, capacity)

    # -- calls ------------------------------------------------------------------------------
    def forward(self, cache: LlamaKVCache, tokens, positions, tree_mask: np.ndarray | None = None,
                past_visible: np.ndarray | None = None, want_taps: bool = False,
                logit_rows: Sequence[int] | None = None):
        """Run T new tokens against ``cache``; return logits ``[T, vocab]`` (only the rows in
        ``logit_rows``, in that order, when given: a prompt needs only its last row).

        ``tree_mask`` (T x T bool, default causal; a tree's nodes come after their parents and
        each sees itself) says which new tokens see which; ``past_visible`` (T x length,
        default all) which cached rows they see. The new rows are appended to the cache.
        With ``want_taps`` the result is ``(logits, taps)``. A chain's rows have the bits plain
        decoding would give them; a tree's rows are exact but not bitwise (docs/llm.md).
        """
        tokens = np.asarray(tokens, np.int64).reshape(-1)
        if len(tokens) == 0:
            empty = np.zeros((0, self.config.vocab), np.float32)
            return (empty, np.zeros((0, len(self.tap_layers) * self.config.hidden), np.float32)) if want_taps else empty
        item = self._rows(cache, tokens, positions, tree_mask, past_visible)
        logits, taps = self._run([item], max(item.t, MIN_ROWS), logit_rows)[0]
        return (logits, taps) if want_taps else logits

    def forward_batch(self, items: Sequence[tuple], want_taps: bool = False) -> list:
        """Several requests' new rows, ``items`` = ``[(cache, tokens, positions, tree_mask), ...]``
        (distinct caches), in as few ORT calls as their pool slots allow (one per run of
        neighbouring slots); results in item order, as ``forward`` returns them."""
        rows = [self._rows(c, np.asarray(tok, np.int64).reshape(-1), pos, mask, None)
                for c, tok, pos, mask in items]
        if len({id(r.cache) for r in rows}) != len(rows):
            raise ValueError("forward_batch needs distinct caches")
        order = sorted(range(len(rows)), key=lambda i: (id(rows[i].cache.pool), rows[i].cache.slot))
        calls: list[list[int]] = []
        for i in order:
            prev = calls[-1][-1] if calls else None
            if prev is not None and rows[prev].cache.pool is rows[i].cache.pool \
                    and rows[prev].cache.slot + 1 == rows[i].cache.slot:
                calls[-1].append(i)
            else:
                calls.append([i])
        results: list = [None] * len(rows)
        for call in calls:
            t = max(MIN_ROWS, *(rows[i].t for i in call))
            # a padded row is written past its cache's length: keep that inside the slot
            if any(rows[i].cache.length + t > rows[i].cache.pool.rows for i in call):
                parts = [[i] for i in call]
            else:
                parts = [call]
            for part in parts:
                rows_in_call = max(MIN_ROWS, *(rows[i].t for i in part))
                for i, result in zip(part, self._run([rows[i] for i in part], rows_in_call, None)):
                    results[i] = result
        return results if want_taps else [logits for logits, _ in results]

    def _rows(self, cache, tokens, positions, tree_mask, past_visible) -> _Rows:
        """Checked arguments of one request (ORT would read a bad id as a zero embedding)."""
        t = len(tokens)
        cache.check_room(t)
        positions = np.asarray(positions, np.int64).reshape(-1)
        if len(positions) != t:
            raise ValueError(f"{t} tokens but {len(positions)} positions")
        if t and (tokens.min() < 0 or tokens.max() >= self.config.vocab):
            raise ValueError(f"token ids must be in [0, {self.config.vocab}), got {tokens.min()}..{tokens.max()}")
        if t and (positions.min() < 0 or positions.max() >= self._max_position):
            raise ValueError(f"positions must be in [0, {self._max_position}), got {positions.min()}..{positions.max()}")
        if tree_mask is not None and np.shape(tree_mask) != (t, t):
            raise ValueError(f"tree_mask must be {t} x {t}, got {np.shape(tree_mask)}")
        if past_visible is not None and np.shape(past_visible) != (t, cache.length):
            raise ValueError(f"past_visible must be {t} x {cache.length}, got {np.shape(past_visible)}")
        return _Rows(cache, t, tokens, positions, tree_mask, past_visible)

    def _run(self, items: list[_Rows], rows: int, logit_rows) -> list[tuple[np.ndarray, np.ndarray]]:
        """One ORT call for ``items`` (caches in neighbouring slots of one pool, in slot order),
        each padded to ``rows`` rows."""
        pool = items[0].cache.pool
        lo, batch = items[0].cache.slot, len(items)
        span = max(it.cache.length for it in items) + rows
        ids = np.zeros((batch, rows), np.int64)
        positions = np.zeros((batch, rows), np.int64)
        bias = np.full((batch, 1, rows, span), -np.inf, np.float32)
        seqlens = np.zeros(batch, np.int32)
        select = []
        for b, it in enumerate(items):
            n, t = it.cache.length, it.t
            ids[b, :t] = it.ids
            positions[b, :t] = it.positions
            positions[b, t:] = it.positions[-1]
            bias[b, 0, :t, :n] = 0.0 if it.past_visible is None else np.where(it.past_visible, 0.0, -np.inf)
            mask = _causal(t) if it.tree_mask is None else np.asarray(it.tree_mask, bool)
            bias[b, 0, :t, n:n + t] = np.where(mask, 0.0, -np.inf)
            bias[b, 0, t:, :n + rows] = 0.0  # padding rows: never read, kept finite
            seqlens[b] = n + rows - 1
            wanted = np.arange(t) if logit_rows is None else np.asarray(logit_rows, np.int64)
            select.append(b * rows + wanted)
        with self._lock:
            io = pool.binding(self.session, lo, lo + batch)
            io.bind_cpu_input("input_ids", ids)
            io.bind_cpu_input("position_ids", positions)
            io.bind_cpu_input("attention_bias", bias)
            io.bind_cpu_input("seqlens_k", seqlens)
            io.bind_cpu_input("query_seqlens", np.full(batch, rows, np.int32))
            io.bind_cpu_input("logit_rows", np.concatenate(select))
            io.bind_output("logits")
            io.bind_output("taps")
            self.session.run_with_iobinding(io)
            outputs = io.get_outputs()
            logits, taps = outputs[len(outputs) - 2].numpy(), outputs[len(outputs) - 1].numpy()
        results, start = [], 0
        for b, (it, wanted) in enumerate(zip(items, select)):
            it.cache.positions[it.cache.length:it.cache.length + it.t] = it.positions
            it.cache.length += it.t
            results.append((logits[start:start + len(wanted)], taps[b * rows:b * rows + it.t]))
            start += len(wanted)
        return results
