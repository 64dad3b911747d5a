"""Build the demo ONNX models from seeded numpy weights (no download), into model_repository/.

feature_scaler: standardizes raw measurements, (x - mean) / std.
mlp_classifier: a 16 -> 32 -> 4 ReLU MLP with softmax, on standardized features.
The ensembles/scaled_classifier ensemble chains them. Version folders follow each modelspec.yaml.
"""
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dspark.repository.modelspec import SPEC_FILENAME, ModelSpec

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = ROOT / "model_repository"
FEATURES, HIDDEN, CLASSES = 16, 32, 4
OPSET = 17


def _batched(name: str, width: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", width])


def feature_scaler() -> onnx.ModelProto:
    mean = np.full(FEATURES, 10.0, dtype=np.float32)
    std = np.full(FEATURES, 2.5, dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("Sub", ["raw_features", "mean"], ["centered"]),
         helper.make_node("Div", ["centered", "std"], ["features"])],
        "feature_scaler",
        [_batched("raw_features", FEATURES)],
        [_batched("features", FEATURES)],
        [numpy_helper.from_array(mean, "mean"), numpy_helper.from_array(std, "std")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="dspark")


def mlp_classifier(seed: int = 2024) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    w1 = (rng.normal(size=(FEATURES, HIDDEN)) / np.sqrt(FEATURES)).astype(np.float32)
    b1 = rng.normal(scale=0.1, size=HIDDEN).astype(np.float32)
    w2 = (rng.normal(size=(HIDDEN, CLASSES)) / np.sqrt(HIDDEN)).astype(np.float32)
    b2 = rng.normal(scale=0.1, size=CLASSES).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["features", "w1", "b1"], ["hidden_linear"]),
         helper.make_node("Relu", ["hidden_linear"], ["hidden"]),
         helper.make_node("Gemm", ["hidden", "w2", "b2"], ["logits"]),
         helper.make_node("Softmax", ["logits"], ["probabilities"], axis=-1)],
        "mlp_classifier",
        [_batched("features", FEATURES)],
        [_batched("probabilities", CLASSES)],
        [numpy_helper.from_array(w, n) for w, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="dspark")


def write(model: onnx.ModelProto, name: str) -> Path:
    """Save into the folder that the model's spec records for its newest version."""
    onnx.checker.check_model(model)
    spec = ModelSpec.load(REPOSITORY / name / SPEC_FILENAME)
    path = REPOSITORY / name / str(spec.folder_of(spec.version)) / spec.artifact_name
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


if __name__ == "__main__":
    for builder, name in ((feature_scaler, "feature_scaler"), (mlp_classifier, "mlp_classifier")):
        print(f"built {write(builder(), name).relative_to(ROOT)}")
