"""The architectures and weight types beside plain llama, on small synthetic GGUFs: what a user
importing a Qwen, Llama 3 or Gemma 3 K-quant file relies on.

* every block type runs as stated (Q4_0/Q4_1/Q8_0/Q5_0 and the K-quants Q4_K/Q5_K/Q6_K as
  stored, the others through Q8_0) and multiplies the same on every instruction set; the K-quant
  products equal gguf's own dequantization against the int8 activations, block by block, on
  random super-blocks and on the real Gemma 3 file;
* each architecture's logits equal a float64 forward pass written from the model's definition
  (rounded where the kernels round), the same bits on every instruction set;
* a file dspark cannot run, or a hostile one, is refused in well under a second with one line
  naming the file and the field.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from dspark._ext import llama as ext
from dspark.errors import ConfigError
from dspark.llm.gguf_model import GGUFModel
from dspark.llm import kernel_runtime
from dspark.llm.importer import import_source
from dspark.llm.kernel_runtime import KernelRuntime, gather_columns, pack_blocks, pack_k_blocks, pack_matrix
from dspark.paths import project_root
from dspark.llm.reference import int8_blocks, kernel_matrix, reference_logits
from tests.unit.llm.llm_gguf_factory import K_QUANT_BYTES, random_k_blocks, write_llama_gguf

ISAS = [isa for isa in ext.isa_info()["supported"] if isa in ext.isa_info()["compiled"]]
WIDE = dict(hidden=256, ffn=512, n_head=4, n_kv_head=2, vocab=288)  # rows of 256: K-quant super-blocks


def on_every_isa(rt, run):
    """run() on each instruction set this CPU has; asserts the results are the same bits."""
    results = []
    try:
        for isa in ISAS:
            rt.isa = isa
            results.append(run())
    finally:
        rt.isa = "auto"
    for isa, result in zip(ISAS[1:], results[1:]):
        assert np.array_equal(result, results[0]), f"{isa} differs from {ISAS[0]}"
    return results[0]


# -- blocks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, packed_bytes", [("Q5_0", 352), ("Q5_1", 384)])
def test_q5_blocks_are_held_as_stored(wide_rt, kind, packed_bytes):
    """Q5_0 and Q5_1 run on their own kernels: 22 / 24 bytes per 32 weights in the GGUF, 352 /
    384 per 16 x 32 packed (the nibbles, the fifth bits' plane, the scales and Q5_1's offsets),
    no conversion; every product equals gguf's dequantization against the int8 activations,
    the same bits on every instruction set."""
    rng = np.random.default_rng(0)
    raw = quantize(rng.standard_normal((40, 256)).astype(np.float32) + 0.3, GGMLQuantizationType[kind])
    packed = pack_blocks(raw, kind, 40, 256)
    assert packed.fmt == kind and packed.data.nbytes == 3 * 8 * packed_bytes
    weights = dequantize(raw, GGMLQuantizationType[kind]).astype(np.float64)
    for rows in (1, 5, 11):
        x = rng.standard_normal((rows, 256)).astype(np.float32)
        got = on_every_isa(wide_rt, lambda: wide_rt.project(x, head=packed, norm=False))
        act = int8_blocks(x)
        assert np.all(np.abs(got[:, :40] - act @ weights.T) <= 1e-6 * (np.abs(act) @ np.abs(weights).T) + 1e-30)
        assert np.all(got[:, 40:] == 0)


K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
# packed bytes per 16 columns x 256 inputs: the GGUF's 144 / 176 / 210 per column and super-block,
# plus, for Q4_K/Q5_K, their 12 bytes of six-bit scales and mins held as 16 whole bytes
K_PACKED_BYTES = {"Q4_K": 16 * 148, "Q5_K": 16 * 180, "Q6_K": 16 * 210}


@pytest.fixture(scope="module")
def wide_rt(tmp_path_factory):
    """A runtime of hidden size 256 whose project() multiplies any [n, 256] packed matrix."""
    path = write_llama_gguf(tmp_path_factory.mktemp("k") / "m.gguf", "Q8_0", head_type="Q8_0", **WIDE)
    return KernelRuntime(GGUFModel(path), threads=1)


@pytest.mark.parametrize("kind", K_TYPES)
def test_k_quant_blocks_are_held_as_stored(kind):
    raw = random_k_blocks(np.random.default_rng(1), kind, (48, 512))
    packed = pack_k_blocks(raw, kind, 48, 512)
    assert packed.fmt == kind and packed.data.nbytes == 3 * 2 * K_PACKED_BYTES[kind]
    assert raw.nbytes == 48 * 2 * K_QUANT_BYTES[kind]


@pytest.mark.parametrize("kind", K_TYPES)
def test_k_quant_products_equal_gguf_dequantization_block_by_block(wide_rt, kind):
    """One super-block per output (256 inputs): every output of every row count (the kernels
    block rows by up to 4 / 8) equals int8 activations times gguf's dequantized weights up to
    float32 rounding of its 256 terms, and is the same bits on every instruction set."""
    rng = np.random.default_rng(5)
    raw = random_k_blocks(rng, kind, (40, 256))  # 40 columns: the last tile padded
    weights = dequantize(raw, GGMLQuantizationType[kind]).astype(np.float64)
    packed = pack_k_blocks(raw, kind, 40, 256)
    for rows in (1, 3, 8, 11):
        x = (rng.standard_normal((rows, 256)) * rng.uniform(0.1, 10, (rows, 1))).astype(np.float32)
        got = on_every_isa(wide_rt, lambda: wide_rt.project(x, head=packed, norm=False))
        assert np.all(got[:, 40:] == 0)  # padding columns
        act = int8_blocks(x)
        want, bound = act @ weights.T, np.abs(act) @ np.abs(weights).T
        assert np.all(np.abs(got[:, :40] - want) <= 1e-6 * bound + 1e-30), (kind, rows)


@pytest.mark.parametrize("kind", K_TYPES)
def test_k_quant_embedding_rows_and_column_subsets(tmp_path, kind):
    """A K-quant embedding's rows are gguf's dequantized rows bit for bit, and a head restricted
    to some vocabulary ids (a drafter's) gives those ids' logits bit for bit."""
    model = GGUFModel(write_llama_gguf(tmp_path / "m.gguf", kind, head_type=kind, tied=True, **WIDE))
    rt = KernelRuntime(model, threads=1)
    assert rt.weights["embed"].fmt == kind and rt.weights["blk.0.ffn_up"].fmt == kind
    ids = np.array([0, 5, 17, WIDE["vocab"] - 1])
    want = dequantize(np.asarray(model.raw("token_embd.weight"))[ids], GGMLQuantizationType[kind])
    assert np.array_equal(rt._model.embed(ids), want.reshape(len(ids), -1))
    hidden = np.random.default_rng(2).standard_normal((3, WIDE["hidden"])).astype(np.float32)
    full = rt.project(hidden)
    assert np.array_equal(rt.project(hidden, head=rt.head_subset(ids))[:, :len(ids)], full[:, ids])


@pytest.mark.parametrize("kind", ("Q8_0", "Q5_0") + K_TYPES)
def test_a_matrix_packed_in_chunks_is_the_same_bytes(tmp_path, monkeypatch, kind):
    """Large matrices (a 262144-row head) are packed a chunk of rows at a time; the result is
    the whole matrix packed at once, also for a drafter's vocabulary subset (143 rows) whose
    last chunk ends in a part tile."""
    model = GGUFModel(write_llama_gguf(tmp_path / "m.gguf", kind, head_type=kind, tied=True, **WIDE))
    whole = pack_matrix(model, "token_embd.weight")
    ids = np.arange(3, WIDE["vocab"], 2)
    subset = pack_matrix(model, "token_embd.weight", ids)
    monkeypatch.setattr(kernel_runtime, "PACK_CHUNK_ROWS", 32)
    assert np.array_equal(pack_matrix(model, "token_embd.weight").data, whole.data)
    assert np.array_equal(pack_matrix(model, "token_embd.weight", ids).data, subset.data)
    assert whole.n == 288 and subset.n == 144


@pytest.fixture(scope="module")
def gemma_gguf():
    return GGUFModel(import_source(project_root() / "model_repository/gemma_lm/1/model"))


def test_the_real_gemma_files_k_quant_matrices_equal_gguf_dequantization(gemma_gguf, tmp_path):
    """Gemma 3 270M Q4_K_M holds Q4_K and Q6_K matrices (beside Q5_0/Q8_0): each kept as stored,
    its products equal gguf's dequantization against the int8 activations, the same bits on
    every instruction set."""
    model = gemma_gguf
    kinds = {}
    for i in range(model.config.n_layer):
        for matrix in ("attn_output", "ffn_down"):
            kinds.setdefault(model.tensor_type(f"blk.{i}.{matrix}.weight"), f"blk.{i}.{matrix}.weight")
    assert {"Q4_K", "Q6_K"} <= set(kinds), kinds
    rng = np.random.default_rng(4)
    for kind in ("Q4_K", "Q6_K"):
        name = kinds[kind]
        n, k = model.shape(name)
        packed = pack_matrix(model, name)
        assert packed.fmt == kind
        # project() multiplies matrices of the model's hidden size: a small model of hidden size k
        rt = KernelRuntime(GGUFModel(write_llama_gguf(tmp_path / f"{k}.gguf", "Q8_0", n_layer=1, hidden=k,
                                                      ffn=256, n_head=k // 128, n_kv_head=1, vocab=32)), threads=1)
        x = rng.standard_normal((4, k)).astype(np.float32)
        got = on_every_isa(rt, lambda: rt.project(x, head=packed, norm=False))[:, :n]
        act, weights = int8_blocks(x), model.dequantized(name).astype(np.float64)
        assert np.all(np.abs(got - act @ weights.T) <= 1e-6 * (np.abs(act) @ np.abs(weights).T) + 1e-30), name


@pytest.mark.parametrize("weight_type", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16"])
def test_products_of_every_type_on_every_isa(tmp_path, weight_type):
    """x @ W.T for a GGUF matrix of each type: int8 activations against the blocks as the kernels
    hold them, equal to float64 up to float32 sums, the same bits on every instruction set."""
    model = GGUFModel(write_llama_gguf(tmp_path / "m.gguf", weight_type, head_type="Q8_0", **WIDE))
    rt = KernelRuntime(model, threads=1)
    for name in ("blk.0.ffn_up.weight", "blk.1.attn_output.weight"):  # inputs of the hidden size
        matrix = pack_matrix(model, name)
        x = np.random.default_rng(3).standard_normal((5, model.shape(name)[1])).astype(np.float32)
        got = on_every_isa(rt, lambda: rt.project(x, head=matrix, norm=False))
        want = int8_blocks(x) @ kernel_matrix(model, name).T
        got = got[:, :want.shape[1]]  # the packed matrix has rows padded to 16
        assert np.abs(got - want).max() < 1e-4 * np.abs(want).max(), name
        exact = x.astype(np.float64) @ model.dequantized(name).T.astype(np.float64)
        assert np.abs(got - exact).max() < 0.05 * np.abs(exact).max(), name


# -- architectures ---------------------------------------------------------------------------

ARCHS = [("llama", "Q4_K", dict(rope_freqs=True)),  # Llama 3.x: RoPE frequency factors
         ("qwen2", "Q5_0", {}),                      # q/k/v biases, NEOX RoPE
         ("qwen3", "Q6_K", {}),                      # per-head q/k norms
         ("gemma3", "Q4_K", dict(n_layer=6, n_head=4, n_kv_head=1, head_dim=128, sliding_window=5))]


@pytest.fixture(scope="module", params=ARCHS, ids=[a[0] for a in ARCHS])
def arch_model(request, tmp_path_factory):
    arch, weight_type, extra = request.param
    path = write_llama_gguf(tmp_path_factory.mktemp(arch) / f"{arch}.gguf", weight_type, head_type="Q8_0",
                            architecture=arch, **{**WIDE, **extra})
    model = GGUFModel(path)
    return model, KernelRuntime(model)


TOKENS = [int(t) for t in np.random.default_rng(7).integers(0, WIDE["vocab"], 20)]


def test_each_architecture_matches_its_float64_reference(arch_model):
    model, rt = arch_model
    logits = on_every_isa(rt, lambda: rt.forward(rt.new_cache(32), TOKENS, np.arange(len(TOKENS))))
    rounded, _ = reference_logits(model, TOKENS, kernel_rounding=True)
    # up to float32 sums, and an int8 activation landing on the other side of a rounding step
    assert np.abs(logits - rounded).max() < 0.03 * np.abs(rounded).max()
    exact, _ = reference_logits(model, TOKENS)
    assert (logits.argmax(1) == exact.argmax(1)).mean() >= 0.9


def test_each_architectures_switches_change_the_result(arch_model, monkeypatch):
    """The reference with plain llama's pass is far from the runtime's: the comparison above
    could not pass with an architecture's feature left out."""
    model, rt = arch_model
    logits = rt.forward(rt.new_cache(32), TOKENS, np.arange(len(TOKENS)))
    plain = model.config.__class__(**{**model.config.__dict__, "architecture": "llama"})
    monkeypatch.setattr(model, "config", plain)
    if model.has("rope_freqs.weight"):
        monkeypatch.setattr(model, "has", lambda name: False)
    other, _ = reference_logits(model, TOKENS, kernel_rounding=True)
    assert np.abs(logits - other).max() > 0.1 * np.abs(other).max()


def test_gemma3_sliding_window_hides_old_positions(tmp_path):
    """Decoded one token at a time past the window, the logits equal one pass over the sequence,
    and a token beyond the window of every layer changes nothing in the sliding layers."""
    path = write_llama_gguf(tmp_path / "g.gguf", "Q8_0", architecture="gemma3", n_layer=2, hidden=64,
                            ffn=96, n_head=1, n_kv_head=1, head_dim=64, vocab=288, sliding_window=3,
                            metadata={})
    model = GGUFModel(path)
    assert [model.config.layer_window(i) for i in range(6)] == [3, 3, 3, 3, 3, 0]
    rt = KernelRuntime(model)
    tokens = [5, 9, 200, 17, 33, 140, 8]
    whole = rt.forward(rt.new_cache(16), tokens, np.arange(len(tokens)))
    cache = rt.new_cache(16)
    steps = np.concatenate([rt.forward(cache, [t], [i]) for i, t in enumerate(tokens)])
    assert np.array_equal(steps, whole)
    # both layers slide (n_layer 2 < the period 6): the first token is out of the last row's view
    changed = rt.forward(rt.new_cache(16), [77] + tokens[1:], np.arange(len(tokens)))
    assert np.array_equal(changed[-1], whole[-1]) and not np.array_equal(changed[2], whole[2])


# -- refusals --------------------------------------------------------------------------------

REFUSALS = [
    (dict(architecture="phi3"), "general.architecture", "found 'phi3'"),
    (dict(weight_type="Q2_K"), "blk.0.attn_k.weight", "weight type Q2_K is not supported"),
    (dict(metadata={"block_count": 2_000_000}), "llama.block_count", "found 2000000"),
    (dict(metadata={"context_length": 2 ** 32 - 1}), "llama.context_length", "found 4294967295"),
    (dict(metadata={"context_length": 0}), "llama.context_length", "found 0"),
    (dict(metadata={"attention.head_count": 0}), "llama.attention.head_count", "found 0"),
    (dict(metadata={"attention.layer_norm_rms_epsilon": float("nan")}), "layer_norm_rms_epsilon", "finite positive"),
    (dict(metadata={"tokenizer.ggml.bos_token_id": 10 ** 6}), "tokenizer.ggml.bos_token_id", "found 1000000"),
    (dict(metadata={"embedding_length": 100}), "llama.embedding_length", "token_embd.weight has 256"),
    (dict(metadata={"rope.scaling.type": "yarn"}), "llama.rope.scaling.type", "'yarn'"),
    (dict(architecture="gemma3", metadata={"final_logit_softcapping": 30.0}), "gemma3.final_logit_softcapping",
     "soft-capping"),
    (dict(extra_tensor="blk.0.attn_q.bias"), "blk.0.attn_q.bias", "does not use"),
]


@pytest.mark.parametrize("kwargs,field,found", REFUSALS, ids=[r[1] for r in REFUSALS])
def test_refuses_with_one_line_naming_the_field(tmp_path, kwargs, field, found):
    path = write_llama_gguf(tmp_path / "bad.gguf", **{**WIDE, **kwargs})
    start = time.perf_counter()
    with pytest.raises(ConfigError) as error:
        GGUFModel(path)
    assert time.perf_counter() - start < 1.0
    message = str(error.value)
    assert "\n" not in message and str(path) in message and field in message and found in message, message


@pytest.mark.parametrize("cut", [10, 100, 2000, -1000])
def test_a_truncated_file_is_refused(tmp_path, cut):
    whole = write_llama_gguf(tmp_path / "m.gguf", **WIDE).read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[:cut])
    with pytest.raises(ConfigError, match="not a readable GGUF file|run past the end") as error:
        GGUFModel(path)
    assert str(path) in str(error.value)


