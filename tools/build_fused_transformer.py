"""Build the fused_transformer demo: weights from numpy's RNG (no download) into
model_repository/fused_transformer/1/weights.npz, and the same network as ONNX into
model_repository/fused_transformer_onnx/1/model.onnx (served by the onnx backend, which
the integration test compares the fused backend against)."""
from pathlib import Path

import onnx

from dspark.runtimes.fused_transformer import TransformerConfig, make_weights, save_weights, to_onnx

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = ROOT / "model_repository"
SEED = 2024


def main() -> None:
    config = TransformerConfig()
    weights = make_weights(config, seed=SEED)
    fused_dir = REPOSITORY / "fused_transformer" / "1"
    onnx_dir = REPOSITORY / "fused_transformer_onnx" / "1"
    fused_dir.mkdir(parents=True, exist_ok=True)
    onnx_dir.mkdir(parents=True, exist_ok=True)
    save_weights(fused_dir / "weights.npz", config, weights)
    model = to_onnx(config, weights)
    onnx.checker.check_model(model)
    onnx.save(model, onnx_dir / "model.onnx")
    print(f"wrote {fused_dir / 'weights.npz'} and {onnx_dir / 'model.onnx'} ({config})")


if __name__ == "__main__":
    main()
