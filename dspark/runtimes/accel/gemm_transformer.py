"""The fused transformer's network with every matrix product through the GemmEx shim.

Same weights file and math as dspark.runtimes.fused_transformer (and its ONNX twin): per layer
LN1 -> QKV -> attention -> out projection, LN2 -> GELU -> fc1, LN3 -> GELU -> fc2, a final LN.
Every product (the four projections and, per head, QK^T and PV) is one `<vendor>GemmEx` call.
The device and the vendor alias come from the model's config: on the CPU the C library
(OpenBLAS fp32; AMX or AVX512-BF16 for `compute: bf16`), on a GPU cuBLAS through CuPy, with the
activations staying on the device, so one model config runs on either.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from dspark.runtimes.accel.gemm import ComputeType, Gemm, Operation
from dspark.runtimes.fused_transformer import TransformerConfig, layer_names, layer_norm, validate_input_ids
from dspark.errors import ConfigError

COMPUTES = {"fp32": ComputeType.COMPUTE_32F, "bf16": ComputeType.COMPUTE_32F_FAST_16BF}


def _erf(xp):
    if xp is np:
        from scipy.special import erf
    else:
        from cupyx.scipy.special import erf
    return erf


class GemmTransformer:
    """``forward(input_ids[B, S]) -> hidden[B, S, d_model]`` float32 (a host array)."""

    pool = None  # the fused engine's memory pool has no counterpart here

    def __init__(self, config: TransformerConfig, weights: dict[str, np.ndarray], gemm: Gemm,
                 compute: str = "fp32") -> None:
        if compute not in COMPUTES:
            raise ConfigError("gemm_compute", f"unknown compute {compute!r}; one of {', '.join(COMPUTES)}")
        self.config, self.gemm, self.compute = config, gemm, COMPUTES[compute]
        self.xp = gemm.xp
        self.erf = _erf(self.xp)
        self.weights = {name: self.xp.asarray(value, dtype=np.float32) for name, value in weights.items()}

    @classmethod
    def load(cls, path: Path, *, vendor: str = "hcblas", device: str = "auto", compute: str = "fp32"
             ) -> "GemmTransformer":
        with np.load(path) as npz:
            config = TransformerConfig(**json.loads(str(npz["config_json"])))
            weights = {name: npz[name] for name in npz.files if name != "config_json"}
        return cls(config, weights, Gemm(vendor, device), compute)

    def describe(self) -> str:
        return f"{self.gemm.describe()}, compute {self.compute.name}"

    def _linear(self, x, name: str):
        """x[..., d_in] @ W + b through one GemmEx call."""
        w, b = self.weights[f"{name}.w"], self.weights[f"{name}.b"]
        rows = x.reshape(-1, x.shape[-1])
        out = self.gemm.matmul(rows, w, compute=self.compute)
        out += b
        return out.reshape(*x.shape[:-1], w.shape[1])

    def _scores_and_context(self, q, k, v):
        """Per (batch, head): softmax(q k^T / sqrt(hd)) v, as two GemmEx calls (k^T by transpose flag)."""
        xp, c = self.xp, self.config
        seq, hd = q.shape[-2], q.shape[-1]
        scale = 1.0 / math.sqrt(c.head_dim)
        ctx = xp.empty_like(q)
        scores = xp.empty((seq, seq), np.float32)
        for b in range(q.shape[0]):
            for h in range(q.shape[1]):
                qh, kh, vh = (xp.ascontiguousarray(t[b, h]) for t in (q, k, v))
                # row-major scores = q k^T is column-major scores^T = k q^T: k with OP_T, q with OP_N
                self.gemm.gemm_ex(Operation.T, Operation.N, seq, seq, hd, scale, kh, 0, hd, qh, 0, hd, 0.0,
                                  scores, 0, seq, self.compute)
                probs = xp.exp(scores - scores.max(-1, keepdims=True))
                probs /= probs.sum(-1, keepdims=True)
                ctx[b, h] = self.gemm.matmul(probs.astype(np.float32), vh, compute=self.compute)
        return ctx

    def _gelu(self, x):
        return 0.5 * x * (1.0 + self.erf(x / np.float32(math.sqrt(2.0))))

    def forward(self, input_ids: np.ndarray) -> np.ndarray:
        ids = validate_input_ids(self.config, input_ids)
        xp, c, w = self.xp, self.config, self.weights
        bsz, seq = ids.shape
        x = w["emb.tok"][xp.asarray(ids)] + w["emb.pos"][:seq]
        for i in range(c.n_layers):
            n, p = layer_names(i), f"layer{i}."
            a = layer_norm(x, w[n["ln1.g"]], w[n["ln1.b"]], c.eps)
            qkv = self._linear(a, p + "qkv").reshape(bsz, seq, 3, c.n_heads, c.head_dim)
            q, k, v = qkv.transpose(2, 0, 3, 1, 4)
            ctx = self._scores_and_context(q, k, v).transpose(0, 2, 1, 3).reshape(bsz, seq, c.d_model)
            x = x + self._linear(ctx, p + "out")
            u = self._linear(self._gelu(layer_norm(x, w[n["ln2.g"]], w[n["ln2.b"]], c.eps)), p + "fc1")
            x = x + self._linear(self._gelu(layer_norm(u, w[n["ln3.g"]], w[n["ln3.b"]], c.eps)), p + "fc2")
        hidden = layer_norm(x, w["final.g"], w["final.b"], c.eps).astype(np.float32)
        return hidden if xp is np else xp.asnumpy(hidden)
