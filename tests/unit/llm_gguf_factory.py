"""Small llama GGUF files written with the ``gguf`` package, for import tests (any weight type)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_llama_gguf(path: Path, weight_type: str = "Q4_1", head_type: str | None = None,
                     architecture: str = "llama", n_layer: int = 3, hidden: int = 64, ffn: int = 96,
                     n_head: int = 4, n_kv_head: int = 2, vocab: int = 288, tied: bool = True,
                     extra_tensor: str | None = None, seed: int = 0) -> Path:
    """A random model: block matrices in ``weight_type``, the embedding (and head) in ``head_type``
    (default: the same). The vocabulary: 3 control tokens, the 256 byte tokens, a few merges."""
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
    writer.add_rope_dimension_count(hidden // n_head)
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
        else:
            qtype = getattr(Q, kind)
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    head_type = head_type or weight_type
    add("token_embd.weight", (vocab, hidden), head_type, scale=8.0)
    if not tied:
        add("output.weight", (vocab, hidden), head_type, scale=4.0)
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    kv = hidden // n_head * n_kv_head
    for i in range(n_layer):
        p = f"blk.{i}."
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(p + norm + ".weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        add(p + "attn_q.weight", (hidden, hidden), weight_type, 2.0)
        add(p + "attn_k.weight", (kv, hidden), weight_type, 2.0)
        add(p + "attn_v.weight", (kv, hidden), weight_type)
        add(p + "attn_output.weight", (hidden, hidden), weight_type)
        add(p + "ffn_gate.weight", (ffn, hidden), weight_type)
        add(p + "ffn_up.weight", (ffn, hidden), weight_type)
        add(p + "ffn_down.weight", (hidden, ffn), weight_type)
    if extra_tensor:
        writer.add_tensor(extra_tensor, np.zeros(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
