"""A plain numpy forward pass of a llama GGUF, for checking the fast runtimes (not for serving).

float64 arithmetic on gguf's own dequantization, one sequence from position 0, no cache; each
block's weights are dequantized when reached and dropped after, so memory stays small.
"""
from __future__ import annotations

import numpy as np

from dspark.llm.gguf_model import GGUFModel
from dspark.llm.onnx_graph import default_tap_layers, rope_tables


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate neighbouring pairs (2i, 2i+1) (llama.cpp's "norm" RoPE); x ``[T, heads, dim]``."""
    out = np.empty_like(x)
    even, odd = x[..., 0::2], x[..., 1::2]
    out[..., 0::2] = even * cos[:, None] - odd * sin[:, None]
    out[..., 1::2] = even * sin[:, None] + odd * cos[:, None]
    return out


def reference_forward(model: GGUFModel, tokens) -> tuple[np.ndarray, np.ndarray]:
    """(logits ``[T, vocab]``, taps ``[T, len(tap_layers) * hidden]``) for ``tokens`` at
    positions 0..T-1, causal attention."""
    cfg = model.config
    tap_layers = default_tap_layers(cfg.n_layer)
    tokens = np.asarray(tokens, np.int64)
    t, dh, group = len(tokens), cfg.head_dim, cfg.group
    cos, sin = (a.astype(np.float64) for a in rope_tables(cfg, t))
    w = model.dequantized
    x = w("token_embd.weight")[tokens].astype(np.float64)
    causal = np.tri(t, dtype=bool)
    taps = []
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        h = _rms_norm(x, w(p + "attn_norm.weight"), cfg.rms_eps)
        q = _rope((h @ w(p + "attn_q.weight").T).reshape(t, cfg.n_head, dh), cos, sin)
        k = _rope((h @ w(p + "attn_k.weight").T).reshape(t, cfg.n_kv_head, dh), cos, sin)
        v = (h @ w(p + "attn_v.weight").T).reshape(t, cfg.n_kv_head, dh)
        att = np.empty((t, cfg.n_head, dh))
        for head in range(cfg.n_head):
            scores = q[:, head] @ k[:, head // group].T / np.sqrt(dh)
            scores = np.where(causal, scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            att[:, head] = (probs / probs.sum(-1, keepdims=True)) @ v[:, head // group]
        x = x + att.reshape(t, -1) @ w(p + "attn_output.weight").T
        h = _rms_norm(x, w(p + "ffn_norm.weight"), cfg.rms_eps)
        gate, up = h @ w(p + "ffn_gate.weight").T, h @ w(p + "ffn_up.weight").T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w(p + "ffn_down.weight").T
        if i in tap_layers:
            taps.append(x)
    head = w("token_embd.weight" if cfg.tied_embeddings else "output.weight")
    logits = _rms_norm(x, w("output_norm.weight"), cfg.rms_eps) @ head.T
    return logits.astype(np.float32), np.concatenate(taps, axis=-1).astype(np.float32)
