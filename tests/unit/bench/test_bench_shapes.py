"""`dspark bench shapes` on cut-down shapes: the random-weight GGUF it writes loads on the kernels
as the shape it names, the bytes it reads per token are the file's, and a run fills every row."""
from __future__ import annotations

import numpy as np

from dspark.bench.shapes import SHAPES, Shape, bytes_per_token, run_shapes_bench, write_shape_gguf
from dspark.llm.gguf_model import GGUFModel
from dspark.llm.kernel_runtime import KernelRuntime

TARGET = Shape("tiny target", 2, 256, 512, 4, 2, 64, tied=False, vocab=512)
DRAFT = Shape("tiny draft", 1, 256, 512, 4, 2, 64, tied=True, vocab=512)


def test_the_written_gguf_is_the_shape_with_q4_k_m_types(tmp_path):
    path = write_shape_gguf(TARGET, tmp_path / "t.gguf")
    model = GGUFModel(path)
    cfg = model.config
    assert (cfg.n_layer, cfg.hidden, cfg.vocab) == (2, 256, 512)
    types = cfg.weight_types
    assert "Q4_K" in "/".join(types.values()) and "Q6_K" in "/".join(types.values())
    runtime = KernelRuntime(path, threads=1, max_context=64)
    out = runtime.forward(runtime.new_cache(), [5, 6, 7], np.arange(3))
    assert out.shape == (3, 512) and np.isfinite(out).all()
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    assert bytes_per_token(TARGET) == sum(tensors.values()) - tensors["token_embd.weight"]


def test_the_real_shapes_are_llamas():
    assert (SHAPES["8b"].n_layer, SHAPES["8b"].hidden, SHAPES["8b"].ffn) == (32, 4096, 14336)
    assert 4.0 < bytes_per_token(SHAPES["8b"]) / 2**30 < 5.0  # a Q4_K_M 8B reads ~4.5 GiB a token
    assert 0.6 < bytes_per_token(SHAPES["1b"]) / 2**30 < 0.9


def test_a_run_fills_the_shape_and_pair_rows(tmp_path):
    result = run_shapes_bench(["t"], tmp_path, threads=1, rows_list=(1, 2, 5), repeats=2, tokens=8, peer=False,
                              log=lambda _: None, shapes={"t": TARGET, "d": DRAFT}, draft_of={"t": "d"},
                              bandwidth_mib=64)
    shape_row, pair_row = result.rows
    assert shape_row["shape"] == "tiny target" and shape_row["decode_tokens_per_s"] > 0
    assert shape_row["ceiling_tokens_per_s"] > 0 and shape_row["rows_5"] > 0
    assert pair_row["pair_step_ms"] > 0 and pair_row["pair_parts_ms"] > 0 and pair_row["accepted_per_step"] >= 0
    assert "random weights" in result.notes[-1] and "tiny target" in result.table()
