"""Build the ONNX graph of a decoder-only LM from numpy weights (no torch needed at setup).

The graph is made for speculative decoding:

* inputs ``input_ids``/``positions`` ``[1, T]``, ``key_positions`` ``[1, S]`` and a boolean
  ``attention_mask`` ``[1, T, S]`` (query t may see key s), so T new tokens can be a chain or a
  tree; ``S = P + T`` where ``P`` is the length of the ``past_*`` inputs;
* per layer ``past_key_i`` ``[1, P, H, Dh]`` and ``past_value_i`` ``[1, P, H, Dh + 1]`` are
  contiguous prefixes of a preallocated cache, and ``present_key_i``/``present_value_i`` hold
  only the T new rows, which the engine writes into its cache (rollback = shorter length);
* positions enter only through ALiBi distance penalties, so a tree node's position is an input;
* output ``logits`` ``[T, vocab]``: the hidden state is kept 2-D, so ORT fuses every weight
  MatMul with its bias into one Gemm (fewer nodes: a call is mostly per-node overhead for the
  draft).

Greedy speculation must equal plain decoding token for token. Batched verification usually
breaks that on near-ties because a row's arithmetic depends on the batch; this graph keeps a
row's result independent of T and of masked keys: every reduction over keys is a MatMul whose
accumulation runs in key order (masked keys add an exact 0), the softmax denominator comes from
the same MatMul (value rows carry a trailing 1, made by the QKV projection), and the engine pads S to a multiple of 16 so
elementwise kernels never take a scalar tail. ``tests/unit/test_spec_onnx_lm.py`` checks the
logits bit for bit.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# Bumped whenever the graph's interface or weight layout changes; engines refuse other formats.
GRAPH_FORMAT = "2"
OPSET = 20  # Gelu(approximate='tanh') is one node from opset 20


@dataclass(frozen=True)
class LMConfig:
    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    ctx: int  # longest sequence the engine will cache (prompt + generated)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @classmethod
    def from_json(cls, text: str) -> "LMConfig":
        data = json.loads(text)
        return cls(**{k: data[k] for k in ("n_layer", "d_model", "n_head", "vocab", "ctx")})

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def alibi_slopes(n_head: int) -> np.ndarray:
    return (2.0 ** (-8.0 * np.arange(1, n_head + 1) / n_head)).astype(np.float32)


def random_weights(cfg: LMConfig, seed: int = 0, scale: float = 0.5) -> dict[str, np.ndarray]:
    """Random weights in the trained layout, for tests (``scale`` sharpens the logits)."""
    rng = np.random.default_rng(seed)
    d = cfg.d_model

    def w(*shape, s=scale):
        return (rng.standard_normal(shape) * s / np.sqrt(shape[0])).astype(np.float32)

    out = {"tok_emb": (rng.standard_normal((cfg.vocab, d)) * 0.3).astype(np.float32),
           "lnf.w": np.ones(d, np.float32), "lnf.b": np.zeros(d, np.float32)}
    for i in range(cfg.n_layer):
        p = f"h{i}."
        out |= {p + "ln1.w": 1 + 0.1 * rng.standard_normal(d).astype(np.float32),
                p + "ln1.b": 0.1 * rng.standard_normal(d).astype(np.float32),
                p + "qkv.w": w(d, 3 * d, s=2.0), p + "qkv.b": np.zeros(3 * d, np.float32),
                p + "proj.w": w(d, d), p + "proj.b": np.zeros(d, np.float32),
                p + "ln2.w": np.ones(d, np.float32), p + "ln2.b": np.zeros(d, np.float32),
                p + "fc.w": w(d, 4 * d), p + "fc.b": np.zeros(4 * d, np.float32),
                p + "fc_proj.w": w(4 * d, d), p + "fc_proj.b": np.zeros(d, np.float32)}
    return out


def _with_unit_value_column(w: np.ndarray, b: np.ndarray, h: int, dh: int):
    """QKV weights whose value part gives each head a trailing column of exactly 1.0 (zero
    weights, bias 1), so the attention's value MatMul also sums the softmax weights."""
    d = w.shape[0]
    wv = np.concatenate([w[:, 2 * d:].reshape(d, h, dh), np.zeros((d, h, 1), np.float32)], -1)
    bv = np.concatenate([b[2 * d:].reshape(h, dh), np.ones((h, 1), np.float32)], -1)
    return (np.concatenate([w[:, :2 * d], wv.reshape(d, -1)], 1),
            np.concatenate([b[:2 * d], bv.reshape(-1)]))


