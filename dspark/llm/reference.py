"""A plain numpy forward pass of a GGUF of the llama family, for checking the fast runtimes (not
for serving).

float64 arithmetic on gguf's own dequantization, one sequence from position 0, no cache. Every
architecture switch of :class:`dspark.llm.gguf_model.Architecture` is written out here the way
the model's paper and llama.cpp state it, independently of the C forward pass. With
``kernel_rounding`` it also rounds where dspark's kernels round (int8 activations per block of 32,
fp16 keys and values, float and re-quantized matrices as their Q8_0 blocks), so what is left
between the two is float32 arithmetic.
"""
from __future__ import annotations

import numpy as np

from dspark.llm.gguf_model import FLOAT_TYPES, GGUFModel


def int8_blocks(x: np.ndarray) -> np.ndarray:
    """x through the kernels' activation quantization (int8 per block of 32, float32 scale)."""
    blocks = x.astype(np.float32).reshape(len(x), -1, 32)
    d = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    return (np.rint(blocks * inv) * d).reshape(len(x), -1).astype(np.float64)


def kernel_matrix(model: GGUFModel, name: str) -> np.ndarray:
    """A GGUF matrix as the kernels multiply it (dspark.llm.kernel_runtime.pack_matrix), float64."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    value = model.dequantized(name)
    kind = model.tensor_type(name)
    if kind in FLOAT_TYPES:  # the kernels quantize these to Q8_0 blocks
        q8 = GGMLQuantizationType.Q8_0
        value = dequantize(quantize(value, q8), q8).reshape(value.shape)
    return value.astype(np.float64)


def reference_logits(model: GGUFModel, tokens, kernel_rounding: bool = False,
                     tap_layers=()) -> tuple[np.ndarray, list[np.ndarray]]:
    """(logits ``[T, vocab]`` float64, residual stream after each layer of ``tap_layers``) for
    ``tokens`` at positions 0..T-1, causal attention."""
    cfg, arch = model.config, model.config.arch
    cache: dict[str, np.ndarray] = {}

    def w(name: str) -> np.ndarray:
        if name not in cache:
            matrix = kernel_rounding and len(model.shape(name)) == 2
            value = kernel_matrix(model, name) if matrix else model.dequantized(name).astype(np.float64)
            cache.clear()  # one block's weights at a time: memory stays small
            cache[name] = value
        return cache[name]

    act = int8_blocks if kernel_rounding else (lambda x: x)
    kv = (lambda x: x.astype(np.float16).astype(np.float64)) if kernel_rounding else (lambda x: x)
    tokens = np.asarray(tokens, np.int64)
    t, hd, group = len(tokens), cfg.head_dim, cfg.group
    factors = model.dequantized("rope_freqs.weight").astype(np.float64) if model.has("rope_freqs.weight") else 1.0

    def rope_table(base: float):
        theta = np.arange(t)[:, None] * base ** (-np.arange(0, hd, 2) / hd) / factors
        return np.cos(theta)[:, None], np.sin(theta)[:, None]

    tables = {cfg.rope_base: rope_table(cfg.rope_base)}
    if arch.local_rope_base:
        tables[arch.local_rope_base] = rope_table(arch.local_rope_base)

    def rope(x, base):
        cos, sin = tables[base]
        half = hd // 2
        a, b = (x[..., :half], x[..., half:]) if arch.rope_neox else (x[..., 0::2], x[..., 1::2])
        out = np.empty_like(x)
        if arch.rope_neox:
            out[..., :half], out[..., half:] = a * cos - b * sin, a * sin + b * cos
        else:
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out

    def norm(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_eps) * weight

    def gelu_tanh(x):
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))

    x = w("token_embd.weight")[tokens] * cfg.embed_scale
    taps = []
    pos = np.arange(t)
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        window = cfg.layer_window(i)
        base = arch.local_rope_base if window else cfg.rope_base
        h = act(norm(x, w(p + "attn_norm.weight")))
        q = h @ w(p + "attn_q.weight").T
        k = h @ w(p + "attn_k.weight").T
        v = h @ w(p + "attn_v.weight").T
        if arch.qkv_bias:
            q, k, v = (y + w(p + f"attn_{n}.bias") for y, n in ((q, "q"), (k, "k"), (v, "v")))
        q, k, v = q.reshape(t, cfg.n_head, hd), k.reshape(t, cfg.n_kv_head, hd), v.reshape(t, cfg.n_kv_head, hd)
        if arch.qk_norm:
            q, k = norm(q, w(p + "attn_q_norm.weight")), norm(k, w(p + "attn_k_norm.weight"))
        q, k, v = rope(q, base), kv(rope(k, base)), kv(v)
        k, v = np.repeat(k, group, 1), np.repeat(v, group, 1)
        visible = pos[None, :] <= pos[:, None]
        if window:
            visible &= pos[:, None] - pos[None, :] < window
        s = np.where(visible, np.einsum("thd,shd->hts", q, k) / np.sqrt(hd), -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        att = np.einsum("hts,shd->thd", e / e.sum(-1, keepdims=True), v).reshape(t, -1)
        out = act(att) @ w(p + "attn_output.weight").T
        x = x + (norm(out, w(p + "post_attention_norm.weight")) if arch.post_norms else out)
        h = act(norm(x, w(p + "ffn_norm.weight")))
        gate, up = h @ w(p + "ffn_gate.weight").T, h @ w(p + "ffn_up.weight").T
        gated = gelu_tanh(gate) * up if arch.ffn_gelu else gate / (1 + np.exp(-gate)) * up
        out = act(gated) @ w(p + "ffn_down.weight").T
        x = x + (norm(out, w(p + "post_ffw_norm.weight")) if arch.post_norms else out)
        if i in tap_layers:
            taps.append(x)
    head = w("token_embd.weight" if cfg.tied_embeddings else "output.weight")
    return act(norm(x, w("output_norm.weight"))) @ head.T, taps


def reference_forward(model: GGUFModel, tokens) -> tuple[np.ndarray, np.ndarray]:
    """(logits ``[T, vocab]``, taps ``[T, len(tap_layers) * hidden]``) float32, exact float64
    arithmetic, the drafter's tap layers (dspark.llm.taps.default_tap_layers)."""
    from dspark.llm.taps import default_tap_layers

    logits, taps = reference_logits(model, tokens, tap_layers=default_tap_layers(model.config.n_layer))
    return logits.astype(np.float32), np.concatenate(taps, axis=-1).astype(np.float32)
