"""Build the speculative-decoding demo models from the committed weights (no torch, no download).

tools/weights/spec_{target,draft}.npz (fp16, made by tools/spec_train.py) become
model_repository/spec_target/1/model.onnx and spec_draft/1/model.onnx (graphs from
dspark.decoding.onnx_lm): the fast 5 M-parameter test fixture `spec_toy` (tests/spec_toy_repository)
reads them with the tokenizer tools/weights/spec_bpe.json.
Skips a model whose ONNX file is newer than its weights and the graph builder.
"""
from __future__ import annotations

from pathlib import Path

import onnx

from dspark.decoding.onnx_lm import build_lm_onnx, load_weights_npz

ROOT = Path(__file__).resolve().parent.parent
WEIGHTS = ROOT / "tools" / "weights"
REPOSITORY = ROOT / "model_repository"


def build(role: str) -> Path:
    source = WEIGHTS / f"spec_{role}.npz"
    out = REPOSITORY / f"spec_{role}" / "1" / "model.onnx"
    inputs = (source, ROOT / "dspark" / "decoding" / "onnx_lm.py")
    if out.exists() and out.stat().st_mtime >= max(p.stat().st_mtime for p in inputs):
        return out
    weights, cfg = load_weights_npz(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(build_lm_onnx(weights, cfg), str(out))
    return out


if __name__ == "__main__":
    for role in ("target", "draft"):
        print(f"built {build(role).relative_to(ROOT)}")
