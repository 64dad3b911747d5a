"""A small transformer encoder whose MLP blocks run through the fused
LayerNorm+GELU+MatMul kernel and whose activations come from the BFC pool.

Per layer (pre-LayerNorm):
    x = x + Attention(LN1(x)) @ Wo + bo
    u = GELU(LN2(x)) @ W1 + b1          # fused kernel, d -> d_ff
    x = x + GELU(LN3(u)) @ W2 + b2      # fused kernel, d_ff -> d
and a final LayerNorm. ``tools/build_fused_transformer.py`` makes the weights (numpy
RNG) and the same network as ONNX, which the integration test runs in ONNX Runtime.
"""
from __future__ import annotations

import json
import math
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dspark.errors import RequestError

if TYPE_CHECKING:  # the compiled kernels load where they are used: the numpy parts need none
    from dspark.kernels.pool import MemoryPool

INPUT_NAME = "INPUT_IDS"
OUTPUT_NAME = "HIDDEN"


@dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int = 512
    max_positions: int = 128
    d_model: int = 256
    n_heads: int = 4
    d_ff: int = 1024
    n_layers: int = 2
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def layer_names(i: int) -> dict[str, str]:
    p = f"layer{i}."
    return {k: p + k for k in ("ln1.g", "ln1.b", "qkv.w", "qkv.b", "out.w", "out.b", "ln2.g", "ln2.b",
                               "fc1.w", "fc1.b", "ln3.g", "ln3.b", "fc2.w", "fc2.b")}


def make_weights(config: TransformerConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random but well-scaled weights (numpy RNG): LayerNorm gains near 1, matrices ~ 1/sqrt(fan_in)."""
    rng = np.random.default_rng(seed)
    d, f = config.d_model, config.d_ff

    def mat(fan_in: int, fan_out: int) -> np.ndarray:
        return (rng.standard_normal((fan_in, fan_out)) / math.sqrt(fan_in)).astype(np.float32)

    def vec(n: int, scale: float, centre: float = 0.0) -> np.ndarray:
        return (centre + scale * rng.standard_normal(n)).astype(np.float32)

    w = {"emb.tok": (0.5 * rng.standard_normal((config.vocab_size, d))).astype(np.float32),
         "emb.pos": (0.1 * rng.standard_normal((config.max_positions, d))).astype(np.float32)}
    for i in range(config.n_layers):
        n = layer_names(i)
        w.update({n["ln1.g"]: vec(d, 0.1, 1.0), n["ln1.b"]: vec(d, 0.1),
                  n["qkv.w"]: mat(d, 3 * d), n["qkv.b"]: vec(3 * d, 0.02),
                  n["out.w"]: mat(d, d), n["out.b"]: vec(d, 0.02),
                  n["ln2.g"]: vec(d, 0.1, 1.0), n["ln2.b"]: vec(d, 0.1),
                  n["fc1.w"]: mat(d, f), n["fc1.b"]: vec(f, 0.02),
                  n["ln3.g"]: vec(f, 0.1, 1.0), n["ln3.b"]: vec(f, 0.1),
                  n["fc2.w"]: mat(f, d), n["fc2.b"]: vec(d, 0.02)})
    w["final.g"], w["final.b"] = vec(d, 0.1, 1.0), vec(d, 0.1)
    return w


def save_weights(path: Path, config: TransformerConfig, weights: dict[str, np.ndarray]) -> None:
    np.savez(path, config_json=np.array(json.dumps(asdict(config))), **weights)


def read_npz_into(path: Path, allocate, skip: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Read every array of an uncompressed .npz into memory from ``allocate(shape, dtype)``."""
    arrays = {}
    with zipfile.ZipFile(path) as archive:
        for member in archive.namelist():
            name = member.removesuffix(".npy")
            if name in skip:
                continue
            with archive.open(member) as f:
                version = np.lib.format.read_magic(f)
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)
                shape, fortran_order, dtype = read_header(f)
                if fortran_order or dtype.hasobject:
                    raise ValueError(f"{path}: {name} must be a C-order numeric array")
                array = allocate(shape, dtype)
                if f.readinto(array.reshape(-1).view(np.uint8)) != array.nbytes:
                    raise ValueError(f"{path}: {name} is truncated")
            arrays[name] = array
    return arrays


