"""The DSpark drafter's two passes as ONNX Runtime graphs with 8-bit weights (MatMulNBits).

A draft pass in numpy float32 reads ~47 MB of weights (two layers, the 8192-row head): about
half of what one target pass reads, so it would cost as much as the rows it saves. Here the
layers are quantized to 8 bits per weight in blocks of 32 (symmetric, one float scale per block)
and the head is the target's own Q8_0 embedding rows, unchanged: ~12 MB per pass, with ORT's
int8 kernels (``accuracy_level`` 4). Which backend drafts is chosen by measurement
(``DSparkDrafter(..., backend=)``); both compute the same maths (dspark_drafter's docstring),
up to the 8-bit rounding, which can change a draft but never an output.

* ``block`` graph: ``x`` [k, H] (anchor embedding, mask embeddings), ``cos``/``sin`` [k, D/2] of
  the block positions, per layer ``ctx_key_i``/``ctx_value_i`` [C, kv_heads, D] (the request's
  context) -> ``hidden`` [k, H] (normed) and ``logits`` [k, V] (head only; the Markov bias is
  added per slot in numpy).
* ``context`` graph: ``taps`` [n, taps*H], ``cos``/``sin`` [n, D/2] -> ``features`` [n, H] and per
  layer ``key_i`` (RoPE applied) and ``value_i`` [n, kv_heads, D]: what ``extend`` appends.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from dspark.runtimes.onnx_session import make_session_options
from dspark.llm.onnx_graph import MS_DOMAIN, OPSET, _Graph
from dspark.llm.quant import QK, NBitsWeight, to_nbits

ACCURACY_LEVEL = 4  # int8 activations: ORT's fastest CPU path for MatMulNBits


def quantize8(w: np.ndarray) -> NBitsWeight:
    """``w`` [n, k] float -> 8-bit blocks of 32 along k, symmetric (zero point 128)."""
    n, k = w.shape
    blocks = np.asarray(w, np.float32).reshape(n, k // QK, QK)
    d = np.abs(blocks).max(-1, keepdims=True) / 127.0
    d[d == 0] = 1.0
    q = np.clip(np.rint(blocks / d), -127, 127).astype(np.int16) + 128
    return NBitsWeight(8, n, k, q.astype(np.uint8), d.reshape(-1).astype(np.float32))


class _OnceGraph(_Graph):
    """Constants by name, each added once (shape constants recur in every layer)."""

    def const(self, name: str, value) -> str:
        if not any(t.name == name for t in self.inits):
            super().const(name, value)
        return name


class _Builder:
    def __init__(self, cfg):
        self.cfg = cfg
        self.g = _OnceGraph()

    def linear(self, x: str, w: NBitsWeight, label: str) -> str:
        return self.g.op("MatMulNBits", x, self.g.const(label + ".q", w.packed),
                         self.g.const(label + ".s", w.scales), domain=MS_DOMAIN, K=w.k, N=w.n,
                         bits=w.bits, block_size=QK, accuracy_level=ACCURACY_LEVEL)

    def rms(self, x: str, w: np.ndarray, label: str) -> str:
        return self.g.op("SimplifiedLayerNormalization", x, self.g.const(label, w.astype(np.float32)),
                         axis=-1, epsilon=self.cfg.rms_eps)

    def rope(self, x: str, heads: int, cos4: str, sin4: str) -> str:
        """[n, heads*D] -> [n, heads, D] with consecutive pairs rotated."""
        g, d = self.g, self.cfg.head_dim
        pairs = g.op("Reshape", x, g.const(f"shape_pairs_{heads}", np.array([0, heads, d // 2, 2], np.int64)))
        x0, x1 = g.op("Split", pairs, g.const("split_pair", np.array([1, 1], np.int64)), axis=3, n_out=2)
        r0 = g.op("Sub", g.op("Mul", x0, cos4), g.op("Mul", x1, sin4))
        r1 = g.op("Add", g.op("Mul", x0, sin4), g.op("Mul", x1, cos4))
        return g.op("Reshape", g.op("Concat", r0, r1, axis=3),
                    g.const(f"shape_heads_{heads}", np.array([0, heads, d], np.int64)))

    def trig_inputs(self) -> tuple[str, str]:
        g = self.g
        shape = g.const("shape_trig", np.array([0, 1, self.cfg.head_dim // 2, 1], np.int64))
        return g.op("Reshape", "cos", shape), g.op("Reshape", "sin", shape)

    def model(self, inputs, outputs) -> onnx.ModelProto:
        graph = helper.make_graph(self.g.nodes, "dspark_drafter", inputs, outputs, self.g.inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(MS_DOMAIN, 1)],
                              producer_name="dspark")
        m.ir_version = 10
        return m


def _kv_weights(layer: dict) -> NBitsWeight:
    return quantize8(np.ascontiguousarray(layer["wkv"].T))


def block_graph(drafter, head: NBitsWeight) -> onnx.ModelProto:
    cfg = drafter.cfg
    b = _Builder(cfg)
    g = b.g
    H, nh, nkv, D = cfg.hidden, cfg.n_head, cfg.n_kv_head, cfg.head_dim
    group = nh // nkv
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("x", f, ["K", H]),
              helper.make_tensor_value_info("cos", f, ["K", D // 2]),
              helper.make_tensor_value_info("sin", f, ["K", D // 2])]
    cos4, sin4 = b.trig_inputs()
    scale = g.const("scale", np.array(1.0 / np.sqrt(D), np.float32))
    x = "x"
    for i, layer in enumerate(drafter.layers):
        ck, cv = f"ctx_key_{i}", f"ctx_value_{i}"
        inputs += [helper.make_tensor_value_info(ck, f, ["C", nkv, D]),
                   helper.make_tensor_value_info(cv, f, ["C", nkv, D])]
        h = b.rms(x, layer["attn_norm"], f"l{i}.attn_norm")
        q = b.rope(b.linear(h, quantize8(np.ascontiguousarray(layer["wq"].T)), f"l{i}.wq"), nh, cos4, sin4)
        kv = b.linear(h, _kv_weights(layer), f"l{i}.wkv")
        k, v = g.op("Split", kv, g.const(f"l{i}.split_kv", np.array([nkv * D, nkv * D], np.int64)),
                    axis=-1, n_out=2)
        k = b.rope(k, nkv, cos4, sin4)
        v = g.op("Reshape", v, g.const("shape_kv", np.array([0, nkv, D], np.int64)))
        keys = g.op("Concat", ck, k, axis=0)       # [C+K, nkv, D]
        values = g.op("Concat", cv, v, axis=0)
        # queries grouped by their KV head: [nkv, group*K, D]
        qg = g.op("Reshape", q, g.const("shape_q_groups", np.array([0, nkv, group, D], np.int64)))
        qg = g.op("Transpose", qg, perm=[1, 2, 0, 3])
        qg = g.op("Reshape", qg, g.const("shape_q_flat", np.array([nkv, -1, D], np.int64)))
        s = g.op("Mul", g.op("MatMul", qg, g.op("Transpose", keys, perm=[1, 2, 0])), scale)
        a = g.op("MatMul", g.op("Softmax", s, axis=-1), g.op("Transpose", values, perm=[1, 0, 2]))
        a = g.op("Reshape", a, g.const("shape_a_groups", np.array([nkv, group, -1, D], np.int64)))
        a = g.op("Reshape", g.op("Transpose", a, perm=[2, 0, 1, 3]),
                 g.const("shape_rows", np.array([-1, nh * D], np.int64)))
        x = g.op("Add", x, b.linear(a, quantize8(np.ascontiguousarray(layer["wo"].T)), f"l{i}.wo"))
        h = b.rms(x, layer["ffn_norm"], f"l{i}.ffn_norm")
        gu = b.linear(h, quantize8(np.ascontiguousarray(layer["w_gate_up"].T)), f"l{i}.gate_up")
        gate, up = g.op("Split", gu, g.const(f"l{i}.split_gu", np.array([cfg.ffn, cfg.ffn], np.int64)),
                        axis=-1, n_out=2)
        act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)
        x = g.op("Add", x, b.linear(act, quantize8(np.ascontiguousarray(layer["w_down"].T)), f"l{i}.down"))
    hidden = b.rms(x, drafter.out_norm, "out_norm")
    g.nodes.append(helper.make_node("Identity", [hidden], ["hidden"]))
    g.nodes.append(helper.make_node("Identity", [b.linear(hidden, head, "head")], ["logits"]))
    outputs = [helper.make_tensor_value_info("hidden", f, ["K", H]),
               helper.make_tensor_value_info("logits", f, ["K", head.n])]
    return b.model(inputs, outputs)


def context_graph(drafter) -> onnx.ModelProto:
    cfg = drafter.cfg
    b = _Builder(cfg)
    g = b.g
    H, nkv, D, n_taps = cfg.hidden, cfg.n_kv_head, cfg.head_dim, len(cfg.taps)
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("taps", f, ["N", n_taps * H]),
              helper.make_tensor_value_info("cos", f, ["N", D // 2]),
              helper.make_tensor_value_info("sin", f, ["N", D // 2])]
    cos4, sin4 = b.trig_inputs()
    z = g.op("Mul", g.op("Sub", "taps", g.const("tap_mean", drafter.tap_mean)),
             g.const("tap_inv_std", (1.0 / drafter.tap_std).astype(np.float32)))
    z = g.op("Clip", z, g.const("clip_lo", np.array(-cfg.tap_clip, np.float32)),
             g.const("clip_hi", np.array(cfg.tap_clip, np.float32)))
    t = g.op("Mul", z, g.const("tap_norm", drafter.tap_norm))
    feats = b.rms(b.linear(t, quantize8(np.ascontiguousarray(drafter.fc_t.T)), "fc"), drafter.ctx_norm,
                  "ctx_norm")
    g.nodes.append(helper.make_node("Identity", [feats], ["features"]))
    outputs = [helper.make_tensor_value_info("features", f, ["N", H])]
    for i, layer in enumerate(drafter.layers):
        kv = b.linear(feats, _kv_weights(layer), f"l{i}.wkv")
        k, v = g.op("Split", kv, g.const(f"l{i}.split_kv", np.array([nkv * D, nkv * D], np.int64)),
                    axis=-1, n_out=2)
        g.nodes.append(helper.make_node("Identity", [b.rope(k, nkv, cos4, sin4)], [f"key_{i}"]))
        g.nodes.append(helper.make_node(
            "Reshape", [v, g.const("shape_kv", np.array([0, nkv, D], np.int64))], [f"value_{i}"]))
        outputs += [helper.make_tensor_value_info(f"key_{i}", f, ["N", nkv, D]),
                    helper.make_tensor_value_info(f"value_{i}", f, ["N", nkv, D])]
    return b.model(inputs, outputs)


class OrtDrafterPasses:
    """ORT sessions of both graphs; ``threads`` intra-op threads each."""

    def __init__(self, drafter, head: NBitsWeight, threads: int = 1):
        options = make_session_options(intra_op_threads=threads, inter_op_threads=1, allow_spinning=False)
        self.block = ort.InferenceSession(block_graph(drafter, head).SerializeToString(), options,
                                          providers=["CPUExecutionProvider"])
        self.context = ort.InferenceSession(context_graph(drafter).SerializeToString(), options,
                                            providers=["CPUExecutionProvider"])
        self.n_layer = drafter.cfg.n_layer

    def run_block(self, x, cos, sin, keys, values):
        feeds = {"x": x, "cos": cos, "sin": sin}
        for i, (k, v) in enumerate(zip(keys, values)):
            feeds[f"ctx_key_{i}"], feeds[f"ctx_value_{i}"] = k, v
        hidden, logits = self.block.run(["hidden", "logits"], feeds)
        return hidden, logits

    def run_context(self, taps, cos, sin):
        outs = self.context.run(None, {"taps": taps, "cos": cos, "sin": sin})
        return outs[0], outs[1::2], outs[2::2]


def head_from_gguf(model, vocab_ids: np.ndarray) -> NBitsWeight:
    """The target's tied head restricted to the draft vocabulary, its Q8_0/Q4 blocks as they are
    (when the embedding is not block-quantized: 8-bit blocks of its float rows)."""
    name = "token_embd.weight"
    kind = model.tensor_type(name)
    n, k = model.shape(name)
    if kind in ("Q8_0", "Q4_0"):
        raw = np.asarray(model.raw(name))[np.asarray(vocab_ids)]
        return to_nbits(raw, kind, len(vocab_ids), k)
    return quantize8(model.dequantized(name).reshape(n, k)[np.asarray(vocab_ids)])
