"""Build the ONNX graph of a decoder-only LM from numpy weights (no torch needed at setup).

The graph is made for speculative decoding:

* inputs ``input_ids``/``positions`` ``[1, T]``, ``key_positions`` ``[1, S]`` and a boolean
  ``attention_mask`` ``[1, T, S]`` (query t may see key s), so T new tokens can be a chain or a
  tree; ``S = P + T`` where ``P`` is the length of the ``past_*`` inputs;
* per layer ``past_key_i`` ``[1, P, H, Dh]`` and ``past_value_i`` ``[1, P, H, Dh + 1]`` are
  contiguous prefixes of a preallocated cache, and ``present_key_i``/``present_value_i`` hold
  only the T new rows, which the engine writes into its cache (rollback = shorter length);
* positions enter only through ALiBi distance penalties, so a tree node's position is an input.

Greedy speculation must equal plain decoding token for token. Batched verification usually
breaks that on near-ties because a row's arithmetic depends on the batch; this graph keeps a
row's result independent of T and of masked keys: every reduction over keys is a MatMul whose
accumulation runs in key order (masked keys add an exact 0), the softmax denominator comes from
the same MatMul (value rows carry a trailing 1), and the engine pads S to a multiple of 16 so
elementwise kernels never take a scalar tail. ``tests/unit/test_spec_onnx_lm.py`` checks the
logits bit for bit.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


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
    shape_btd = g.const("shape_btd", np.array([1, -1, d], np.int64))
    ax1 = g.const("axes_1", np.array([1], np.int64))
    ax12 = g.const("axes_12", np.array([1, 2], np.int64))
    ax13 = g.const("axes_13", np.array([1, 3], np.int64))
    sl_0, sl_dh, sl_dh1 = (g.const(n, np.array([v], np.int64))
                           for n, v in (("sl_0", 0), ("sl_dh", dh), ("sl_dh1", dh + 1)))
    ax_last = g.const("axes_last", np.array([-1], np.int64))

    # ALiBi bias [1, H, T, S] and the boolean mask [1, 1, T, S], shared by all layers.
    qpos = g.op("Cast", g.op("Unsqueeze", "positions", ax13), to=TensorProto.FLOAT)
    kpos = g.op("Cast", g.op("Unsqueeze", "key_positions", ax12), to=TensorProto.FLOAT)
    bias = g.op("Mul", g.op("Sub", qpos, kpos), neg_slopes)
    mask = g.op("Unsqueeze", "attention_mask", ax1)

    x = g.op("Gather", "tok_emb", "input_ids", axis=0)
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "T"]),
        helper.make_tensor_value_info("positions", TensorProto.INT64, [1, "T"]),
        helper.make_tensor_value_info("key_positions", TensorProto.INT64, [1, "S"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.BOOL, [1, "T", "S"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "T", cfg.vocab])]
    for i in range(cfg.n_layer):
        p = f"h{i}."
        for name in ("ln1.w", "ln1.b", "qkv.w", "qkv.b", "proj.w", "proj.b", "ln2.w", "ln2.b",
                     "fc.w", "fc.b", "fc_proj.w", "fc_proj.b"):
            g.const(p + name, f32[p + name])
        inputs += [helper.make_tensor_value_info(f"past_key_{i}", TensorProto.FLOAT, [1, "P", h, dh]),
                   helper.make_tensor_value_info(f"past_value_{i}", TensorProto.FLOAT, [1, "P", h, dh + 1])]
        outputs += [helper.make_tensor_value_info(f"present_key_{i}", TensorProto.FLOAT, [1, "T", h, dh]),
                    helper.make_tensor_value_info(f"present_value_{i}", TensorProto.FLOAT, [1, "T", h, dh + 1])]

        a = g.op("LayerNormalization", x, p + "ln1.w", p + "ln1.b", axis=-1, epsilon=1e-5)
        qkv = g.op("Add", g.op("MatMul", a, p + "qkv.w"), p + "qkv.b")
        q, k, v = g.op("Split", qkv, g.const(p + "split", np.array([d, d, d], np.int64)), axis=-1, n_out=3)
        q = g.op("Transpose", g.op("Reshape", q, shape_bthd), perm=[0, 2, 1, 3])  # [1,H,T,Dh]
        k = g.op("Reshape", k, shape_bthd)  # [1,T,H,Dh]
        v = g.op("Reshape", v, shape_bthd)
        ones = g.op("ConstantOfShape", g.op("Concat", g.op("Slice", g.op("Shape", v), sl_0,
                                                           g.const(p + "three", np.array([3], np.int64))),
                                            g.const(p + "one", np.array([1], np.int64)), axis=0),
                    value=numpy_helper.from_array(np.array([1.0], np.float32)))
        v1 = g.op("Concat", v, ones, axis=-1)  # [1,T,H,Dh+1]: the trailing 1 sums the weights
        g.nodes.append(helper.make_node("Identity", [k], [f"present_key_{i}"]))
        g.nodes.append(helper.make_node("Identity", [v1], [f"present_value_{i}"]))
        k_all = g.op("Transpose", g.op("Concat", f"past_key_{i}", k, axis=1), perm=[0, 2, 3, 1])
        v_all = g.op("Transpose", g.op("Concat", f"past_value_{i}", v1, axis=1), perm=[0, 2, 1, 3])
        scores = g.op("Add", g.op("Mul", g.op("MatMul", q, k_all), scale), bias)  # [1,H,T,S]
        scores = g.op("Where", mask, scores, neg_inf)
        weights_ = g.op("Exp", g.op("Sub", scores, g.op("ReduceMax", scores, axes=[-1], keepdims=1)))
        acc = g.op("MatMul", weights_, v_all)  # [1,H,T,Dh+1]
        num = g.op("Slice", acc, sl_0, sl_dh, ax_last)
        den = g.op("Slice", acc, sl_dh, sl_dh1, ax_last)
        att = g.op("Reshape", g.op("Transpose", g.op("Div", num, den), perm=[0, 2, 1, 3]), shape_btd)
        x = g.op("Add", x, g.op("Add", g.op("MatMul", att, p + "proj.w"), p + "proj.b"))

        m = g.op("LayerNormalization", x, p + "ln2.w", p + "ln2.b", axis=-1, epsilon=1e-5)
        m = g.op("Add", g.op("MatMul", m, p + "fc.w"), p + "fc.b")
        # tanh-approximate GELU, as trained
        cube = g.op("Mul", g.op("Mul", m, m), m)
        inner = g.op("Mul", g.op("Add", m, g.op("Mul", cube, g.const(p + "c044", np.array(0.044715, np.float32)))),
                     g.const(p + "c_sqrt2pi", np.array(np.sqrt(2 / np.pi), np.float32)))
        gelu = g.op("Mul", g.op("Mul", m, g.const(p + "half", np.array(0.5, np.float32))),
                    g.op("Add", g.op("Tanh", inner), g.const(p + "one_f", np.array(1.0, np.float32))))
        x = g.op("Add", x, g.op("Add", g.op("MatMul", gelu, p + "fc_proj.w"), p + "fc_proj.b"))

    xf = g.op("LayerNormalization", x, "lnf.w", "lnf.b", axis=-1, epsilon=1e-5)
    g.nodes.append(helper.make_node("MatMul", [xf, "tok_emb_t"], ["logits"]))
    graph = helper.make_graph(g.nodes, "speculative_lm", inputs, outputs, g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="dspark")
    model.ir_version = 8
    helper.set_model_props(model, {"dspark_lm_config": cfg.to_json()})
    onnx.checker.check_model(model)
    return model


def load_weights_npz(path) -> tuple[dict[str, np.ndarray], LMConfig]:
    """Weights and config from a ``tools/spec_train.py`` checkpoint (fp16 npz)."""
    data = np.load(path)
    cfg = LMConfig.from_json(str(data["config"]))
    return {k: data[k] for k in data.files if k != "config"}, cfg
