"""Build the ONNX graph of a llama-architecture decoder from a GGUF file (weights kept 4/8-bit).

One graph runs B requests × T new rows against their KV caches, for prompts, plain decoding and
the verification of a chain or a tree of draft tokens alike:

* inputs ``input_ids``, ``position_ids`` ``[B, T]``; ``attention_bias`` ``[B, 1, T, S]`` (0 where
  a row may see a key, -inf elsewhere; S = ``total_sequence_length``, the longest past + T);
  ``seqlens_k`` ``[B]`` (each request's past + T - 1); ``query_seqlens`` ``[B]`` (T for every
  request: without it ORT's CPU attention refuses B > 1 with T > 1); ``logit_rows`` ``[R]``
  (which of the B*T rows get logits: a prompt needs only its last);
* per layer ``past_key_i`` / ``past_value_i`` ``[B, kv_heads, capacity, head_dim]``: the cache
  itself. ``present_*`` outputs are bound to the same buffers (ORT's GroupQueryAttention then
  writes the T new rows in place at ``seqlens_k + 1 - T``), so no cache is copied per call;
* outputs ``logits`` ``[R, vocab]`` and ``taps`` ``[B*T, len(tap_layers) * hidden]``: the
  residual stream after each tapped block (TAP_LAYERS; see
  :func:`default_tap_layers` for shallower models), for the DSpark drafter.

Per block: RMSNorm (fused with the residual add: ``SkipSimplifiedLayerNormalization``), the
fused Q/K/V projection, ``GroupQueryAttention`` (packed QKV, rotary with explicit positions and
llama.cpp's "norm" pairing of neighbouring dimensions = ORT's ``rotary_interleaved``, the tree
mask as attention bias), output projection, RMSNorm, fused gate/up projection, SiLU·up, down
projection; the head is the (tied) embedding matrix. Matrices in Q4_0/Q4_1/Q8_0 become
``MatMulNBits`` (see :mod:`dspark.llm.quant`), float ones a MatMul.

Greedy speculation must equal plain decoding: the runtime pads every call to at least
``MIN_ROWS`` rows; then a row's bits depend neither on how many rows share the call nor on the
other requests of a batch (MatMulNBits quantizes activations and accumulates per row; attention's
softmax runs over the row's own causal length). ``tests/unit/test_llm_runtime.py`` checks chains
and batches bit for bit; tree rows are exact but not bitwise (docs/llm.md).
"""
from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dspark.llm.gguf_model import GGUFModel, LlamaConfig
from dspark.llm.quant import NBITS_TYPES, QK, NBitsWeight, concat_rows, to_nbits
from dspark.llm.taps import TAP_LAYERS

GRAPH_FORMAT = "llama-3"  # bumped when inputs, outputs or weight layout change
OPSET = 21
MS_DOMAIN = "com.microsoft"
CACHE_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


