"""The fused transformer engine against the same network in ONNX Runtime, and its input checks."""
import numpy as np
import onnxruntime as ort
import pytest

from dspark.runtimes.fused_transformer import (
    INPUT_NAME,
    FusedTransformer,
    RequestError,
    TransformerConfig,
    make_weights,
    save_weights,
    to_onnx,
)
from dspark.bench.micro.pool_trace import replay, serving_trace

CONFIG = TransformerConfig(vocab_size=100, max_positions=32, d_model=64, n_heads=4, d_ff=160, n_layers=2)


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ft") / "weights.npz"
    weights = make_weights(CONFIG, seed=7)
    save_weights(path, CONFIG, weights)
    session = ort.InferenceSession(to_onnx(CONFIG, weights).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return path, session


@pytest.mark.parametrize("use_pool", [True, False])
def test_matches_onnx_runtime(weights_file, use_pool):
    path, session = weights_file
    engine = FusedTransformer.load(path, use_pool=use_pool)
    ids = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (3, 19))
    ours = engine.forward(ids)
    theirs = session.run(None, {INPUT_NAME: ids})[0]
    assert ours.shape == (3, 19, CONFIG.d_model) and ours.dtype == np.float32
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() < 1e-4


def test_activations_come_from_the_pool_and_go_back(weights_file):
    engine = FusedTransformer.load(weights_file[0])
    held = engine.pool.stats().bytes_in_use  # the weights
    engine.forward(np.zeros((2, 8), np.int64))
    stats = engine.pool.stats()
    assert stats.bytes_in_use == held and stats.peak_bytes_in_use > held


@pytest.mark.parametrize("ids,match", [
    (np.zeros((2, 4), np.float32), "INPUT_IDS: expected integer token ids"),
    (np.zeros((4,), np.int64), r"INPUT_IDS: expected shape \[batch, seq\]"),
    (np.zeros((1, 33), np.int64), "INPUT_IDS: sequence length 33 is outside 1..32"),
    (np.full((1, 3), 100, np.int64), "INPUT_IDS: token ids must be in 0..99"),
])
def test_bad_input_names_the_tensor(weights_file, ids, match):
    engine = FusedTransformer.load(weights_file[0], use_pool=False)
    with pytest.raises(RequestError, match=match):
        engine.forward(ids)


def test_serving_trace_is_well_formed_and_replays():
    ops = serving_trace(steps=200, seed=1)
    live = set()
    for op in ops:
        if op.kind == "alloc":
            assert op.key not in live and op.nbytes > 0
            live.add(op.key)
        else:
            live.remove(op.key)
    assert live  # it stops mid-flight, with caches still held
    result = replay("np.empty", ops, lambda n: np.empty(n, np.uint8))
    assert result.allocs == sum(op.kind == "alloc" for op in ops) and result.failed == 0
