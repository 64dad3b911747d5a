"""The DSpark drafter in torch (training only; torch from requirements-train.txt, imported
inside the functions): the model (dspark/decoding/dspark_drafter.py documents the architecture;
`build_model` is the same maths in torch), its training for a wall-clock budget with a fixed
seed, validation, and the export to the float16 .npz that serving loads."""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import numpy as np

from dspark.training.data import (DATA, HIDDEN, N_TAPS, TAP_CLIP, Batcher, load_data, split, tap_statistics,
                                  torch_with_threads)


# ---------------------------------------------------------------------------------- model
def build_model(torch, cfg: dict, target_tensors: dict | None):
    """The drafter in torch; same maths as dspark/decoding/dspark_drafter.py (numpy)."""
    import torch.nn.functional as F
    from dspark.training.target import rope_pairs

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
    torch = torch_with_threads(args.threads)
    from dspark.llm.gguf_model import installed_smollm2
    from dspark.training.target import read_gguf

    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    random.seed(args.seed)
    _, tensors, _ = read_gguf(installed_smollm2())
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
    train_seqs, val_seqs = split(seqs)
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
    torch = torch_with_threads(1)
    from dspark.decoding.dspark_drafter import FORMAT

    ck = torch.load(args.checkpoint)
    cfg = {k: v for k, v in ck["cfg"].items() if k not in ("init_blocks", "draft_vocab")}
    cfg["tap_clip"] = TAP_CLIP
    arrays = {}
    for name, t in ck["state"].items():
        arrays[name.removesuffix(".weight")] = t.detach().float().numpy().astype(np.float16)
    arrays["vocab_ids"] = np.load(DATA / "draft_vocab.npy").astype(np.int32)
    from dspark.llm.gguf_model import installed_smollm2

    meta = {"format": FORMAT, "config": cfg, "target": installed_smollm2().name,
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
    from dspark.decoding.dspark_drafter import DSparkDrafter
    from dspark.llm.gguf_model import installed_smollm2
    from dspark.training.target import read_gguf

    _, tensors, _ = read_gguf(installed_smollm2())
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