def layer_norm(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * g + b


def validate_input_ids(c: TransformerConfig, input_ids: np.ndarray) -> np.ndarray:
    """Token ids as int64 [batch, seq], or a RequestError naming the input."""
    if not isinstance(input_ids, np.ndarray) or input_ids.dtype.kind not in "iu":
        kind = getattr(input_ids, "dtype", type(input_ids).__name__)
        raise RequestError(INPUT_NAME, f"expected integer token ids (INT64), got {kind}")
    if input_ids.ndim != 2 or input_ids.shape[0] == 0:
        raise RequestError(INPUT_NAME, f"expected shape [batch, seq] with batch >= 1, got {list(input_ids.shape)}")
    if not 1 <= input_ids.shape[1] <= c.max_positions:
        raise RequestError(INPUT_NAME, f"sequence length {input_ids.shape[1]} is outside 1..{c.max_positions}")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= c.vocab_size:
        raise RequestError(INPUT_NAME, f"token ids must be in 0..{c.vocab_size - 1}, got {lo}..{hi}")
    return input_ids.astype(np.int64, copy=False)


class FusedTransformer:
    """Runs the encoder; ``forward(input_ids[B, S]) -> hidden[B, S, d_model]`` float32."""

    def __init__(self, config: TransformerConfig, weights: dict[str, np.ndarray], *,
                 threads: int = 1, pool: MemoryPool | None = None) -> None:
        from dspark.kernels.fused import FusedLNGeluMatMul

        self.config = config
        self.pool = pool
        self.weights = weights
        eps = config.eps
        self.mlp = []
        for i in range(config.n_layers):
            n = layer_names(i)
            self.mlp.append((
                FusedLNGeluMatMul(weights[n["ln2.g"]], weights[n["ln2.b"]], weights[n["fc1.w"]],
                                  weights[n["fc1.b"]], eps=eps, threads=threads),
                FusedLNGeluMatMul(weights[n["ln3.g"]], weights[n["ln3.b"]], weights[n["fc2.w"]],
                                  weights[n["fc2.b"]], eps=eps, threads=threads)))

    @classmethod
    def load(cls, path: Path, *, threads: int = 1, use_pool: bool = True, numa_node: int | None = None,
             pool_bytes: int = 64 << 20, lock_pages: bool = False, huge_pages: bool = True
             ) -> "FusedTransformer":
        """Load weights from ``path`` (.npz). With the pool, each array is read straight into
        pool memory. With ``numa_node`` the process is pinned to that node first and the pool
        prefaults its arena, so first touch places weights and activations on that node."""
        from dspark.kernels.numa import pin_process_to_node
        from dspark.kernels.pool import MemoryPool

        if numa_node is not None:
            pin_process_to_node(numa_node)
        pool = (MemoryPool(initial_bytes=pool_bytes, prefault=numa_node is not None,
                           lock_pages=lock_pages, huge_pages=huge_pages) if use_pool else None)
        with np.load(path) as npz:
            config = TransformerConfig(**json.loads(str(npz["config_json"])))
            if pool is None:
                weights = {name: npz[name] for name in npz.files if name != "config_json"}
        if pool is not None:
            weights = read_npz_into(path, pool.empty, skip=("config_json",))
        return cls(config, weights, threads=threads, pool=pool)

    def _empty(self, shape: tuple[int, ...]) -> np.ndarray:
        return self.pool.empty(shape, np.float32) if self.pool is not None else np.empty(shape, np.float32)

    def validate(self, input_ids: np.ndarray) -> np.ndarray:
        return validate_input_ids(self.config, input_ids)

    def _attention(self, x: np.ndarray, i: int) -> np.ndarray:
        c, n, w = self.config, layer_names(i), self.weights
        bsz, seq, d = x.shape
        a = layer_norm(x, w[n["ln1.g"]], w[n["ln1.b"]], c.eps)
        qkv = (a @ w[n["qkv.w"]] + w[n["qkv.b"]]).reshape(bsz, seq, 3, c.n_heads, c.head_dim)
        q, k, v = qkv.transpose(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(0, 1, 3, 2)) * np.float32(1.0 / math.sqrt(c.head_dim))
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        ctx = (scores @ v).transpose(0, 2, 1, 3).reshape(bsz, seq, d)
        return ctx @ w[n["out.w"]] + w[n["out.b"]]

    def forward(self, input_ids: np.ndarray) -> np.ndarray:
        ids = self.validate(input_ids)
        c = self.config
        bsz, seq = ids.shape
        x = self._empty((bsz, seq, c.d_model))
        np.add(self.weights["emb.tok"][ids], self.weights["emb.pos"][:seq], out=x)
        u = self._empty((bsz, seq, c.d_ff))
        m = self._empty((bsz, seq, c.d_model))
        for i, (up, down) in enumerate(self.mlp):
            x += self._attention(x, i)
            up(x, out=u)
            down(u, out=m)
            x += m
        return layer_norm(x, self.weights["final.g"], self.weights["final.b"], c.eps).astype(np.float32, copy=False)


def to_onnx(config: TransformerConfig, weights: dict[str, np.ndarray]):
    """The same network as an ONNX graph (opset 17), for ONNX Runtime to check us against."""
    from onnx import TensorProto, helper, numpy_helper

    c = config
    nodes, inits = [], [numpy_helper.from_array(v, k) for k, v in weights.items()]

    def const(name: str, value, dtype=np.float32) -> str:
        inits.append(numpy_helper.from_array(np.array(value, dtype), name))
        return name

    def node(op: str, inputs: list[str], output: str, **attrs) -> str:
        nodes.append(helper.make_node(op, inputs, [output], **attrs))
        return output

    def gelu(x: str, p: str) -> str:  # the x/sqrt(2) erf form that ORT fuses into Gelu
        e = node("Erf", [node("Div", [x, "sqrt2"], p + "div")], p + "erf")
        return node("Mul", [node("Mul", [x, node("Add", [e, "one"], p + "e1")], p + "xe"), "half"], p + "gelu")

    const("sqrt2", math.sqrt(2)), const("one", 1.0), const("half", 0.5)
    const("scale", 1.0 / math.sqrt(c.head_dim))
    const("i0", 0, np.int64), const("i1", 1, np.int64), const("i2", 2, np.int64)
    const("qkv_shape", [0, 0, 3, c.n_heads, c.head_dim], np.int64)
    const("model_shape", [0, 0, c.d_model], np.int64)

    seq = node("Gather", [node("Shape", [INPUT_NAME], "ids_shape"), "i1"], "seq")
    positions = node("Range", ["i0", "seq", "i1"], "positions")
    x = node("Add", [node("Gather", ["emb.tok", INPUT_NAME], "tok"),
                     node("Gather", ["emb.pos", positions], "pos")], "x_emb")
    for i in range(c.n_layers):
        n, p = layer_names(i), f"l{i}."
        a = node("LayerNormalization", [x, n["ln1.g"], n["ln1.b"]], p + "ln1", axis=-1, epsilon=c.eps)
        qkv = node("Add", [node("MatMul", [a, n["qkv.w"]], p + "qkv_mm"), n["qkv.b"]], p + "qkv")
        heads = node("Transpose", [node("Reshape", [qkv, "qkv_shape"], p + "qkv5")], p + "heads",
                     perm=[2, 0, 3, 1, 4])
        q, k, v = (node("Gather", [heads, idx], p + name, axis=0)
                   for idx, name in (("i0", "q"), ("i1", "k"), ("i2", "v")))
        kt = node("Transpose", [k], p + "kt", perm=[0, 1, 3, 2])
        scores = node("Mul", [node("MatMul", [q, kt], p + "qk"), "scale"], p + "scores")
        probs = node("Softmax", [scores], p + "probs", axis=-1)
        ctx = node("Transpose", [node("MatMul", [probs, v], p + "ctx4")], p + "ctx_t", perm=[0, 2, 1, 3])
        ctx = node("Reshape", [ctx, "model_shape"], p + "ctx")
        attn = node("Add", [node("MatMul", [ctx, n["out.w"]], p + "out_mm"), n["out.b"]], p + "attn")
        x = node("Add", [x, attn], p + "x_attn")
        h = gelu(node("LayerNormalization", [x, n["ln2.g"], n["ln2.b"]], p + "ln2", axis=-1, epsilon=c.eps), p + "g1")
        u = node("Add", [node("MatMul", [h, n["fc1.w"]], p + "fc1_mm"), n["fc1.b"]], p + "u")
        h = gelu(node("LayerNormalization", [u, n["ln3.g"], n["ln3.b"]], p + "ln3", axis=-1, epsilon=c.eps), p + "g2")
        m = node("Add", [node("MatMul", [h, n["fc2.w"]], p + "fc2_mm"), n["fc2.b"]], p + "m")
        x = node("Add", [x, m], p + "x_mlp")
    node("LayerNormalization", [x, "final.g", "final.b"], OUTPUT_NAME, axis=-1, epsilon=c.eps)
    graph = helper.make_graph(
        nodes, "fused_transformer",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["batch", "seq", c.d_model])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
