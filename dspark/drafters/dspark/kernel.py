"""DSpark's block pass on dspark's own C kernels (cython_ext/llama/llama_*.c, the target's runtime).

The drafter's backbone is a stack of llama blocks whose context keys and values come from the
target's taps instead of earlier layers, and whose block slots attend to the whole context and
to each other. That is one llama decoder step: the context rows' keys and values sit in a
KV cache (written by ``write_context``), the k slots are the step's new rows with an all-true
mask, their inputs are given as hidden states (``LlamaModel.forward(inputs=...)``), and the head
is the target's embedding restricted to the draft vocabulary. Weights are 8-bit blocks (Q8_0).

Why: ONNX Runtime's block of 8 slots cost about a target row (2 threads; Zen 5: 1.8-2.8 ms
against 2.7); on these kernels it takes 0.8-1.5 ms (docs/dspark.md). The slots' rows are cache
rows past the context length; the pass never moves the length, so the next draft overwrites them.
"""
from __future__ import annotations

import numpy as np

from dspark._ext import llama as _llama
from dspark.llm.kernel_runtime import KernelCache, pack_float


class KernelDrafterPasses:
    """The drafter's layers and head on the llama kernels; ``threads`` run each pass."""

    def __init__(self, cfg, weights: dict[str, np.ndarray], head: "_llama.PackedMatrix", vocab: int,
                 threads: int = 2):
        """``head``: the draft vocabulary's ``vocab`` embedding rows (padded to whole tiles)."""
        self.cfg = cfg
        self.vocab = vocab
        packed = {"embed": head, "head": head, "out_norm": weights["out_norm"]}
        names = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
                 "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}
        for i in range(cfg.n_layer):
            src, dst = f"layers.{i}.", f"blk.{i}."
            packed[dst + "attn_norm"] = weights[src + "attn_norm"]
            packed[dst + "ffn_norm"] = weights[src + "ffn_norm"]
            for ours, theirs in names.items():
                packed[dst + theirs] = pack_float(weights[src + ours])
        config = {"n_layer": cfg.n_layer, "hidden": cfg.hidden, "ffn": cfg.ffn,
                  "n_head": cfg.n_head, "n_kv": cfg.n_kv_head, "head_dim": cfg.head_dim,
                  "vocab": vocab, "rms_eps": cfg.rms_eps, "rope_base": cfg.rope_base}
        self.model = _llama.LlamaModel(config, packed, threads)
        # the context's projections: taps -> feature; feature -> each layer's keys and values
        # and the block's last-row term, in one product
        self.fc = pack_float(weights["fc"])
        self.context_out = pack_float(np.concatenate(
            [weights[f"layers.{i}.{name}"] for i in range(cfg.n_layer) for name in ("wk", "wv")]
            + [weights["last_proj"]]))
        # the Markov head's W2 as rows of the draft vocabulary, its rank padded to whole blocks
        w2 = weights["markov_w2"].T
        self.markov_w2 = pack_float(np.pad(w2, ((0, 0), (0, -w2.shape[1] % 32))))

    def project(self, x: np.ndarray, matrix: "_llama.PackedMatrix") -> np.ndarray:
        """x [n, matrix inputs] @ matrix.T on the kernels (int8 activations)."""
        out = np.empty((x.shape[0], matrix.n), np.float32)
        self.model.project(np.ascontiguousarray(x, np.float32), out, matrix, False)
        return out

    def markov(self, w1_row: np.ndarray) -> np.ndarray:
        """W1[prev] @ W2 over the draft vocabulary (8-bit W2: a quarter of the float32 bytes)."""
        x = np.zeros((1, self.markov_w2.k), np.float32)
        x[0, :w1_row.shape[0]] = w1_row
        return self.project(x, self.markov_w2)[0, :self.vocab]

    def new_cache(self, capacity: int) -> KernelCache:
        """Room for ``capacity`` context rows and one block after them."""
        return KernelCache.empty(self.model, capacity + self.cfg.block)

    @staticmethod
    def write_context(cache: KernelCache, start: int, keys: list[np.ndarray],
                      values: list[np.ndarray]) -> None:
        """Context rows start.. of every layer: keys (RoPE applied) and values [n, n_kv, hd]."""
        slots = np.arange(start, start + len(keys[0]))
        for layer, (k, v) in enumerate(zip(keys, values)):
            cache.keys[layer][:, slots // 16, :, slots % 16] = k.astype(np.float16).view(np.uint16)
            cache.values[layer][:, slots] = v.transpose(1, 0, 2).astype(np.float16).view(np.uint16)

    def run_block(self, x: np.ndarray, cache: KernelCache, length: int) -> tuple[np.ndarray, np.ndarray]:
        """The block's last-layer residual stream [k, H] (before the final norm) and head logits
        [k, V] for slot inputs x [k, H] after ``length`` context rows."""
        k = x.shape[0]
        logits = np.empty((k, self.model.head_columns), np.float32)
        last = np.empty((k, self.cfg.hidden), np.float32)
        segment = (cache.keys, cache.values, length, np.zeros(k, np.int64),
                   np.arange(length, length + k), np.ones((k, length + k), bool))
        self.model.forward([segment], np.arange(k), logits, last, (self.cfg.n_layer - 1,), None,
                           np.ascontiguousarray(x, np.float32))
        return last, logits[:, :self.vocab]