class _Graph:
    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._names: set[str] = set()
        self._n = 0

    def const(self, name: str, value) -> str:
        """An initializer (made once: a second call with the same name reuses the first)."""
        if name not in self._names:
            self._names.add(name)
            self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, *inputs: str, n_out: int = 1, outputs=None, domain: str = "", **attrs):
        """Append a node; its output name (a list when it has several)."""
        self._n += 1
        outs = outputs or [f"{op_type.lower()}_{self._n}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, domain=domain or None, **attrs))
        return outs[0] if len(outs) == 1 else outs


def rope_tables(cfg: LlamaConfig, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin ``[positions, head_dim / 2]`` computed as llama.cpp does (float32 angle, each
    frequency the previous one times ``base ** (-2 / dim)``), so rotations match its bits."""
    step = np.float32(cfg.rope_base) ** np.float32(-2.0 / cfg.head_dim)
    freqs = np.empty(cfg.head_dim // 2, np.float32)
    freqs[0] = 1.0
    for i in range(1, len(freqs)):
        freqs[i] = freqs[i - 1] * step
    theta = np.arange(positions, dtype=np.float32)[:, None] * freqs[None, :]
    return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)


class _Weights:
    """Per-matrix choice: MatMulNBits (quantized types) or a float MatMul."""

    def __init__(self, model: GGUFModel, g: _Graph, accuracy_level: int):
        self.model, self.g, self.accuracy_level = model, g, accuracy_level
        self._blocksum = {}

    def nbits(self, name: str) -> NBitsWeight | None:
        kind = self.model.tensor_type(name)
        if kind not in NBITS_TYPES:
            return None
        return to_nbits(self.model.raw(name), kind, *self.model.shape(name))

    def linear(self, x: str, names: list[str], label: str) -> str:
        """``x @ W.T`` for the rows of the named matrices stacked (one node for Q/K/V)."""
        parts = [self.nbits(n) for n in names]
        if any(p is None for p in parts) or len({p.bits for p in parts}) > 1:
            w = np.concatenate([self.model.dequantized(n) for n in names])
            return self.g.op("MatMul", x, self.g.const(label + ".w", np.ascontiguousarray(w.T)))
        w = concat_rows(parts)
        y = self.g.op("MatMulNBits", x, self.g.const(label + ".q", w.packed),
                      self.g.const(label + ".s", w.scales), domain=MS_DOMAIN, K=w.k, N=w.n,
                      bits=w.bits, block_size=QK, accuracy_level=self.accuracy_level)
        if w.offsets is None:
            return y
        # Q4_1's per-block offsets: y += blocksums(x) @ offsets.T (exact; quant.py)
        sums = self._blocksum.get(x)
        if sums is None:
            sums = self._blocksum[x] = self.g.op("MatMul", x, self._block_indicator(w.k))
        return self.g.op("Gemm", sums, self.g.const(label + ".m", np.ascontiguousarray(w.offsets.T)), y)

    def _block_indicator(self, k: int) -> str:
        """``[k, k / 32]`` of 0/1: ``x @ it`` sums x over each block of 32 inputs."""
        return self.g.const(f"block_indicator_{k}",
                            np.kron(np.eye(k // QK, dtype=np.float32), np.ones((QK, 1), np.float32)))

    def embedding(self, ids: str) -> str:
        name = "token_embd.weight"
        w = self.nbits(name)
        if w is not None and w.offsets is None:  # GatherBlockQuantized: Q8_0, Q4_0 (default zero points)
            return self.g.op("GatherBlockQuantized", self.g.const("embed.q", w.packed.reshape(w.n, -1)),
                             ids, self.g.const("embed.s", w.scales.reshape(w.n, -1)),
                             domain=MS_DOMAIN, bits=w.bits, block_size=QK, gather_axis=0, quantize_axis=1)
        if self.model.tensor_type(name) != "F16":
            return self.g.op("Gather", self.g.const("embed.f32", self.model.dequantized(name)), ids, axis=0)
        table = self.model.dequantized(name).astype(np.float16)  # exact: it was stored as F16
        return self.g.op("Cast", self.g.op("Gather", self.g.const("embed.f16", table), ids, axis=0),
                         to=TensorProto.FLOAT)


def default_tap_layers(n_layer: int) -> tuple[int, ...]:
    """TAP_LAYERS (chosen for SmolLM2's 30 blocks) where they fit; for a shallower model the
    blocks at the same fractions of its depth."""
    if max(TAP_LAYERS) < n_layer:
        return TAP_LAYERS
    return tuple(sorted({max(0, round((t + 1) * n_layer / 30) - 1) for t in TAP_LAYERS}))


def _attention_ops(g: _Graph, cfg: LlamaConfig, i: int, qkv: str) -> str:
    """Attention from plain ops, measured against GroupQueryAttention (docs/llm.md) and not used
    by the runtime: ``past_*`` ``[B, kv_heads, P, head_dim]`` in, ``present_*`` = past + the T new
    rows out, as HF exports do (the whole cache is copied every call)."""
    h, kvh, dh, group = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.group
    def c(name: str, values: list[int]) -> str:
        return g.const(name, np.array(values, np.int64))

    q, k, v = g.op("Split", qkv, c("ops.split", [h * dh, kvh * dh, kvh * dh]), axis=-1, n_out=3)
    rope = dict(domain=MS_DOMAIN, interleaved=1)
    q = g.op("RotaryEmbedding", q, "position_ids", "rope.cos", "rope.sin", **rope)
    k = g.op("RotaryEmbedding", k, "position_ids", "rope.cos", "rope.sin", **rope)
    q = g.op("Transpose", g.op("Reshape", q, c("ops.q5", [0, 0, kvh, group, dh])), perm=[0, 2, 3, 1, 4])
    q = g.op("Reshape", q, c("ops.q4", [0, kvh, -1, dh]))  # [B, kvh, group*T, dh]
    k_all, v_all = (g.op("Concat", f"past_{kind}_{i}", g.op("Transpose", g.op("Reshape", new, c("ops.kv4", [0, 0, kvh, dh])),
                                                          perm=[0, 2, 1, 3]),
                         axis=2, outputs=[f"present_{kind}_{i}"]) for kind, new in (("key", k), ("value", v)))
    scores = g.op("FusedMatMul", q, k_all, domain=MS_DOMAIN, transB=1, alpha=float(1 / np.sqrt(dh)))
    shape5 = g.op("Concat", g.op("Shape", "input_ids", end=1), c("ops.s5", [kvh, group, -1]),
                  g.op("Shape", "attention_bias", start=3), axis=0)
    scores = g.op("Reshape", scores, shape5)  # [B, kvh, group, T, S]
    scores = g.op("Add", scores, g.op("Unsqueeze", "attention_bias", c("ops.ax1", [1])))
    out = g.op("MatMul", g.op("Softmax", scores, axis=-1), g.op("Unsqueeze", v_all, c("ops.ax2", [2])))
    return g.op("Transpose", out, perm=[0, 3, 1, 2, 4])  # [B, T, kvh, group, dh]


ONNX_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")


def onnx_unsupported(model: GGUFModel) -> str | None:
    """Why the graph cannot be built for ``model`` (None: it can): it covers plain llama with the
    weight types of :mod:`dspark.llm.quant`."""
    cfg = model.config
    if cfg.architecture != "llama" or model.has("rope_freqs.weight") or cfg.hidden != cfg.n_head * cfg.head_dim:
        return f"the graph is built for plain llama models, this is {cfg.architecture}"
    types = sorted({t for kinds in cfg.weight_types.values() for t in kinds.split("/")} - set(ONNX_TYPES))
    return f"weight type {types[0]} has no ONNX form here" if types else None


def build_llama_onnx(model: GGUFModel, cache_dtype: str = "float32", accuracy_level: int = 4,
                     max_positions: int | None = None, attention: str = "gqa") -> onnx.ModelProto:
    """The decoder graph of ``model`` (see module docstring). ``max_positions`` bounds the RoPE
    tables (default: the model's context length); ``attention="ops"`` builds the plain-ops
    variant that only the benchmark runs (:func:`_attention_ops`)."""
    cfg = model.config
    reason = onnx_unsupported(model)
    if reason:
        from dspark.errors import ConfigError

        raise ConfigError("llm_runtime", f"no ONNX graph: {reason}; serve it on the kernels (llm_runtime: kernel, "
                          "the default)", model.path)
    tap_layers = default_tap_layers(cfg.n_layer)
    g = _Graph()
    w = _Weights(model, g, accuracy_level)
    d, kvh, dh = cfg.hidden, cfg.n_kv_head, cfg.head_dim
    cache_type = CACHE_TYPES[cache_dtype]
    cos, sin = rope_tables(cfg, max_positions or cfg.ctx)
    g.const("rope.cos", cos)
    g.const("rope.sin", sin)
    rows_2d = g.const("shape_rows", np.array([-1, d], np.int64))
    shape_btx = g.op("Concat", g.op("Shape", "input_ids"), g.const("minus_one", np.array([-1], np.int64)), axis=0)
    total = g.op("Cast", g.op("Shape", "attention_bias", start=3, end=4), to=TensorProto.INT32)
    total = g.op("Squeeze", total)

    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["B", "T"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["B", "T"]),
        helper.make_tensor_value_info("attention_bias", TensorProto.FLOAT, ["B", 1, "T", "S"]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
        helper.make_tensor_value_info("query_seqlens", TensorProto.INT32, ["B"]),
        helper.make_tensor_value_info("logit_rows", TensorProto.INT64, ["R"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["R", cfg.vocab]),
               helper.make_tensor_value_info("taps", TensorProto.FLOAT, ["BT", len(tap_layers) * d])]

    x = g.op("Reshape", w.embedding("input_ids"), rows_2d)  # the residual stream, [B*T, d]
    taps: dict[int, str] = {}
    block_out = None  # the last block's MLP output, not yet added to x
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        inputs += [helper.make_tensor_value_info(f"past_key_{i}", cache_type, ["B", kvh, "C", dh]),
                   helper.make_tensor_value_info(f"past_value_{i}", cache_type, ["B", kvh, "C", dh])]
        outputs += [helper.make_tensor_value_info(f"present_key_{i}", cache_type, ["B", kvh, "C", dh]),
                    helper.make_tensor_value_info(f"present_value_{i}", cache_type, ["B", kvh, "C", dh])]
        norm1 = g.const(p + "attn_norm", model.dequantized(p + "attn_norm.weight"))
        norm2 = g.const(p + "ffn_norm", model.dequantized(p + "ffn_norm.weight"))
        if block_out is None:
            h = g.op("SimplifiedLayerNormalization", x, norm1, axis=-1, epsilon=cfg.rms_eps)
        else:
            h, _, _, x = g.op("SkipSimplifiedLayerNormalization", block_out, x, norm1, n_out=4,
                              domain=MS_DOMAIN, epsilon=cfg.rms_eps)
            if i - 1 in tap_layers:
                taps[i - 1] = x
        qkv = w.linear(h, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], p + "qkv")
        if attention == "gqa":
            attn, _, _ = g.op(
                "GroupQueryAttention", g.op("Reshape", qkv, shape_btx), "", "",
                f"past_key_{i}", f"past_value_{i}", "seqlens_k", total, "rope.cos", "rope.sin",
                "position_ids", "attention_bias", "", "", "", "", "", "query_seqlens",
                outputs=[f"attn_{i}", f"present_key_{i}", f"present_value_{i}"], domain=MS_DOMAIN,
                num_heads=cfg.n_head, kv_num_heads=kvh, do_rotary=1, rotary_interleaved=1)
        else:
            attn = _attention_ops(g, cfg, i, g.op("Reshape", qkv, shape_btx))
        attn = w.linear(g.op("Reshape", attn, rows_2d), [p + "attn_output.weight"], p + "attn_output")
        h, _, _, x = g.op("SkipSimplifiedLayerNormalization", attn, x, norm2, n_out=4,
                          domain=MS_DOMAIN, epsilon=cfg.rms_eps)
        gate_up = w.linear(h, [p + "ffn_gate.weight", p + "ffn_up.weight"], p + "ffn_gate_up")
        gate, up = g.op("Split", gate_up, g.const(p + "split", np.array([cfg.ffn, cfg.ffn], np.int64)),
                        axis=-1, n_out=2)
        act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)
        block_out = w.linear(act, [p + "ffn_down.weight"], p + "ffn_down")

    last = g.op("Add", x, block_out)  # the last block's output (a tap when it is tapped)
    if cfg.n_layer - 1 in tap_layers:
        taps[cfg.n_layer - 1] = last
    g.op("Concat", *[taps[t] for t in tap_layers], axis=-1, outputs=["taps"])
    final = g.op("SimplifiedLayerNormalization", g.op("Gather", last, "logit_rows", axis=0),
                 g.const("output_norm", model.dequantized("output_norm.weight")), axis=-1, epsilon=cfg.rms_eps)
    head = "output.weight" if not cfg.tied_embeddings else "token_embd.weight"
    logits = w.linear(final, [head], "head")
    g.nodes.append(helper.make_node("Identity", [logits], ["logits"]))

    graph = helper.make_graph(g.nodes, "llama_decoder", inputs, outputs, g.inits)
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                         helper.make_opsetid(MS_DOMAIN, 1)],
                                   producer_name="dspark")
    onnx_model.ir_version = 10
    helper.set_model_props(onnx_model, {"dspark_llm_config": cfg.to_json(),
                                        "dspark_llm_format": GRAPH_FORMAT,
                                        "dspark_llm_cache_dtype": cache_dtype,
                                        "dspark_llm_tap_layers": json.dumps(tap_layers),
                                        "dspark_llm_attention": attention,
                                        "dspark_llm_source": model.path.name})
    return onnx_model
