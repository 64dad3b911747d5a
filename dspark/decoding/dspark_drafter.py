"""The DSpark drafter at serving time (numpy, no torch): one pass drafts a whole block.

DSpark (Cheng et al., arXiv 2607.05147) on a DFlash-style block-parallel backbone:

- **Context**: for every accepted position the target exports the hidden states of blocks
  ``TAP_LAYERS`` (dspark.llm.taps). They are standardized per dimension with the training
  data's mean and deviation (a few dimensions of the residual stream are ~100x the others),
  clipped, scaled and projected to one context feature (``fc``, RMSNorm). Every draft layer turns the context
  features into its own keys and values once (``extend``), like a KV cache.
- **Block**: slot 0 holds the embedding of the anchor (the token the target sampled last, not
  yet run by the target), slots 1..k-1 a learned mask embedding; every slot also gets the
  last committed row's context feature through ``last_proj`` (as vLLM's DSpark feeds the
  hidden state of the last accepted position). The two terms are RMS-normed apart
  (``emb_norm``, ``last_norm``) before they are added: summed raw, the anchor's embedding was
  ~1 % of the sum and the drafter learnt to ignore it. The draft layers (Llama
  blocks: RoPE on consecutive pairs, grouped-query attention, SwiGLU) let each slot attend to
  all context positions and, bidirectionally, to the whole block; slot j predicts the token
  at anchor + j + 1. One pass, k rows.
- **Head**: the target's own (tied) embedding rows for a frequency-ranked subset of the
  vocabulary (FR-Spec): logits over ``vocab_ids`` only. The proposal distribution is zero
  outside that subset, which rejection sampling handles like any proposal.
- **Markov head**: slot j's logits get the low-rank bias ``W1[prev] @ W2`` from the token
  drafted at slot j-1 (the anchor for slot 0), restoring the dependency parallel drafting
  loses. Applied sequentially after the one backbone pass: k cheap rank-r products.
- **Confidence head**: ``sigmoid(w . [hidden_j, W1[prev_j]] + b)``, two outputs: the
  probability that the target's greedy token equals the draft (used at temperature 0) and the
  expected acceptance ``sum min(p, q)`` of rejection sampling (used when sampling). They feed
  dspark.decoding.dspark_schedule, which picks how many draft rows to verify.

Weights: tools/weights/dspark_smollm2.npz (tools/train_dspark.py export), float16 on disk,
float32 in memory; the embedding rows come from the target's GGUF (shared, not stored).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from dspark.errors import ConfigError, RequestError

FORMAT = "dspark-drafter/2"  # /2: the block input's two terms RMS-normed (emb_norm, last_norm)
BACKENDS = ("numpy", "kernel")
EmbedRows = Callable[[np.ndarray], np.ndarray]  # token ids -> float32 rows [n, hidden]


def default_weights() -> Path:
    """The drafter trained for SmolLM2-135M-Instruct (tools/train_dspark.py)."""
    from dspark.paths import project_root

    return project_root() / "tools" / "weights" / "dspark_smollm2.npz"


def drafter_target(path: str | Path) -> Optional[str]:
    """The file name of the GGUF a drafter's weights were trained for (their metadata)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["__config__"]).decode())
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError("drafter weights", f"cannot read: {exc}", path) from exc
    return meta.get("target")


