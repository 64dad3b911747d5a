"""An ONNX Runtime session of a speculative LM plus its preallocated per-request KV cache."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from dspark.runtimes.toy_lm.graph import GRAPH_FORMAT, LMConfig
from dspark.runtimes.onnx_session import make_session_options
from dspark.runtimes.protocol import CacheRows, TargetRuntime

PAD_MULTIPLE = 16  # keys per call padded to this (see onnx_lm's note on bitwise equality)
MIN_ROWS = 2
KERNEL_MAX_ROWS = 16  # KernelLM hands longer inputs (prompts) to ORT, whose GEMMs do them faster


@dataclass
class KVCache(CacheRows):
    """Per-request cache: ``length`` rows are valid; rollback is setting a shorter length.

    Rows beyond ``length`` may hold stale data; they are always masked out.
    """
    keys: list[np.ndarray]
    values: list[np.ndarray]
    positions: np.ndarray
    length: int = 0
    capacity: int = 0

    @classmethod
    def allocate(cls, cfg: LMConfig, capacity: int) -> "KVCache":
        slots = capacity + 2 * PAD_MULTIPLE
        keys = [np.zeros((1, slots, cfg.n_head, cfg.head_dim), np.float32) for _ in range(cfg.n_layer)]
        values = [np.zeros((1, slots, cfg.n_head, cfg.head_dim + 1), np.float32)
                  for _ in range(cfg.n_layer)]
        return cls(keys, values, np.zeros(slots, np.int64), 0, capacity)

    def keep_rows(self, start: int, rows: np.ndarray) -> None:
        """Keep cache slots ``start + rows`` (ascending) as slots ``start, start+1, ...``."""
        n = len(rows)
        if n and not np.array_equal(rows, np.arange(n)):
            src = start + np.asarray(rows)
            for arr in (*self.keys, *self.values):
                arr[:, start:start + n] = arr[:, src]
            self.positions[start:start + n] = self.positions[src]
        self.length = start + n


@lru_cache(maxsize=64)
def _causal(t: int) -> np.ndarray:
    return np.tri(t, dtype=bool)


def _read_model(model: onnx.ModelProto | str | Path) -> tuple[onnx.ModelProto, LMConfig]:
    source = "the model" if isinstance(model, onnx.ModelProto) else str(model)
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model))
    props = {p.key: p.value for p in model.metadata_props}
    if props.get("dspark_lm_format") != GRAPH_FORMAT:
        raise ValueError(f"{source} is an LM graph of format {props.get('dspark_lm_format', '1')}, "
                         f"this dspark needs format {GRAPH_FORMAT}: rebuild it (a test session "
                         "rebuilds tests/spec_toy_repository's graphs)")
    return model, LMConfig.from_json(props["dspark_lm_config"])


class OnnxLM(TargetRuntime):
    """One LM graph from ``onnx_lm.build_lm_onnx`` in an ORT session."""

    # a tree's rows equal the chains through it bit for bit (tests/unit/test_spec_onnx_lm.py)
    exact_trees = True

    def __init__(self, model: onnx.ModelProto | str | Path, threads: int = 1):
        model, self.config = _read_model(model)
        # spinning off: two sessions (draft, target) spinning on 2 cores slow each other ~2x
        options = make_session_options(intra_op_threads=threads, inter_op_threads=1)
        self.session = ort.InferenceSession(model.SerializeToString(), options,
                                            providers=["CPUExecutionProvider"])
        self._outputs = [o.name for o in self.session.get_outputs()]

    def new_cache(self, capacity: int | None = None) -> KVCache:
        return KVCache.allocate(self.config, capacity or self.config.ctx)

    def forward(self, cache: KVCache, tokens, positions, tree_mask: np.ndarray | None = None,
                past_visible: np.ndarray | None = None) -> np.ndarray:
        """Run T new tokens against the cache; return logits ``[T, vocab]``.

        ``tree_mask`` (T x T, default causal) says which new tokens see which; ``past_visible``
        (T x length, default all) which cached rows they see. The new rows are written into
        the cache after its current length.
        """
        tokens = np.asarray(tokens, np.int64)
        positions = np.asarray(positions, np.int64)
        t = len(tokens)
        if t == 0:
            return np.zeros((0, self.config.vocab), np.float32)
        length = cache.length
        cache.check_room(t)
        # ORT's batched MatMul takes another kernel for a single query row, which changes the
        # last bits of the attention; a second, ignored row keeps every call on one kernel.
        rows = max(t, MIN_ROWS)
        past = -(-(length + rows) // PAD_MULTIPLE) * PAD_MULTIPLE - rows  # >= length
        mask = np.zeros((1, rows, past + rows), bool)
        mask[0, :t, :length] = True if past_visible is None else past_visible
        mask[0, :t, past:past + t] = _causal(t) if tree_mask is None else tree_mask
        ids = np.zeros((1, rows), np.int64)
        ids[0, :t] = tokens
        # the new rows' positions go in the slots after the past: scratch, beyond the valid length
        key_positions = cache.positions[:past + rows]
        key_positions[past:past + t] = positions
        key_positions[past + t:] = key_positions[past + t - 1]
        for r in range(t, rows):
            mask[0, r, past + r] = True
        feeds = {"input_ids": ids, "positions": key_positions[None, past:],
                 "key_positions": key_positions[None], "attention_mask": mask}
        for i in range(self.config.n_layer):
            feeds[f"past_key_{i}"] = cache.keys[i][:, :past]
            feeds[f"past_value_{i}"] = cache.values[i][:, :past]
        out = self.session.run(self._outputs, feeds)
        for i in range(self.config.n_layer):
            cache.keys[i][:, length:length + t] = out[1 + 2 * i][:, :t]
            cache.values[i][:, length:length + t] = out[2 + 2 * i][:, :t]
        cache.positions[length:length + t] = positions[:t]
        cache.length = length + t
        return out[0][:t]


    def forward_batch(self, items) -> list[np.ndarray]:
        """Several requests' rows: ``items`` of (cache, tokens, positions, tree_mask). This graph
        has no batch dimension, so it runs them one after another (the target-runtime
        interface; the real-LLM runtimes share one pass)."""
        return [self.forward(cache, tokens, positions, tree_mask) for cache, tokens, positions, tree_mask in items]


class KernelLM(OnnxLM):
    """The same LM file, run by dspark's C forward pass (``cython_ext/toy_lm/lm_forward.c``, OpenBLAS
    for the products) for up to ``KERNEL_MAX_ROWS`` new tokens, by ORT above that (a prompt).
    Meant for the draft: a draft step is a few hundred kFLOP, and ORT's per-node overhead
    (~70 nodes) was most of a draft call. Both write the same cache layout. Logits match the
    ORT graph's to float rounding, not bit for bit, which a draft does not need (the target
    verifies every guess); the target stays on ORT, where greedy equality is built in."""

    def __init__(self, model: onnx.ModelProto | str | Path, threads: int = 1):
        from dspark._ext.lm_step import LMStep

        model, _ = _read_model(model)
        super().__init__(model, threads)
        weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        self._step = LMStep(weights, self.config.n_layer, self.config.n_head, self.config.vocab)

    def forward(self, cache: KVCache, tokens, positions, tree_mask: np.ndarray | None = None,
                past_visible: np.ndarray | None = None) -> np.ndarray:
        t, length = len(tokens), cache.length
        if t == 0 or t > KERNEL_MAX_ROWS:
            return super().forward(cache, tokens, positions, tree_mask, past_visible)
        cache.check_room(t)
        positions = np.ascontiguousarray(positions, np.int64)
        if positions.shape != (t,):  # LMStep checks the rest (token ids, the cache's shapes)
            raise ValueError(f"positions: expected {t} (one per token), got shape {positions.shape}")
        mask = np.empty((t, length + t), bool)
        mask[:, :length] = True if past_visible is None else past_visible
        mask[:, length:] = _causal(t) if tree_mask is None else tree_mask
        cache.positions[length:length + t] = positions
        logits = np.empty((t, self.config.vocab), np.float32)
        self._step.forward(cache.keys, cache.values, np.ascontiguousarray(tokens, np.int64),
                           positions, mask.view(np.uint8), length, cache.positions[:length + t],
                           logits)
        cache.length = length + t
        return logits
