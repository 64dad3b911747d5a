"""Train the byte-level BPE of the speculative LM pair (needs the ``tokenizers`` package,
a training-only extra) and write it as JSON for ``dspark.decoding.tokenizer.BPETokenizer``.

Bytes are mapped to Latin-1 characters so the trainer sees 256 symbols; lines are pre-split so
no merge crosses a newline (the runtime encoder relies on that).

    python tools/spec_tokenizer.py --vocab 1024 --out tools/weights/spec_bpe.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dspark.decoding.tokenizer import BPETokenizer  # noqa: E402
from dspark.decoding.corpus import split_documents, to_bytes  # noqa: E402


def main() -> None:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    train, _ = split_documents()
    text = to_bytes(train).decode("latin-1")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("\n"), behavior="merged_with_previous")
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, show_progress=False, min_frequency=2,
                                  initial_alphabet=[chr(i) for i in range(256)],
                                  max_token_length=16)
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    vocab = tok.get_vocab()
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    assert [i for _, i in by_id] == list(range(len(by_id)))
    tokens = [s.encode("latin-1") for s, _ in by_id]
    model = __import__("json").loads(tok.to_str())["model"]
    merges = []
    for m in model["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        merges.append((vocab[a], vocab[b]))
    bpe = BPETokenizer(tokens, merges)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(bpe.to_json())
    sample = to_bytes(train[:40])
    print(f"vocab={bpe.vocab_size} merges={len(merges)} "
          f"bytes/token={len(sample) / len(bpe.encode(sample)):.2f} -> {args.out}")


if __name__ == "__main__":
    main()
