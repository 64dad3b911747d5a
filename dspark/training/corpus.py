"""Text corpus for the speculative-decoding LM pair: text every CPython install carries.

Prose comes from ``pydoc_data.topics`` (the reference manual's topic pages) and code from
the standard library's own ``.py`` sources. The split is by document (a stable hash of its
name), so held-out documents never appear in training; the benchmark draws its prompts from
the held-out split too.
"""
from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELDOUT_PERCENT = 5
_SKIP_PARTS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass
class Document:
    name: str
    kind: str  # "prose" | "code"
    text: str


def _is_heldout(name: str) -> bool:
    digest = hashlib.sha256(name.encode()).digest()
    return digest[0] % 100 < HELDOUT_PERCENT


def prose_documents() -> list[Document]:
    import pydoc_data.topics as topics

    return [Document(f"topic:{key}", "prose", text) for key, text in sorted(topics.topics.items())]


def code_documents() -> list[Document]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if _SKIP_PARTS & set(rel.parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        docs.append(Document(f"stdlib:{rel.as_posix()}", "code", text))
    return docs


def split_documents() -> tuple[list[Document], list[Document]]:
    """(train, heldout) over prose and code."""
    train, heldout = [], []
    for doc in prose_documents() + code_documents():
        (heldout if _is_heldout(doc.name) else train).append(doc)
    return train, heldout


def to_bytes(docs: list[Document]) -> bytes:
    # Documents are separated by a NUL byte so the model learns document boundaries.
    return b"\0".join(d.text.encode("utf-8") for d in docs)


if __name__ == "__main__":  # corpus sizes per split
    train, heldout = split_documents()
    for name, docs in (("train", train), ("heldout", heldout)):
        for kind in ("prose", "code"):
            sel = [d for d in docs if d.kind == kind]
            print(f"{name:8s} {kind:6s} docs={len(sel):5d} bytes={len(to_bytes(sel)):,}")
