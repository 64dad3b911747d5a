"""The target LLM in torch (training only; needs torch, requirements-train.txt): SmolLM2's GGUF,
dequantized, with the DSpark taps.

Used by dspark.training.data to gather training data: batched generation of the target's own
answers (self-distillation) and teacher-forced passes that export, per position, the tapped
hidden states (the residual stream after blocks TAP_LAYERS, the drafter's input) and the final
normed hidden state (whose product with the tied embedding is the target's logits, the
drafter's soft label). Serving never imports this: it runs the target on dspark.llm's runtime.

The maths follows llama.cpp's `llama` graph: RMSNorm, RoPE on consecutive pairs (2i, 2i+1)
("norm" rope, which the GGUF's permuted Q/K weights expect), grouped-query attention,
SwiGLU, tied output head.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dspark.llm.gguf_model import installed_smollm2
from dspark.llm.taps import TAP_LAYERS


@dataclass
class TargetConfig:
    n_layer: int
    hidden: int
    ffn: int
    n_head: int
    n_kv_head: int
    rope_base: float
    rms_eps: float
    vocab: int
    bos_id: int
    eos_id: int
    chat_template: str

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_head


def _field(reader, key):
    field = reader.fields[key]
    value = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(value).decode("utf-8")
    return value.tolist()[0] if value.size == 1 else value.tolist()


def read_gguf(path: Path) -> tuple[TargetConfig, dict[str, np.ndarray], object]:
    """Config, dequantized float32 tensors (numpy layout [out, in]) and the reader."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r}, expected 'llama'")
    cfg = TargetConfig(
        n_layer=_field(reader, "llama.block_count"),
        hidden=_field(reader, "llama.embedding_length"),
        ffn=_field(reader, "llama.feed_forward_length"),
        n_head=_field(reader, "llama.attention.head_count"),
        n_kv_head=_field(reader, "llama.attention.head_count_kv"),
        rope_base=float(_field(reader, "llama.rope.freq_base")),
        rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        vocab=len(reader.fields["tokenizer.ggml.tokens"].data),
        bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )
    tensors = {}
    for t in reader.tensors:
        arr = dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[t.name] = np.ascontiguousarray(arr.reshape(shape), dtype=np.float32)
    return cfg, tensors, reader


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope_pairs(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate consecutive pairs (2i, 2i+1). x [B, H, T, D], positions [B, T]."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = positions.float()[:, None, :, None] * inv  # [B, 1, T, D/2]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


class TorchTarget(torch.nn.Module):
    """The target with taps; `dtype` bfloat16 uses AMX/AVX-512-BF16 where the CPU has it."""

    def __init__(self, path: Path | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        cfg, t, _ = read_gguf(path or installed_smollm2())
        self.cfg, self.dtype = cfg, dtype

        def p(name):
            return torch.nn.Parameter(torch.tensor(t[name], dtype=dtype), requires_grad=False)

        self.embed = p("token_embd.weight")  # [vocab, hidden], tied head
        self.out_norm = p("output_norm.weight")
        self.layers = []
        for i in range(cfg.n_layer):
            layer = {
                k: p(f"blk.{i}.{k}.weight")
                for k in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                          "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
            }
            layer["attn_qkv"] = torch.cat([layer.pop("attn_q"), layer.pop("attn_k"),
                                           layer.pop("attn_v")], 0)
            layer["ffn_gate_up"] = torch.cat([layer.pop("ffn_gate"), layer.pop("ffn_up")], 0)
            self.layers.append(layer)

    def new_cache(self, batch: int, capacity: int):
        c = self.cfg
        shape = (c.n_layer, batch, c.n_kv_head, capacity, c.head_dim)
        return [torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype)]

    @torch.no_grad()
    def forward(self, tokens, positions, mask, cache=None, start: int = 0, want_taps=True):
        """tokens/positions [B, T]; mask [B, T, S] bool (True = may attend) over the S =
        start + T keys (cache rows [0, start) then these rows). Returns the final normed
        hidden [B, T, hidden] and the taps [B, T, len(TAP_LAYERS) * hidden] (or None)."""
        c = self.cfg
        B, T = tokens.shape
        hd, nh, nkv = c.head_dim, c.n_head, c.n_kv_head
        x = self.embed[tokens]
        taps = []
        for i, L in enumerate(self.layers):
            h = _rms(x, L["attn_norm"], c.rms_eps)
            qkv = h @ L["attn_qkv"].T
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = rope_pairs(q.view(B, T, nh, hd).transpose(1, 2), positions, c.rope_base)
            k = rope_pairs(k.view(B, T, nkv, hd).transpose(1, 2), positions, c.rope_base)
            v = v.view(B, T, nkv, hd).transpose(1, 2)
            if cache is not None:
                cache[0][i, :, :, start:start + T] = k
                cache[1][i, :, :, start:start + T] = v
                k = cache[0][i, :, :, :start + T]
                v = cache[1][i, :, :, :start + T]
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(B, T, nh * hd) @ L["attn_output"].T
            h = _rms(x, L["ffn_norm"], c.rms_eps)
            g, u = (h @ L["ffn_gate_up"].T).chunk(2, dim=-1)
            x = x + (F.silu(g) * u) @ L["ffn_down"].T
            if want_taps and i in TAP_LAYERS:
                taps.append(x)
        final = _rms(x, self.out_norm, c.rms_eps)
        return final, (torch.cat(taps, -1) if want_taps else None)

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        return final @ self.embed.T

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new: int, temperature: float,
                 generator: torch.Generator | None = None, stop_ids=(0, 2), top_k: int = 64,
                 record: bool = False):
        """Batched generation (left-padded); a row stops at a stop id. Greedy when temperature
        is 0, else top-k sampling (the data only has to look like the target's outputs).
        Returns the new tokens per row and, with `record`, per row the features of every
        token fed to the model (prompt, then all new tokens but the last): float16
        [rows, hidden + taps] = the final normed hidden (-> the target's next-token logits)
        and the tapped hidden states."""
        B = len(prompts)
        plen = max(len(p) for p in prompts)
        cap = plen + max_new
        tokens = torch.zeros(B, plen, dtype=torch.long)
        valid = torch.zeros(B, cap, dtype=torch.bool)
        for b, p in enumerate(prompts):
            tokens[b, plen - len(p):] = torch.tensor(p)
            valid[b, plen - len(p):plen] = True
        positions = (valid[:, :plen].long().cumsum(1) - 1).clamp(min=0)
        causal = torch.ones(plen, plen, dtype=torch.bool).tril()
        mask = causal[None] & valid[:, None, :plen]
        mask |= torch.eye(plen, dtype=torch.bool)[None]  # padded rows attend to themselves
        cache = self.new_cache(B, cap)
        final, taps = self(tokens, positions, mask, cache, 0, want_taps=record)
        feats = [[] for _ in range(B)]
        if record:
            f = torch.cat([final, taps], -1).to(torch.float16)
            for b, p in enumerate(prompts):
                feats[b].append(f[b, plen - len(p):])
        last = final[:, -1]
        pos = positions[:, -1]
        out = [[] for _ in range(B)]
        done = torch.zeros(B, dtype=torch.bool)
        stop = torch.tensor(list(stop_ids))
        for step in range(max_new):
            logits = self.logits(last).float()
            if temperature > 0:
                top, idx = torch.topk(logits / temperature, top_k, dim=-1)
                pick = torch.multinomial(torch.softmax(top, -1), 1, generator=generator)
                nxt = idx.gather(1, pick)[:, 0]
            else:
                nxt = logits.argmax(-1)
            for b in range(B):
                if not done[b]:
                    out[b].append(int(nxt[b]))
            done |= torch.isin(nxt, stop)
            if bool(done.all()) or step == max_new - 1:
                break
            at = plen + step
            valid[:, at] = True
            pos = pos + 1
            m = valid[:, None, :at + 1]
            final, taps = self(nxt[:, None], pos[:, None], m, cache, at, want_taps=record)
            if record:
                f = torch.cat([final, taps], -1).to(torch.float16)
                for b in range(B):
                    if not done[b]:
                        feats[b].append(f[b])
            last = final[:, 0]
        if record:
            return out, [torch.cat([x if x.dim() == 2 else x[None] for x in fb]) for fb in feats]
        return out