def test_huge_counts_are_refused_before_any_loop(tmp_path):
    """A header claiming 2**40 metadata entries, or a 2**40-string array, is refused at once."""
    import struct

    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 2 ** 40) + b"\0" * 64)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="cannot fit"):
        GGUFModel(path)
    key = b"tokenizer.ggml.tokens"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<IIQ", 9, 8, 2 ** 40) + b"\0" * 64)
    with pytest.raises(ConfigError, match="2\\*\\*40|1099511627776 strings run past the end"):
        GGUFModel(path)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("merges,found", [(["Ġ zzz"], "not usable with tokenizer.ggml.tokens"),
                                          (["nospace"], "not two tokens separated by one space")])
def test_bad_merges_are_refused_naming_the_field(tmp_path, merges, found):
    from dspark.llm.importer import import_gguf

    path = write_llama_gguf(tmp_path / "m.gguf", **WIDE, metadata={"tokenizer.ggml.merges": merges})
    with pytest.raises(ConfigError) as error:
        import_gguf(path, tmp_path / "out")
    message = str(error.value)
    assert message.startswith(f"{path}: tokenizer.ggml.merges") and found in message, message
    assert not (tmp_path / "out").exists()


def test_a_misaligned_tensor_offset_is_refused_naming_the_tensor(tmp_path):
    """GGUF aligns each tensor's data to general.alignment; an offset 4 bytes off read the
    tensor from the wrong bytes, imported and produced garbage."""
    import struct

    path = write_llama_gguf(tmp_path / "m.gguf", **WIDE)
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    at += 4 + 8 * n_dims + 4  # past the dimensions and the type: the offset
    struct.pack_into("<Q", data, at, struct.unpack_from("<Q", data, at)[0] + 4)
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError) as error:
        GGUFModel(path)
    assert str(error.value).startswith(f"{path}: blk.0.attn_q.weight: data offset ")
    assert "is not a multiple of general.alignment (32)" in str(error.value)


def test_the_import_says_which_float_weights_run_as_q8_0(tmp_path):
    from click.testing import CliRunner

    from dspark.cli.main import cli

    path = write_llama_gguf(tmp_path / "m.gguf", "BF16", "Q8_0", **WIDE)
    assert GGUFModel(path).requantized == {"BF16": 7 * 3}
    result = CliRunner().invoke(cli, ["llm", "import", str(path), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert f"note: {7 * 3} BF16 weight matrices run as Q8_0 blocks" in result.output
    quantized = CliRunner().invoke(cli, ["llm", "import", str(write_llama_gguf(tmp_path / "q.gguf", "Q4_0", **WIDE)),
                                         str(tmp_path / "q")])
    assert quantized.exit_code == 0 and "note:" not in quantized.output
