"""Train the BPE target and draft LMs of the speculative backend (PyTorch, CPU, fp32).

Optional extra: needs torch (``pip install torch==2.13.0``); serving needs only numpy + ORT.
The schedule is bounded by wall time (``--minutes``): the cosine learning-rate decay runs over
the time budget, so a run ends on time whatever the machine's speed. Weights are written as an
fp16 ``.npz`` in the layout ``dspark.decoding.onnx_lm`` builds ONNX from. The committed pair
was made by (see docs/speculative.md):

    python tools/spec_train.py --role target --minutes 21 --out /tmp/t1.npz
    python tools/spec_train.py --role target --minutes 18 --lr 1.5e-3 --init /tmp/t1.npz --out /tmp/t2.npz
    python tools/spec_train.py --role target --minutes 75 --lr 2e-3 --prose-share 0.15 \
        --init /tmp/t2.npz --out tools/weights/spec_target.npz
    python tools/spec_train.py --role draft --minutes 7 --teacher /tmp/t2.npz --out /tmp/d1.npz
    python tools/spec_train.py --role draft --minutes 14 --lr 2e-3 --prose-share 0.15 \
        --init /tmp/d1.npz --teacher tools/weights/spec_target.npz --out /tmp/d2.npz
    python tools/spec_train.py --role draft --minutes 16 --lr 1e-3 --distill-weight 0.9 \
        --prose-share 0.15 --init /tmp/d2.npz --teacher tools/weights/spec_target.npz \
        --out tools/weights/spec_draft.npz
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark.decoding.tokenizer import BPETokenizer  # noqa: E402
from dspark.decoding.corpus import split_documents, to_bytes  # noqa: E402

CONFIGS = {
    "target": dict(n_layer=6, d_model=256, n_head=4, ctx=1024),
    "draft": dict(n_layer=2, d_model=128, n_head=2, ctx=1024),
}
ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "tools" / "weights" / "spec_bpe.json"
VOCAB = 1024  # checked against the tokenizer at start


def alibi_slopes(n_head: int) -> np.ndarray:
    """ALiBi head slopes 2^(-8i/n): position enters only as a distance penalty, so the model
    runs past its training length and a tree's positions are plain inputs in the ONNX graph."""
    return 2.0 ** (-8.0 * np.arange(1, n_head + 1) / n_head)


_BIAS_CACHE: dict = {}


def alibi_bias(n_head: int, t: int) -> torch.Tensor:
    key = (n_head, t)
    if key not in _BIAS_CACHE:
        pos = torch.arange(t)
        dist = (pos[:, None] - pos[None, :]).float()
        slopes = torch.tensor(alibi_slopes(n_head), dtype=torch.float32)[:, None, None]
        bias = -slopes * dist
        _BIAS_CACHE[key] = bias.masked_fill(dist < 0, float("-inf"))
    return _BIAS_CACHE[key]


class Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        shape = (b, t, self.n_head, d // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=alibi_bias(self.n_head, t))
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class ByteLM(nn.Module):
    def __init__(self, n_layer: int, d_model: int, n_head: int, ctx: int):
        super().__init__()
        self.config = dict(n_layer=n_layer, d_model=d_model, n_head=n_head, ctx=ctx, vocab=VOCAB)
        self.tok = nn.Embedding(VOCAB, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.lnf = nn.LayerNorm(d_model)
        nn.init.normal_(self.tok.weight, std=0.02)
        for blk in self.blocks:  # GPT-2 style scaled init of residual projections
            nn.init.normal_(blk.proj.weight, std=0.02 / math.sqrt(2 * n_layer))
            nn.init.normal_(blk.fc_proj.weight, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx):
        x = self.tok(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.lnf(x) @ self.tok.weight.T  # tied embeddings

    def to_numpy(self) -> dict[str, np.ndarray]:
        """Weights in the exporter's layout (Linear weights stored as (in, out))."""
        out = {"tok_emb": self.tok.weight,
               "lnf.w": self.lnf.weight, "lnf.b": self.lnf.bias}
        for i, blk in enumerate(self.blocks):
            p = f"h{i}."
            out |= {p + "ln1.w": blk.ln1.weight, p + "ln1.b": blk.ln1.bias,
                    p + "qkv.w": blk.qkv.weight.T, p + "qkv.b": blk.qkv.bias,
                    p + "proj.w": blk.proj.weight.T, p + "proj.b": blk.proj.bias,
                    p + "ln2.w": blk.ln2.weight, p + "ln2.b": blk.ln2.bias,
                    p + "fc.w": blk.fc.weight.T, p + "fc.b": blk.fc.bias,
                    p + "fc_proj.w": blk.fc_proj.weight.T, p + "fc_proj.b": blk.fc_proj.bias}
        return {k: v.detach().float().numpy().astype(np.float16) for k, v in out.items()}

    @classmethod
    def from_numpy(cls, path: Path) -> "ByteLM":
        data = np.load(path)
        cfg = json.loads(str(data["config"]))
        model = cls(cfg["n_layer"], cfg["d_model"], cfg["n_head"], cfg["ctx"])
        sd = {"tok.weight": data["tok_emb"],
              "lnf.weight": data["lnf.w"], "lnf.bias": data["lnf.b"]}
        names = {"ln1.w": "ln1.weight", "ln1.b": "ln1.bias", "qkv.w": "qkv.weight",
                 "qkv.b": "qkv.bias", "proj.w": "proj.weight", "proj.b": "proj.bias",
                 "ln2.w": "ln2.weight", "ln2.b": "ln2.bias", "fc.w": "fc.weight",
                 "fc.b": "fc.bias", "fc_proj.w": "fc_proj.weight", "fc_proj.b": "fc_proj.bias"}
        for i in range(cfg["n_layer"]):
            for src, dst in names.items():
                arr = data[f"h{i}.{src}"].astype(np.float32)
                sd[f"blocks.{i}.{dst}"] = arr.T if src.endswith(".w") and arr.ndim == 2 else arr
        model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()})
        return model


def encoded_corpus(cache: Path) -> dict[str, np.ndarray]:
    """Token arrays of the training text, its prose part and the held-out prose/code, plus the
    held-out bytes-per-token ratios (to report loss in bits per byte)."""
    if cache.exists():
        return dict(np.load(cache))
    tok = BPETokenizer.load(TOKENIZER)
    assert tok.vocab_size == VOCAB
    train_docs, held_docs = split_documents()
    out = {"train": to_bytes(train_docs),
           "prose": to_bytes([d for d in train_docs if d.kind == "prose"]),
           "held_prose": to_bytes([d for d in held_docs if d.kind == "prose"]),
           "held_code": to_bytes([d for d in held_docs if d.kind == "code"])}
    arrays = {}
    for name, raw in out.items():
        ids = np.array(tok.encode(raw), dtype=np.uint16)
        arrays[name] = ids
        arrays[name + "_bytes_per_token"] = np.array(len(raw) / len(ids))
    np.savez(cache, **arrays)
    return arrays


def batches(data: np.ndarray, prose: np.ndarray, batch: int, seq: int, prose_share: float,
            rng: np.random.Generator):
    while True:
        rows = []
        for _ in range(batch):
            src = prose if rng.random() < prose_share else data
            start = rng.integers(0, len(src) - seq - 1)
            rows.append(src[start:start + seq + 1])
        arr = torch.from_numpy(np.stack(rows).astype(np.int64))
        yield arr[:, :-1], arr[:, 1:]


@torch.no_grad()
def heldout_bits_per_byte(model: ByteLM, data: np.ndarray, bytes_per_token: float, seq: int,
                          max_windows: int = 64) -> float:
    model.eval()
    n = min(max_windows, (len(data) - 1) // seq)
    starts = np.linspace(0, len(data) - seq - 1, n).astype(int)
    total = 0.0
    for chunk in np.array_split(starts, max(1, n // 8)):
        arr = torch.from_numpy(np.stack([data[s:s + seq + 1] for s in chunk]).astype(np.int64))
        logits = model(arr[:, :-1])
        total += F.cross_entropy(logits.float().reshape(-1, VOCAB), arr[:, 1:].reshape(-1),
                                 reduction="sum").item()
    model.train()
    return total / (n * seq) / math.log(2) / bytes_per_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=sorted(CONFIGS), required=True)
    ap.add_argument("--minutes", type=float, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--init", type=Path, help="continue from these weights (fresh optimizer)")
    ap.add_argument("--teacher", type=Path, help="distil from this target's soft labels (draft)")
    ap.add_argument("--distill-weight", type=float, default=0.7)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/spec_corpus_tokens.npz"))
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--prose-share", type=float, default=0.25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=0, help="stop early (smoke runs)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    corpus = encoded_corpus(args.cache)
    data, prose = corpus["train"], corpus["prose"]
    bpt = float(corpus["train_bytes_per_token"])

    model = ByteLM.from_numpy(args.init) if args.init else ByteLM(**CONFIGS[args.role])
    n_params = sum(p.numel() for p in model.parameters())
    teacher = None
    if args.teacher:
        teacher = ByteLM.from_numpy(args.teacher).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=False)
    budget = args.minutes * 60
    warmup_s = min(30.0, 0.05 * budget)
    print(f"role={args.role} params={n_params:,} config={model.config} budget={budget:.0f}s "
          f"teacher={args.teacher}", flush=True)
    t0 = time.time()
    step, tokens = 0, 0
    gen = batches(data, prose, args.batch, args.seq, args.prose_share, rng)
    while True:
        elapsed = time.time() - t0
        if elapsed >= budget or (args.max_steps and step >= args.max_steps):
            break
        frac = elapsed / budget
        lr = args.lr * min(1.0, (elapsed + 1) / warmup_s) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = next(gen)
        # fp32: this CPU has no bf16 matmul units (bf16 autocast ran far slower than fp32)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        if teacher is not None:
            with torch.no_grad():
                soft = F.softmax(teacher(x), dim=-1)
            kd = F.cross_entropy(logits.reshape(-1, VOCAB), soft.reshape(-1, VOCAB))
            loss = (1 - args.distill_weight) * loss + args.distill_weight * kd
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.numel()
        if step % 20 == 0:
            print(f"step {step} t={elapsed:.0f}s lr={lr:.2e} loss={loss.item():.3f} "
                  f"~bpb={loss.item() / math.log(2) / bpt:.3f} "
                  f"tok/s={tokens / (time.time() - t0):.0f}",
                  flush=True)
    bpb = {k: heldout_bits_per_byte(model, corpus[f"held_{k}"],
                                    float(corpus[f"held_{k}_bytes_per_token"]), args.seq)
           for k in ("prose", "code")}
    print(f"done steps={step} tokens={tokens:,} wall={time.time() - t0:.0f}s "
          f"heldout_bpb={json.dumps({k: round(v, 3) for k, v in bpb.items()})}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.init:  # the schedule so far, for the record
        prior = json.loads(str(np.load(args.init)["config"]))
        step, tokens = step + prior["steps"], tokens + prior["tokens"]
        args.minutes += prior["minutes"]
    meta = dict(model.config, role=args.role, steps=step, tokens=tokens, minutes=args.minutes,
                heldout_bits_per_byte=bpb, teacher=str(args.teacher) if args.teacher else None,
                params=n_params)
    np.savez(args.out, config=np.array(json.dumps(meta)), **model.to_numpy())
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