class _Graph:
    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def const(self, name: str, value) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, *inputs: str, n_out: int = 1, **attrs):
        self._n += 1
        outs = [f"{op_type.lower()}_{self._n}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, **attrs))
        return outs[0] if n_out == 1 else outs


def build_lm_onnx(weights: dict[str, np.ndarray], cfg: LMConfig) -> onnx.ModelProto:
    g = _Graph()
    d, h, dh = cfg.d_model, cfg.n_head, cfg.head_dim
    f32 = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}

    g.const("tok_emb", f32["tok_emb"])
    g.const("lnf.w", f32["lnf.w"])
    g.const("lnf.b", f32["lnf.b"])
    g.const("tok_emb_t", np.ascontiguousarray(f32["tok_emb"].T))
    neg_slopes = g.const("neg_slopes", (-alibi_slopes(h)).reshape(1, h, 1, 1))
    scale = g.const("attn_scale", np.array(1.0 / np.sqrt(dh), np.float32))
    neg_inf = g.const("neg_inf", np.array(-np.inf, np.float32))
    shape_bthd = g.const("shape_bthd", np.array([1, -1, h, dh], np.int64))
    shape_bthd1 = g.const("shape_bthd1", np.array([1, -1, h, dh + 1], np.int64))
    shape_td = g.const("shape_td", np.array([-1, d], np.int64))
    shape_flat = g.const("shape_flat", np.array([-1], np.int64))
    ax1 = g.const("axes_1", np.array([1], np.int64))
    ax12 = g.const("axes_12", np.array([1, 2], np.int64))
    ax13 = g.const("axes_13", np.array([1, 3], np.int64))
    sl_0, sl_dh, sl_dh1 = (g.const(n, np.array([v], np.int64))
                           for n, v in (("sl_0", 0), ("sl_dh", dh), ("sl_dh1", dh + 1)))
    ax_last = g.const("axes_last", np.array([-1], np.int64))

    # ALiBi bias [1, H, T, S] with -inf where the mask hides a key, shared by all layers.
    qpos = g.op("Cast", g.op("Unsqueeze", "positions", ax13), to=TensorProto.FLOAT)
    kpos = g.op("Cast", g.op("Unsqueeze", "key_positions", ax12), to=TensorProto.FLOAT)
    bias = g.op("Mul", g.op("Sub", qpos, kpos), neg_slopes)
    bias = g.op("Where", g.op("Unsqueeze", "attention_mask", ax1), bias, neg_inf)

    # the hidden state is 2-D [T, d] (batch is always 1), so each MatMul + bias becomes a Gemm
    x = g.op("Gather", "tok_emb", g.op("Reshape", "input_ids", shape_flat), axis=0)
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "T"]),
        helper.make_tensor_value_info("positions", TensorProto.INT64, [1, "T"]),
        helper.make_tensor_value_info("key_positions", TensorProto.INT64, [1, "S"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.BOOL, [1, "T", "S"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", cfg.vocab])]
    split = g.const("qkv_split", np.array([d, d, h * (dh + 1)], np.int64))
    for i in range(cfg.n_layer):
        p = f"h{i}."
        for name in ("ln1.w", "ln1.b", "proj.w", "proj.b", "ln2.w", "ln2.b",
                     "fc.w", "fc.b", "fc_proj.w", "fc_proj.b"):
            g.const(p + name, f32[p + name])
        qkv_w, qkv_b = _with_unit_value_column(f32[p + "qkv.w"], f32[p + "qkv.b"], h, dh)
        g.const(p + "qkv.w", qkv_w)
        g.const(p + "qkv.b", qkv_b)
        inputs += [helper.make_tensor_value_info(f"past_key_{i}", TensorProto.FLOAT, [1, "P", h, dh]),
                   helper.make_tensor_value_info(f"past_value_{i}", TensorProto.FLOAT, [1, "P", h, dh + 1])]
        outputs += [helper.make_tensor_value_info(f"present_key_{i}", TensorProto.FLOAT, [1, "T", h, dh]),
                    helper.make_tensor_value_info(f"present_value_{i}", TensorProto.FLOAT, [1, "T", h, dh + 1])]

        a = g.op("LayerNormalization", x, p + "ln1.w", p + "ln1.b", axis=-1, epsilon=1e-5)
        qkv = g.op("Add", g.op("MatMul", a, p + "qkv.w"), p + "qkv.b")
        q, k_flat, v1_flat = g.op("Split", qkv, split, axis=-1, n_out=3)
        q = g.op("Transpose", g.op("Reshape", q, shape_bthd), perm=[0, 2, 1, 3])  # [1,H,T,Dh]
        k, v1 = f"present_key_{i}", f"present_value_{i}"  # only the new rows leave the graph
        g.nodes.append(helper.make_node("Reshape", [k_flat, shape_bthd], [k]))
        g.nodes.append(helper.make_node("Reshape", [v1_flat, shape_bthd1], [v1]))
        k_all = g.op("Transpose", g.op("Concat", f"past_key_{i}", k, axis=1), perm=[0, 2, 3, 1])
        v_all = g.op("Transpose", g.op("Concat", f"past_value_{i}", v1, axis=1), perm=[0, 2, 1, 3])
        scores = g.op("Add", g.op("Mul", g.op("MatMul", q, k_all), scale), bias)  # [1,H,T,S]
        weights_ = g.op("Exp", g.op("Sub", scores, g.op("ReduceMax", scores, ax_last, keepdims=1)))
        acc = g.op("MatMul", weights_, v_all)  # [1,H,T,Dh+1]: the trailing 1 sums the weights
        num = g.op("Slice", acc, sl_0, sl_dh, ax_last)
        den = g.op("Slice", acc, sl_dh, sl_dh1, ax_last)
        att = g.op("Reshape", g.op("Transpose", g.op("Div", num, den), perm=[0, 2, 1, 3]), shape_td)
        x = g.op("Add", x, g.op("Add", g.op("MatMul", att, p + "proj.w"), p + "proj.b"))

        m = g.op("LayerNormalization", x, p + "ln2.w", p + "ln2.b", axis=-1, epsilon=1e-5)
        m = g.op("Gelu", g.op("Add", g.op("MatMul", m, p + "fc.w"), p + "fc.b"), approximate="tanh")
        x = g.op("Add", x, g.op("Add", g.op("MatMul", m, p + "fc_proj.w"), p + "fc_proj.b"))

    xf = g.op("LayerNormalization", x, "lnf.w", "lnf.b", axis=-1, epsilon=1e-5)
    g.nodes.append(helper.make_node("MatMul", [xf, "tok_emb_t"], ["logits"]))
    graph = helper.make_graph(g.nodes, "speculative_lm", inputs, outputs, g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="dspark")
    model.ir_version = 9
    helper.set_model_props(model, {"dspark_lm_config": cfg.to_json(), "dspark_lm_format": GRAPH_FORMAT})
    onnx.checker.check_model(model)
    return model


def load_weights_npz(path) -> tuple[dict[str, np.ndarray], LMConfig]:
    """Weights and config from a ``tests/fixtures/toy_lm/train.py`` checkpoint (fp16 npz)."""
    data = np.load(path)
    cfg = LMConfig.from_json(str(data["config"]))
    return {k: data[k] for k in data.files if k != "config"}, cfg
