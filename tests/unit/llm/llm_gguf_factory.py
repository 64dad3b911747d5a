"""Small GGUF files of the llama family written with the ``gguf`` package, for import and kernel
tests: any weight type (the K-quants from random bytes with finite scales, as ``gguf`` quantizes
only the legacy types) and the architectures dspark runs, each with the tensors it adds."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark.bench.shapes import K_QUANT_BYTES, random_k_blocks

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_llama_gguf(path: Path, weight_type: str = "Q4_1", head_type: str | None = None,
                     architecture: str = "llama", n_layer: int = 3, hidden: int = 64, ffn: int = 96,
                     n_head: int = 4, n_kv_head: int = 2, vocab: int = 288, tied: bool = True,
                     extra_tensor: str | None = None, seed: int = 0, head_dim: int | None = None,
                     sliding_window: int = 8, rope_freqs: bool = False, metadata: dict | None = None) -> Path:
    """A random model: block matrices in ``weight_type``, the embedding (and head) in ``head_type``
    (default: the same). The vocabulary: 3 control tokens, the 256 byte tokens, a few merges.
    ``head_dim`` (default hidden / n_head) is written as the attention key/value length;
    ``metadata`` overrides keys (without the architecture prefix) after the defaults."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(n_layer)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv_head)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    head_dim = head_dim or hidden // n_head
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if architecture == "gemma3":
        writer.add_sliding_window(sliding_window)
    from dspark.llm.tokenizer import _bytes_to_unicode

    byte_tokens = list(_bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_tokens + ["Ġt", "he", "Ġthe", "in"]
    tokens += [f"<unused{i}>" for i in range(vocab - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)

    def add(name: str, shape: tuple[int, ...], kind: str, scale: float = 1.0):
        data = (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(np.float32)
        if kind == "F32":
            writer.add_tensor(name, data)
        elif kind == "F16":
            writer.add_tensor(name, data.astype(np.float16))
        elif kind in K_QUANT_BYTES and shape[-1] % 256:  # rows too short for super-blocks, as llama.cpp does
            writer.add_tensor(name, gguf.quants.quantize(data, Q.Q8_0), raw_dtype=Q.Q8_0)
        elif kind in K_QUANT_BYTES:
            qtype = getattr(Q, kind)
            writer.add_tensor(name, random_k_blocks(rng, kind, shape, scale), raw_dtype=qtype)
        else:
            qtype = getattr(Q, kind)
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    head_type = head_type or weight_type
    add("token_embd.weight", (vocab, hidden), head_type, scale=8.0)
    if not tied:
        add("output.weight", (vocab, hidden), head_type, scale=4.0)
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    if rope_freqs:
        writer.add_tensor("rope_freqs.weight", (1 + 3 * rng.random(head_dim // 2)).astype(np.float32))
    kv, nq = head_dim * n_kv_head, head_dim * n_head

    def vector(name: str, n: int, around: float = 1.0):
        writer.add_tensor(name, (around + 0.1 * rng.standard_normal(n)).astype(np.float32))

    for i in range(n_layer):
        p = f"blk.{i}."
        for norm in ("attn_norm", "ffn_norm"):
            vector(p + norm + ".weight", hidden)
        add(p + "attn_q.weight", (nq, hidden), weight_type, 2.0)
        add(p + "attn_k.weight", (kv, hidden), weight_type, 2.0)
        add(p + "attn_v.weight", (kv, hidden), weight_type)
        add(p + "attn_output.weight", (hidden, nq), weight_type)
        if architecture in ("qwen3", "gemma3"):
            vector(p + "attn_q_norm.weight", head_dim)
            vector(p + "attn_k_norm.weight", head_dim)
        if architecture == "qwen2":
            for name, n in (("q", nq), ("k", kv), ("v", kv)):
                vector(p + f"attn_{name}.bias", n, 0.0)
        if architecture == "gemma3":
            vector(p + "post_attention_norm.weight", hidden)
            vector(p + "post_ffw_norm.weight", hidden)
        add(p + "ffn_gate.weight", (ffn, hidden), weight_type)
        add(p + "ffn_up.weight", (ffn, hidden), weight_type)
        add(p + "ffn_down.weight", (hidden, ffn), weight_type)
    if extra_tensor:
        writer.add_tensor(extra_tensor, np.zeros(hidden, np.float32))
    for key, value in (metadata or {}).items():
        _override(writer, key if key.startswith(("general.", "tokenizer.")) else f"{architecture}.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _override(writer, key: str, value) -> None:
    """Write ``key`` with the type its Python value has (a later value wins when read)."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint64(key, value) if value >= 0 else writer.add_int64(key, value)
    elif isinstance(value, float):
        writer.add_float64(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, value)
