"""`dspark train`: the DSpark drafter's training steps (dspark/training/: gather, vocab, train,
export). Only `train` needs torch."""
from __future__ import annotations

from types import SimpleNamespace

import click


def _run(step: str, options: dict) -> None:
    from dspark.training import data, drafter

    {"gather": data.gather, "vocab": data.vocab, "train": drafter.train, "export": drafter.export}[step](
        SimpleNamespace(cmd=step, **options))


def _data(name: str) -> str:
    from dspark.training.data import DATA

    return str(DATA / name)


@click.group("train")
def train() -> None:
    """Train the DSpark drafter: gather the target's answers, pick the draft vocabulary, train, export."""


@train.command("gather")
@click.option("--shard", type=int, default=0, show_default=True)
@click.option("--shards", type=int, default=1, show_default=True)
@click.option("--prompts", type=int, default=6000, show_default=True)
@click.option("--batch", type=int, default=32, show_default=True)
@click.option("--max-new", type=int, default=160, show_default=True)
@click.option("--max-prompt", type=int, default=384, show_default=True)
@click.option("--minutes", type=float, default=40, show_default=True)
@click.option("--threads", type=int, default=1, show_default=True)
@click.option("--prompt-seed", type=int, default=0, show_default=True,
              help="another seed draws other prompts: more data for a run that continues one")
def gather(**options) -> None:
    """The target's answers to training prompts (one shard of them)."""
    _run("gather", options)


@train.command("vocab")
@click.option("--draft-vocab", type=int, default=8192, show_default=True)
@click.option("--answer-weight", type=float, default=3.0, show_default=True)
def vocab(**options) -> None:
    """The drafter's vocabulary: the target's most used tokens."""
    _run("vocab", options)


@train.command("train")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--steps", type=int, default=4000, show_default=True)
@click.option("--minutes", type=float, default=75, show_default=True)
@click.option("--threads", type=int, default=1, show_default=True)
@click.option("--layers", type=int, default=2, show_default=True)
@click.option("--init-blocks", default="", help="target blocks the layers start from (default: random)")
@click.option("--init-from", default="",
              help="a drafter.pt, or exported weights (.npz, e.g. the shipped ones), to continue from")
@click.option("--out", default=None, help="the checkpoint (default: the training data folder's drafter.pt)")
@click.option("--block", type=int, default=8, show_default=True)
@click.option("--markov-rank", type=int, default=128, show_default=True)
@click.option("--anchors", type=int, default=24, show_default=True)
@click.option("--seqs-per-step", type=int, default=2, show_default=True)
@click.option("--lr", type=float, default=6e-4, show_default=True)
@click.option("--warmup", type=int, default=100, show_default=True)
@click.option("--gamma", type=float, default=4.0, show_default=True, help="position decay exp(-j/gamma)")
@click.option("--ce", type=float, default=0.5, show_default=True)
@click.option("--tv", type=float, default=0.5, show_default=True)
@click.option("--conf", type=float, default=0.2, show_default=True)
@click.option("--noise", type=float, default=0.03, show_default=True)
@click.option("--bf16", is_flag=True, help="matmuls in bfloat16 (autocast; ~2x faster where the CPU has AMX/AVX-512-BF16)")
@click.option("--log-every", type=int, default=25, show_default=True)
@click.option("--eval-every", type=int, default=500, show_default=True)
@click.option("--val-seqs", type=int, default=40, show_default=True)
def train_step(out, **options) -> None:
    """Train the drafter (needs torch)."""
    _run("train", {"out": out or _data("drafter.pt"), **options})


@train.command("export")
@click.option("--out", default=None, help="the weights file (default: the shipped weights' path)")
@click.option("--checkpoint", default=None, help="the checkpoint (default: the training data folder's drafter.pt)")
def export(out, checkpoint) -> None:
    """Export a checkpoint to the weights the backend loads."""
    from dspark.drafters.dspark.model import default_weights

    _run("export", {"out": out or str(default_weights()), "checkpoint": checkpoint or _data("drafter.pt")})