def gguf_embedding(model) -> EmbedRows:
    """Rows of the target's token embedding, dequantized on demand from the GGUF's own blocks
    (a dspark.llm.gguf_model.GGUFModel): the drafter shares the target's embedding and holds no
    float copy of the whole table."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[model.tensor_type("token_embd.weight")]
    raw = model.raw("token_embd.weight")

    def rows(ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if qtype == GGMLQuantizationType.Q8_0:  # one anchor a draft: the direct path is ~10x cheaper
            blocks = np.asarray(raw[ids]).reshape(len(ids), -1, 34)
            scale = blocks[..., :2].copy().view(np.float16).astype(np.float32)
            return (scale * blocks[..., 2:].view(np.int8)).reshape(len(ids), -1)
        return np.asarray(dequantize(raw[ids], qtype), np.float32).reshape(len(ids), -1)

    return rows


@dataclass(frozen=True)
class DrafterConfig:
    hidden: int
    n_head: int
    n_kv_head: int
    head_dim: int
    ffn: int
    rope_base: float
    n_layer: int
    block: int
    markov_rank: int
    taps: tuple[int, ...]
    target_vocab: int
    tap_clip: float = 8.0
    rms_eps: float = 1e-5

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        names = cls.__dataclass_fields__
        missing = [n for n in names if n not in d and n not in ("rms_eps", "tap_clip")]
        if missing:
            raise ConfigError("config", f"missing {', '.join(missing)}")
        return cls(**{k: (tuple(v) if k == "taps" else v) for k, v in d.items() if k in names})


@dataclass
class DraftContext:
    """One request's drafter state: the context features and, per draft layer, the keys and
    values of the context rows (float32 arrays, or the kernel backend's fp16 cache)."""
    features: np.ndarray      # [capacity, hidden]
    keys: list[np.ndarray]    # [capacity, n_kv_head, head_dim] per layer (RoPE applied)
    values: list[np.ndarray]
    length: int = 0
    cache: object = None      # the kernel backend's KernelCache (keys and values empty then)
    last_input: Optional[np.ndarray] = None  # the block's context term for row length - 1 ...
    last_input_at: int = -1                  # ... when computed at this length

    @property
    def capacity(self) -> int:
        return self.features.shape[0]

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back draft context of length {self.length} to {length}")
        self.length = length


@dataclass
class Proposal:
    """k draft tokens, their proposal distributions (full vocabulary, zero outside the draft
    vocabulary; None when greedy) and per-position confidences in [0, 1]."""
    tokens: np.ndarray                      # int64 [k]
    probs: Optional[np.ndarray]             # float32 [k, target_vocab] or None
    confidence: np.ndarray                  # float32 [k]
    extra: dict = field(default_factory=dict)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x * (w / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def rope_trig(positions: np.ndarray, d: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [n, d/2] float32 of the rotation angles for consecutive pairs (2i, 2i+1)."""
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.asarray(positions, np.float64)[:, None] * inv[None]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _rope_pairs(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """Rotate consecutive pairs (2i, 2i+1). x [n, heads, d], positions [n]."""
    cos, sin = rope_trig(positions, x.shape[-1], base)
    cos, sin = cos[:, None], sin[:, None]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


class DSparkDrafter:
    """Weights and the block forward; per-request state lives in a DraftContext."""

    def __init__(self, cfg: DrafterConfig, weights: dict[str, np.ndarray], vocab_ids: np.ndarray,
                 embed_rows: EmbedRows, backend: str = "numpy", head=None, threads: int = 1):
        """``backend``: "numpy" (float32, the reference) or "kernel" (dspark_kernel: dspark's C
        kernels, 8-bit weights; ``head`` a PackedMatrix of the draft vocabulary's embedding rows,
        default those rows quantized to 8 bits)."""
        if backend not in BACKENDS:
            raise ConfigError("backend", f"{backend!r} is not one of {BACKENDS}")
        self.cfg = cfg
        self.backend = backend
        w = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
        H, nh, nkv, hd = cfg.hidden, cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.vocab_ids = np.asarray(vocab_ids, dtype=np.int64)
        if self.vocab_ids.ndim != 1 or self.vocab_ids.size == 0:
            raise ConfigError("vocab_ids", "expected a non-empty 1-D array of token ids")
        self.to_draft = np.full(cfg.target_vocab, self.vocab_ids.size, dtype=np.int64)
        self.to_draft[self.vocab_ids] = np.arange(self.vocab_ids.size)
        self.embed_rows = embed_rows
        self.head_t = np.ascontiguousarray(embed_rows(self.vocab_ids).T, dtype=np.float32)  # [H, V]
        self.tap_mean, self.tap_std = w["tap_mean"], w["tap_std"]  # [n_taps*H], fixed
        self.tap_norm = w["tap_norm"]                     # [n_taps*H], learnt
        self.fc_t = np.ascontiguousarray(w["fc"].T)        # [n_taps*H, H]
        self.ctx_norm = w["ctx_norm"]
        self.emb_norm = w["emb_norm"]
        self.mask_emb = _rms(w["mask_emb"][None], self.emb_norm, cfg.rms_eps)[0]
        self.last_proj_t = np.ascontiguousarray(w["last_proj"].T)
        self.last_norm = w["last_norm"]
        self.out_norm = w["out_norm"]
        self.markov_w1 = w["markov_w1"]                    # [V + 1, r]
        self.markov_w2 = w["markov_w2"]                    # [r, V]
        self.conf_w = w["conf_w"]                          # [H + r, 2]
        self.conf_b = w["conf_b"]
        self.layers = []
        for i in range(cfg.n_layer):
            p = f"layers.{i}."
            self.layers.append({
                "attn_norm": w[p + "attn_norm"], "ffn_norm": w[p + "ffn_norm"],
                "wq": np.ascontiguousarray(w[p + "wq"].T),
                "wkv": np.ascontiguousarray(np.concatenate([w[p + "wk"], w[p + "wv"]], 0).T),
                "wo": np.ascontiguousarray(w[p + "wo"].T),
                "w_gate_up": np.ascontiguousarray(
                    np.concatenate([w[p + "w_gate"], w[p + "w_up"]], 0).T),
                "w_down": np.ascontiguousarray(w[p + "w_down"].T),
            })
        expect = {"fc": (H, len(cfg.taps) * H), "markov_w2": (cfg.markov_rank, self.vocab_ids.size),
                  "markov_w1": (self.vocab_ids.size + 1, cfg.markov_rank), "conf_w": (H + cfg.markov_rank, 2)}
        for name, shape in expect.items():
            if w[name].shape != shape:
                raise ConfigError(name, f"shape {w[name].shape}, expected {shape}")
        self.q_dim, self.kv_dim = nh * hd, nkv * hd
        self.kernel = None
        if backend == "kernel":
            from dspark.decoding.dspark_kernel import KernelDrafterPasses
            from dspark.llm.kernel_runtime import pack_float

            self.kernel = KernelDrafterPasses(cfg, w, head if head is not None else pack_float(self.head_t.T),
                                              self.vocab_ids.size, threads)
            self.layers, self.head_t, self.fc_t, self.markov_w2 = [], None, None, None  # the kernels' now

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | Path, embed_rows: EmbedRows, target_vocab: int, **options) -> "DSparkDrafter":
        """Weights from an .npz written by tools/train_dspark.py export; ``options`` as for
        the constructor (backend, head, threads)."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError) as exc:
            raise ConfigError("drafter weights", f"cannot read: {exc}", path) from exc
        meta = json.loads(bytes(arrays.pop("__config__")).decode()) if "__config__" in arrays else {}
        if meta.get("format") != FORMAT:
            raise ConfigError("format", f"{meta.get('format')!r}, expected {FORMAT!r}", path)
        meta["config"]["target_vocab"] = target_vocab
        cfg = DrafterConfig.from_dict(meta["config"])
        vocab_ids = arrays.pop("vocab_ids")
        if vocab_ids.max() >= target_vocab:
            raise ConfigError("vocab_ids", f"token {vocab_ids.max()} >= target vocab {target_vocab}", path)
        return cls(cfg, arrays, vocab_ids, embed_rows, **options)

    @classmethod
    def for_gguf(cls, model, path: str | Path | None = None, backend: str = "kernel",
                 threads: int = 2) -> "DSparkDrafter":
        """The drafter for a target GGUF (a GGUFModel), its embedding shared; on the kernels
        (served: docs/dspark.md) its head is the target's own quantized embedding rows."""
        path = path or default_weights()
        head = None
        if backend == "kernel":
            with np.load(path) as z:
                vocab_ids = z["vocab_ids"]
            from dspark.llm.kernel_runtime import pack_matrix

            head = pack_matrix(model, "token_embd.weight", vocab_ids)
        drafter = cls.load(path, gguf_embedding(model), model.config.vocab, backend=backend,
                           head=head, threads=threads)
        from dspark.llm.taps import default_tap_layers

        taps = default_tap_layers(model.config.n_layer)
        if drafter.cfg.hidden != model.config.hidden or drafter.cfg.taps != taps:
            raise ConfigError("config", f"drafter for hidden {drafter.cfg.hidden}, taps {drafter.cfg.taps}; "
                              f"the target has hidden {model.config.hidden}, taps {taps}: train a "
                              "drafter for this model (tools/train_dspark.py)", path)
        return drafter

    # ------------------------------------------------------------------ context
    def new_context(self, capacity: int) -> DraftContext:
        c = self.cfg
        features = np.zeros((capacity, c.hidden), np.float32)
        if self.kernel is not None:
            return DraftContext(features, [], [], cache=self.kernel.new_cache(capacity))
        shape = (capacity, c.n_kv_head, c.head_dim)
        return DraftContext(features,
                            [np.zeros(shape, np.float32) for _ in range(c.n_layer)],
                            [np.zeros(shape, np.float32) for _ in range(c.n_layer)])

    def context_features(self, taps: np.ndarray) -> np.ndarray:
        c = self.cfg
        z = np.clip((np.asarray(taps, np.float32) - self.tap_mean) / self.tap_std, -c.tap_clip, c.tap_clip)
        z = z * self.tap_norm
        fc = z @ self.fc_t if self.kernel is None else self.kernel.project(z, self.kernel.fc)
        return _rms(fc, self.ctx_norm, c.rms_eps)

    def extend(self, ctx: DraftContext, taps: np.ndarray) -> None:
        """Append the taps of the next context positions (rows ctx.length, ...): the rows
        the target ACCEPTED. Positions are the row indices."""
        c = self.cfg
        taps = np.asarray(taps, dtype=np.float32)
        if taps.ndim != 2 or taps.shape[1] != len(c.taps) * c.hidden:
            raise RequestError("taps", f"shape {taps.shape}, expected [n, {len(c.taps) * c.hidden}]")
        n = taps.shape[0]
        if ctx.length + n > ctx.capacity:
            raise RequestError("context", f"{ctx.length} + {n} rows exceed the drafter's "
                               f"capacity {ctx.capacity}")
        if n == 0:
            return
        pos = np.arange(ctx.length, ctx.length + n)
        feats = self.context_features(taps)
        ctx.features[ctx.length:ctx.length + n] = feats
        kv, last = self._context_outputs(feats)
        kv = kv.reshape(n, c.n_layer, 2, c.n_kv_head, c.head_dim)
        new_keys = _rope_pairs(kv[:, :, 0].reshape(n, -1, c.head_dim), pos, c.rope_base)
        new_keys = [new_keys[:, layer * c.n_kv_head:(layer + 1) * c.n_kv_head] for layer in range(c.n_layer)]
        new_values = [kv[:, layer, 1] for layer in range(c.n_layer)]
        if self.kernel is not None:
            self.kernel.write_context(ctx.cache, ctx.length, new_keys, new_values)
        else:
            for keys, values, k, v in zip(ctx.keys, ctx.values, new_keys, new_values):
                keys[ctx.length:ctx.length + n] = k
                values[ctx.length:ctx.length + n] = v
        ctx.length += n
        ctx.last_input, ctx.last_input_at = _rms(last, self.last_norm, c.rms_eps), ctx.length

    def _context_outputs(self, feats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every layer's [keys | values] of the context features (before RoPE), [n, layers *
        2 * kv_dim], and the last row's term of the block input, last_proj(feature) [1, H]: one
        product on the kernels (each call pays for reading its weights from memory)."""
        if self.kernel is not None:
            out = self.kernel.project(feats, self.kernel.context_out)
            return out[:, :-self.cfg.hidden], out[-1:, -self.cfg.hidden:]
        return (np.concatenate([feats @ layer["wkv"] for layer in self.layers], 1),
                feats[-1:] @ self.last_proj_t)

    # ------------------------------------------------------------------ block pass
    def block_pass(self, ctx: DraftContext, anchor: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The backbone's one pass over the block at positions ctx.length .. ctx.length + k - 1
        (the anchor sits at ctx.length): normed hidden states [k, H] and the head's logits
        [k, V] (before the Markov bias)."""
        c = self.cfg
        if not 1 <= k <= c.block:
            raise RequestError("num_speculative_tokens", f"{k}: the drafter drafts 1..{c.block}")
        x = np.empty((k, c.hidden), np.float32)
        x[0] = _rms(self.embed_rows(np.array([anchor])), self.emb_norm, c.rms_eps)[0]
        x[1:] = self.mask_emb
        C = ctx.length
        if C:  # every slot reads the last committed row's feature directly
            x += (ctx.last_input if ctx.last_input_at == C else
                  _rms(ctx.features[C - 1:C] @ self.last_proj_t, self.last_norm, c.rms_eps))
        if self.kernel is not None:
            last, logits = self.kernel.run_block(x, ctx.cache, C)
            return _rms(last, self.out_norm, c.rms_eps), logits
        hid = self._numpy_backbone(x, ctx)
        return hid, hid @ self.head_t

    def _numpy_backbone(self, x: np.ndarray, ctx: DraftContext) -> np.ndarray:
        c = self.cfg
        k, C = x.shape[0], ctx.length
        pos = np.arange(C, C + k)
        group = c.n_head // c.n_kv_head
        scale = 1.0 / np.sqrt(c.head_dim)
        for layer, keys, values in zip(self.layers, ctx.keys, ctx.values):
            h = _rms(x, layer["attn_norm"], c.rms_eps)
            q = _rope_pairs((h @ layer["wq"]).reshape(k, c.n_head, c.head_dim), pos, c.rope_base)
            kv = h @ layer["wkv"]
            kb = _rope_pairs(kv[:, :self.kv_dim].reshape(k, c.n_kv_head, c.head_dim), pos, c.rope_base)
            vb = kv[:, self.kv_dim:].reshape(k, c.n_kv_head, c.head_dim)
            K = np.concatenate([keys[:C], kb], 0)          # [C + k, nkv, hd]
            V = np.concatenate([values[:C], vb], 0)
            # [nkv, group*k, hd] x [nkv, hd, C+k]: each KV head serves `group` query heads
            qg = q.reshape(k, c.n_kv_head, group, c.head_dim).transpose(1, 2, 0, 3)
            qg = qg.reshape(c.n_kv_head, group * k, c.head_dim)
            s = np.matmul(qg, K.transpose(1, 2, 0)) * scale
            s -= s.max(-1, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(-1, keepdims=True)
            a = np.matmul(s, V.transpose(1, 0, 2))          # [nkv, group*k, hd]
            a = a.reshape(c.n_kv_head, group, k, c.head_dim).transpose(2, 0, 1, 3).reshape(k, -1)
            x = x + a @ layer["wo"]
            h = _rms(x, layer["ffn_norm"], c.rms_eps)
            gu = h @ layer["w_gate_up"]
            g, u = gu[:, :c.ffn], gu[:, c.ffn:]
            x = x + ((g / (1.0 + np.exp(-g))) * u) @ layer["w_down"]
        return _rms(x, self.out_norm, c.rms_eps)

    def markov_bias(self, w1_row: np.ndarray) -> np.ndarray:
        """The Markov head's logit bias W1[prev] @ W2 over the draft vocabulary."""
        if self.kernel is not None:
            return self.kernel.markov(w1_row)
        return w1_row @ self.markov_w2

    def propose(self, ctx: DraftContext, anchor: int, k: int, temperature: float = 0.0,
                rng: Optional[np.random.Generator] = None, want_probs: bool = True,
                stop_below: float = 0.0) -> Proposal:
        """Draft k tokens after ``anchor``. Greedy (argmax) at temperature 0, else each token
        is sampled from softmax(logits / temperature) over the draft vocabulary, and (with
        ``want_probs``) that distribution is returned over the full vocabulary. Drafting stops
        early, after the first slot where the product of the confidences so far falls below
        ``stop_below`` (those later drafts would add less than that many expected tokens:
        the sequential Markov head is half of a block's cost)."""
        hid, base = self.block_pass(ctx, anchor, k)
        V = self.vocab_ids.size
        tokens = np.empty(k, np.int64)
        conf = np.empty(k, np.float32)
        sampled = temperature > 0
        probs = np.zeros((k, self.cfg.target_vocab), np.float32) if sampled and want_probs else None
        if sampled and rng is None:
            raise ValueError("sampling needs an rng")
        H = self.cfg.hidden
        conf_w = self.conf_w[:, int(sampled)]
        conf_hidden = hid @ conf_w[:H] + self.conf_b[int(sampled)]
        prev = int(self.to_draft[anchor])
        prefix = 1.0
        for j in range(k):
            emb = self.markov_w1[prev]
            logits = base[j] + self.markov_bias(emb)
            conf[j] = _sigmoid(conf_hidden[j] + emb @ conf_w[H:])
            if sampled:
                z = np.exp((logits - logits.max()).astype(np.float64) / temperature)
                cdf = np.cumsum(z)
                d = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), V - 1)
                if probs is not None:
                    probs[j, self.vocab_ids] = z / cdf[-1]
            else:
                d = int(np.argmax(logits))
            tokens[j] = self.vocab_ids[d]
            prev = d
            prefix *= float(conf[j])
            if prefix < stop_below:
                n = j + 1
                return Proposal(tokens[:n], None if probs is None else probs[:n], conf[:n])
        return Proposal(tokens, probs, conf)
