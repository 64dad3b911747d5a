"""The DSpark drafter's training data (torch only in `gather`): the target's answers to the
training prompts with, for every token, the tapped hidden states and the final normed hidden
state (`gather`); the FR-Spec draft vocabulary (`vocab`); and the items a training step reads.

`gather` runs the target (dspark.training.target, the GGUF dequantized, bfloat16) over the
training prompts (dspark.training.prompts) and records, for every token of the prompt and of
the target's own answer (greedy and temperature-0.8 halves: self-distillation), the tapped
hidden states and the final normed hidden state. `vocab` ranks tokens by frequency in those
answers (FR-Spec) and keeps the top `--draft-vocab`.
"""
from __future__ import annotations

import json
import time

import numpy as np

from dspark.paths import project_root

DATA = project_root() / "build" / "dspark"
HIDDEN = 576
N_TAPS = 3
TAP_CLIP = 8.0  # standardized taps are clipped here (rare massive activations)


def torch_with_threads(threads: int):
    import torch

    torch.set_num_threads(threads)  # 1 by default: shared, loaded cores stall OpenMP barriers
    return torch


def smollm2_tokenizer():
    """SmolLM2's tokenizer as serving builds it (dspark.llm.tokenizer, from the GGUF)."""
    from dspark.llm.gguf_model import GGUFModel, installed_smollm2
    from dspark.llm.tokenizer import LlamaTokenizer

    return LlamaTokenizer.from_gguf(GGUFModel(installed_smollm2()))


# ---------------------------------------------------------------------------------- gather
def gather(args) -> None:
    torch = torch_with_threads(args.threads)
    from dspark.training.prompts import training_prompts
    from dspark.training.target import TorchTarget

    tok = smollm2_tokenizer()
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
        ids = [(tok.encode_chat([{"role": "user", "content": p["text"]}]) if p["chat"] else
                tok.encode(p["text"]))[-args.max_prompt:] for p in batch]
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
    from dspark.training.corpus import split_documents

    seqs = load_data()
    answers = np.zeros(49152, dtype=np.int64)
    for tokens, _, n_prompt, _, _ in seqs:
        np.add.at(answers, tokens[n_prompt:], 1)
    tok = smollm2_tokenizer()
    corpus = np.zeros(49152, dtype=np.int64)
    train_docs, _ = split_documents()
    for doc in train_docs:
        np.add.at(corpus, np.asarray(tok.encode(doc.text), dtype=np.int64), 1)
    score = args.answer_weight * answers / max(answers.sum(), 1) + corpus / max(corpus.sum(), 1)
    order = np.argsort(-score, kind="stable")
    for size in (4096, 8192, 12288, 16384, 24576):
        print(f"draft vocab {size:6d}: covers {answers[order[:size]].sum() / answers.sum():.4f} of "
              f"{answers.sum()} answer tokens, {corpus[order[:size]].sum() / corpus.sum():.4f} of "
              f"{corpus.sum()} corpus tokens")
    keep = np.sort(order[: args.draft_vocab]).astype(np.int32)
    np.save(DATA / "draft_vocab.npy", keep)
    print(f"kept {keep.size} tokens -> {DATA / 'draft_vocab.npy'}")


# ---------------------------------------------------------------------------------- items
def split(seqs):
    """Every 40th sequence is held out from training (validation on the training prompts'
    distribution; the real held-out evaluation uses dspark.training.prompts.heldout_prompts)."""
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
