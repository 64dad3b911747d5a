"""dspark's llama kernels (cython_ext/llama/llama_*.c via dspark.llm.kernel_runtime).

What a user of the target runtime relies on: logits close to a float64 forward pass of the same
GGUF; greedy identity of speculation (a row's logits bitwise the same whether decoded alone, in
a chain, in a tree, in a batch with other requests, or after the cache is compacted); the same
bits on every instruction set this CPU runs; and a clear error, never a crash, for bad input.
Small GGUFs (llm-core's test factory) cover every weight format (Q4_0, Q4_1, Q8_0, F16 run as
Q8_0), tied and untied heads; the real SmolLM2 (Q4_1) and Gemma 3 270M (Q4_K_M: Q4_K, Q6_K,
Q5_0 and Q8_0 blocks) cover the shipped models.
"""
from __future__ import annotations

import numpy as np
import pytest

from dspark._ext import llama as ext
from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.prompt import PREFILL_CHUNK, read_prompt
from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.errors import ConfigError, RequestError
from dspark.llm.evaluate import heldout_text, perplexity, runtime_logits
from dspark.llm.gguf_model import GGUFModel, installed_smollm2
from dspark.llm.importer import import_source
from dspark.llm.kernel_runtime import KernelRuntime
from dspark.llm.tokenizer import LlamaTokenizer
from dspark.paths import project_root
from tests.unit.llm.llm_gguf_factory import write_llama_gguf

ISAS = [isa for isa in ext.isa_info()["supported"] if isa in ext.isa_info()["compiled"]]

TINY = dict(n_layer=4, hidden=128, n_head=2, n_kv_head=1, ffn=192, vocab=270)  # head dim 64
FORMATS = ("Q4_0", "Q4_1", "Q8_0", "F16")  # F16 matrices run as Q8_0 (quantized at load)
# The shipped model's teacher-forced perplexity on the first 512 tokens of pydoc topic "class",
# as the retired ONNX Runtime graph measured it: the kernels land within 1%.
PPL_CLASS_512 = 20.749


def tiny_gguf(path, weight_type: str, head_type: str = "Q4_1", tied: bool = False) -> GGUFModel:
    return GGUFModel(write_llama_gguf(path, weight_type, head_type=head_type, tied=tied, **TINY))


def int8_blocks(x: np.ndarray) -> np.ndarray:
    """x through the kernels' activation quantization (int8 per block of 32, float32 scale)."""
    blocks = x.astype(np.float32).reshape(len(x), -1, 32)
    d = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    return (np.rint(blocks * inv) * d).reshape(len(x), -1).astype(np.float64)


def reference(model: GGUFModel, tokens, kernel_rounding: bool = False):
    """float64 forward pass from the dequantized weights: logits and the residual after each
    block. With ``kernel_rounding`` it rounds where the kernels do (int8 activations, fp16
    keys and values, float matrices as Q8_0), so what is left is float32 arithmetic."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    cfg = model.config

    class Weights(dict):  # dequantized when first used
        def __missing__(self, name):
            value = model.dequantized(name)
            if kernel_rounding and value.ndim == 2 and model.tensor_type(name) in ("F32", "F16", "BF16"):
                q8 = GGMLQuantizationType.Q8_0
                value = dequantize(quantize(value, q8), q8)
            self[name] = value.astype(np.float64)
            return self[name]

    w = Weights()
    act = int8_blocks if kernel_rounding else (lambda x: x)
    kv = (lambda x: x.astype(np.float16).astype(np.float64)) if kernel_rounding else (lambda x: x)
    t, hd, group = len(tokens), cfg.head_dim, cfg.group
    theta = np.arange(t)[:, None] * cfg.rope_base ** (-np.arange(0, hd, 2) / hd)
    cos, sin = np.cos(theta)[:, None], np.sin(theta)[:, None]

    def norm(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_eps) * weight

    def rope(x):
        out = np.empty_like(x)
        out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
        out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
        return out

    x = w["token_embd.weight"][np.asarray(tokens)]
    residuals = []
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        h = act(norm(x, w[p + "attn_norm.weight"]))
        q = rope((h @ w[p + "attn_q.weight"].T).reshape(t, cfg.n_head, hd))
        k = kv(rope((h @ w[p + "attn_k.weight"].T).reshape(t, cfg.n_kv_head, hd)))
        v = kv((h @ w[p + "attn_v.weight"].T).reshape(t, cfg.n_kv_head, hd))
        k, v = np.repeat(k, group, 1), np.repeat(v, group, 1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
        s = np.where(np.tri(t, dtype=bool), s, -np.inf)
        p_ = np.exp(s - s.max(-1, keepdims=True))
        att = np.einsum("hts,shd->thd", p_ / p_.sum(-1, keepdims=True), v).reshape(t, -1)
        x = x + act(att) @ w[p + "attn_output.weight"].T
        h = act(norm(x, w[p + "ffn_norm.weight"]))
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + act(gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
        residuals.append(x)
    head = w["token_embd.weight" if cfg.tied_embeddings else "output.weight"]
    return act(norm(x, w["output_norm.weight"])) @ head.T, residuals


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """Q4_1 blocks, an untied Q4_1 head over a vocabulary that is not a multiple of 16."""
    return tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "Q4_1")


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return KernelRuntime(tiny_model)


@pytest.fixture(scope="module")
def gemma_tiny(tmp_path_factory):
    """gemma3's pass (sliding window of 4 on five of six layers, NEOX RoPE, norms everywhere)."""
    path = write_llama_gguf(tmp_path_factory.mktemp("gguf") / "gemma.gguf", "Q4_1", head_type="Q8_0",
                            architecture="gemma3", n_layer=6, hidden=128, n_head=2, n_kv_head=1, ffn=192,
                            vocab=270, head_dim=64, sliding_window=4)
    return KernelRuntime(GGUFModel(path))


@pytest.fixture(scope="module")
def smol_gguf():
    return GGUFModel(installed_smollm2())


@pytest.fixture(scope="module")
def smol(smol_gguf):
    return KernelRuntime(smol_gguf)


@pytest.fixture(scope="module")
def gemma():
    """The demo's Gemma 3 270M Q4_K_M, its K-quant blocks run as stored."""
    return KernelRuntime(GGUFModel(import_source(project_root() / "model_repository/gemma_lm/1/model")))


def plain_decode(rt, prefix, tokens, start):
    """Logits of decoding ``tokens`` one by one after ``prefix`` (fresh cache)."""
    cache = rt.new_cache(64)
    rt.forward(cache, prefix, np.arange(len(prefix)))
    return np.concatenate([rt.forward(cache, [tok], [start + i]) for i, tok in enumerate(tokens)])


# -- numerics ------------------------------------------------------------------------------

def test_fp16_conversion_matches_numpy():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    values = bits.view(np.float16).astype(np.float32)
    finite = np.isfinite(values)
    assert np.array_equal(ext.half_values(bits)[finite], values[finite])
    assert np.all(np.isnan(ext.half_values(bits)[np.isnan(values)]))
    rng = np.random.default_rng(0)
    floats = np.concatenate([rng.standard_normal(20000) * 10.0 ** rng.integers(-9, 6, 20000),
                             [65504, 65519, 65520, 1e6, -1e6, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26,
                              6.1e-5, 0.0, -0.0]]).astype(np.float32)
    with np.errstate(over="ignore"):
        want = floats.astype(np.float16).view(np.uint16)
    assert np.array_equal(ext.half_bits(floats), want)


@pytest.mark.parametrize("weight_type, head_type, tied", [
    ("Q4_0", "Q8_0", True), ("Q4_1", "Q4_1", False), ("Q8_0", "Q4_0", False), ("F16", "Q8_0", True)])
def test_every_format_matches_float64_reference(tmp_path, weight_type, head_type, tied):
    """Each format's products, RoPE, attention, SwiGLU and the head: equal to a float64 pass
    that rounds where the kernels round, up to float32 arithmetic."""
    model = tiny_gguf(tmp_path / "m.gguf", weight_type, head_type, tied)
    rt = KernelRuntime(model)
    tokens = [1, 17, 150, 3, 99, 42, 7, 180, 64, 5]
    ref, residuals = reference(model, tokens, kernel_rounding=True)
    logits, taps = rt.forward(rt.new_cache(32), tokens, np.arange(len(tokens)), want_taps=True)
    assert logits.shape == (len(tokens), TINY["vocab"])
    assert np.abs(logits - ref).max() < 1e-3 * np.abs(ref).max()
    assert rt.tap_layers == (3,) and taps.shape == (len(tokens), TINY["hidden"])
    assert np.abs(taps - residuals[3]).max() < 1e-3 * np.abs(residuals[3]).max()


def test_smollm2_matches_float64_reference(smol, smol_gguf):
    """The shipped model against exact float64 arithmetic (no int8 activations, fp32 keys):
    argmax equal at nearly every position (llama.cpp against the same numpy pass correlates 0.9994)."""
    tokens = [1, 504, 3458, 314, 260, 4172, 282, 5479, 30, 378, 3172, 28, 18, 19, 216, 1116]
    ref, _ = reference(smol_gguf, tokens)
    logits = smol.forward(smol.new_cache(32), tokens, np.arange(len(tokens)))
    assert np.corrcoef(logits.ravel(), ref.ravel())[0, 1] > 0.999
    assert (logits.argmax(1) == ref.argmax(1)).mean() >= 0.85


def test_smollm2_perplexity_matches_the_stored_reference(smol, smol_gguf):
    tokens = LlamaTokenizer.from_gguf(smol_gguf).encode(heldout_text(("class",)))[:512]
    ppl = perplexity(runtime_logits(smol), tokens)
    assert abs(ppl - PPL_CLASS_512) < 0.01 * PPL_CLASS_512, ppl


@pytest.mark.parametrize("isa", ISAS)
def test_every_isa_gives_the_same_bits(tiny, isa):
    tokens, positions = [1, 17, 150, 3, 99, 42], np.arange(6)
    tiny.isa = "auto"
    want = tiny.forward(tiny.new_cache(16), tokens, positions)
    tiny.isa = isa
    try:
        assert tiny.isa == isa
        assert np.array_equal(tiny.forward(tiny.new_cache(16), tokens, positions), want)
    finally:
        tiny.isa = "auto"


@pytest.mark.parametrize("fixture", ["smol", "gemma"])
def test_real_models_isas_agree_bitwise(fixture, request):
    rt = request.getfixturevalue(fixture)
    tokens = [2, 504, 3458, 9, 77]
    want = rt.forward(rt.new_cache(8), tokens, np.arange(len(tokens)))
    for isa in ISAS:
        rt.isa = isa
        try:
            assert np.array_equal(rt.forward(rt.new_cache(8), tokens, np.arange(len(tokens))), want), isa
        finally:
            rt.isa = "auto"


def test_simd_override_and_bad_isa(monkeypatch, tiny_model):
    monkeypatch.setenv("DSPARK_SIMD", "scalar")
    assert KernelRuntime(tiny_model, threads=1).isa == "scalar"
    monkeypatch.setenv("DSPARK_SIMD", "sse9")
    with pytest.raises(ConfigError, match="DSPARK_SIMD=sse9: expected one of auto, scalar, avx2, avx512"):
        KernelRuntime(tiny_model)
    monkeypatch.delenv("DSPARK_SIMD")
    with pytest.raises(ConfigError, match="isa: sse9"):
        KernelRuntime(tiny_model, isa="sse9")


def test_hidden_isas_are_not_chosen_nor_forced(monkeypatch, tiny_model):
    """DSPARK_SIMD_HIDE narrows the llama kernels' choice as it does the fused kernel's."""
    monkeypatch.delenv("DSPARK_SIMD", raising=False)
    monkeypatch.setenv("DSPARK_SIMD_HIDE", "avx512,avx2")
    assert KernelRuntime(tiny_model, threads=1).isa == "scalar"
    assert ext.isa_info()["supported"] == ["scalar"]
    with pytest.raises(ConfigError, match="avx2: this CPU or OS cannot run the avx2 llama kernels"):
        KernelRuntime(tiny_model, isa="avx2")


# -- greedy identity: a row's logits do not depend on how it is computed ---------------------

@pytest.mark.parametrize("fixture", ["tiny", "gemma_tiny", "smol", "gemma"])
def test_plain_chain_tree_and_batch_rows_are_bitwise_equal(fixture, request):
    rt = request.getfixturevalue(fixture)
    prefix = [1, 9, 33, 120, 7, 64, 2, 88, 31]
    a, b1, b2, c1 = 15, 77, 101, 5
    start = len(prefix)
    plain_1 = plain_decode(rt, prefix, [a, b1, c1], start)
    plain_2 = plain_decode(rt, prefix, [a, b2], start)

    cache = rt.new_cache(64)
    rt.forward(cache, prefix, np.arange(start))
    chain = rt.forward(cache, [a, b1, c1], start + np.arange(3))
    assert np.array_equal(chain, plain_1)

    cache.truncate(start)  # a tree: a -> b1 -> c1 and a -> b2, rows [a, b1, b2, c1]
    tree_mask = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)
    tree = rt.forward(cache, [a, b1, b2, c1], start + np.array([0, 1, 1, 2]), tree_mask)
    assert np.array_equal(tree[[0, 1, 3]], plain_1)
    assert np.array_equal(tree[2], plain_2[1])

    # accept a, b2: compact the cache, then the next token decodes as if a, b2 were plain
    cache.keep_rows(start, np.array([0, 2]))
    nxt = rt.forward(cache, [c1], [start + 2])
    assert np.array_equal(nxt[0], plain_decode(rt, prefix, [a, b2, c1], start)[2])

    # two requests in one call: each as alone; only some rows' logits when asked
    other = rt.new_cache(64)
    rt.forward(other, prefix[:4], np.arange(4))
    first = rt.new_cache(64)
    rt.forward(first, prefix, np.arange(start))
    batched = rt.forward_batch([(first, [a, b1, c1], start + np.arange(3), None),
                                (other, [b2, a], [4, 5], None)])
    assert np.array_equal(batched[0], plain_1)
    assert np.array_equal(batched[1], plain_decode(rt, prefix[:4], [b2, a], 4))
    first.truncate(start)
    assert np.array_equal(rt.forward(first, [a, b1, c1], start + np.arange(3), logit_rows=[2]),
                          plain_1[2:])


def test_a_prompt_read_without_logits_leaves_the_same_cache_and_taps(tiny):
    """read_prompt skips the head's product on this runtime; what the next rounds see is
    unchanged: the same taps, the same cache, the next token's logits bit for bit."""
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, tiny.config.vocab, 150)]
    full = tiny.new_cache(256)
    logits, taps = tiny.forward(full, prompt[:-1], np.arange(len(prompt) - 1), want_taps=True)
    assert logits.shape[0] == len(prompt) - 1
    skipped = tiny.new_cache(256)
    read = read_prompt(tiny, skipped, prompt, want_taps=True)  # 3 chunks
    assert np.array_equal(read, taps) and skipped.length == len(prompt) - 1
    root = len(prompt) - 1
    assert np.array_equal(tiny.forward(skipped, prompt[-1:], [root]), tiny.forward(full, prompt[-1:], [root]))
    assert tiny.forward(tiny.new_cache(8), [1, 2], [0, 1], logit_rows=()).shape == (0, tiny.config.vocab)


def test_batched_requests_read_a_new_prompt_in_the_calls_of_their_rounds(tiny, monkeypatch):
    """With verification batched, a new request's prompt is read a chunk a call, without
    logits, in the calls that verify the running requests' rounds: every text is still its
    decoding alone, and calls carried both. The first request decodes alone on its own thread
    (no batched call) until the second arrives, then joins the loop."""
    calls = []
    batch = tiny.forward_batch

    def recorded(items, want_taps=False, skip_logits=()):
        calls.append((len(items), tuple(skip_logits), [len(item[1]) for item in items]))
        return batch(items, want_taps, skip_logits)

    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(0, TINY["vocab"], n)] for n in (3, 20, 150)]
    lengths = (200, 100, 30)  # the first two are still decoding while the third's prompt is read
    alone = SpeculativeEngine(tiny)
    expected = [[t for new in alone.generate(p, SamplingParams(max_tokens=n), SpeculativeParams("none"))
                 for t in new] for p, n in zip(prompts, lengths)]
    monkeypatch.setattr(tiny, "forward_batch", recorded)
    batched = SpeculativeEngine(tiny, batch_verification=True)
    streams = [batched.generate(p, SamplingParams(max_tokens=n), SpeculativeParams("none"))
               for p, n in zip(prompts, lengths)]
    got = [[next(streams[0])], [], []]
    got[0].append(next(streams[0]))
    assert not calls and batched.batcher._thread is None  # alone: its own calls, no loop
    got[1].append(next(streams[1]))  # read and decoded in the loop
    got[0].append(next(streams[0]))  # the first sees it and joins the loop
    got[2].append(next(streams[2]))  # its prompt rides with both rounds
    for out, s in zip(got, streams):
        out += list(s)
    batched.close()
    assert [[t for new in g for t in new] for g in got] == expected
    shared = [c for c in calls if c[1] and c[0] > 2]
    assert shared and all(c[2][c[1][0]] <= PREFILL_CHUNK for c in calls if c[1])
    # the prompts read in the loop, all but their roots
    assert sum(c[2][c[1][0]] for c in calls if c[1]) == sum(len(p) - 1 for p in prompts[1:])


def test_requests_coming_and_leaving_at_random_keep_their_texts(tiny):
    """Requests start alone or batched, hand over to the loop, and leave early at random, on
    several threads: each text is a prefix of its decoding alone (all of it when not left
    early), and no request is left counted as alone or batched."""
    import random
    import threading

    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, TINY["vocab"], n)] for n in (2, 9, 70)]
    sampling = SamplingParams(max_tokens=20)
    alone = SpeculativeEngine(tiny)
    expected = [[t for new in alone.generate(p, sampling, SpeculativeParams("none")) for t in new] for p in prompts]
    batched = SpeculativeEngine(tiny, batch_verification=True)
    wrong = []

    def client(seed):
        pick = random.Random(seed)
        for _ in range(8):
            i, leave_after = pick.randrange(len(prompts)), pick.choice([None, None, 1, 3])
            got, stream = [], batched.generate(prompts[i], sampling, SpeculativeParams("none"))
            for rounds, new in enumerate(stream, 1):
                got += new
                if rounds == leave_after:
                    stream.close()
                    break
            if got != expected[i][:len(got)] or (leave_after is None and got != expected[i]):
                wrong.append((i, got))

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    batched.close()
    assert not any(t.is_alive() for t in threads) and not wrong
    assert not batched.batcher._solo and batched.batcher._batched == 0


def test_past_visible_hides_cache_rows(tiny):
    """Hiding cached rows equals removing them: the same keys and values, in the same order."""
    cache = tiny.new_cache(32)
    tiny.forward(cache, [1, 9, 33, 120], np.arange(4))
    hidden = tiny.forward(cache, [7], [4], past_visible=np.array([[True, False, False, True]]))
    cache.keep_rows(0, np.array([0, 3]))
    assert np.array_equal(tiny.forward(cache, [7], [4]), hidden)


def test_project_and_head_subset(tiny):
    ids = np.array([199, 3, 150, 42, 0])
    subset = tiny.head_subset(ids)
    assert subset.n == 16  # padded to a tile
    hidden = np.random.default_rng(1).standard_normal((2, TINY["hidden"])).astype(np.float32)
    all_logits = tiny.project(hidden)
    assert np.array_equal(tiny.project(hidden, subset)[:, :len(ids)], all_logits[:, ids])


# -- hostile arguments: a clear error naming the argument, never a crash -----------------------

@pytest.mark.parametrize("call, field", [
    (lambda rt, c: rt.forward(c, [TINY["vocab"]], [0]), "tokens"),
    (lambda rt, c: rt.forward(c, [-1], [0]), "tokens"),
    (lambda rt, c: rt.forward(c, [1.5, 2], [0, 1]), "tokens"),
    (lambda rt, c: rt.forward(c, [[1, 2]], [0]), "tokens"),
    (lambda rt, c: rt.forward(c, [1, 2, 3], [0, 1]), "positions"),
    (lambda rt, c: rt.forward(c, [1], [-3]), "positions"),
    (lambda rt, c: rt.forward(c, [1], [2 ** 40]), "positions"),
    (lambda rt, c: rt.forward(c, [1, 2], [0, 1], np.ones((3, 3), bool)), "tree_mask"),
    (lambda rt, c: rt.forward(c, [1, 2], [0, 1], np.zeros((2, 2), bool)), "tree_mask"),
    (lambda rt, c: rt.forward(c, [1], [0], None, np.ones((1, 5), bool)), "past_visible"),
    (lambda rt, c: rt.forward(c, list(range(20)), np.arange(20)), "tokens"),  # context full
    (lambda rt, c: rt.forward(c, [1], [0], logit_rows=[1]), "logit_rows"),
    (lambda rt, c: rt.forward("cache", [1], [0]), "cache"),
    (lambda rt, c: rt.forward_batch([(c, [1], [0], None), (c, [2], [0], None)]), "items[1].cache"),
    (lambda rt, c: rt.project(np.zeros((2, 3), np.float32)), "hidden"),
    (lambda rt, c: rt.head_subset([TINY["vocab"]]), "vocab_ids"),
    (lambda rt, c: rt.new_cache(-4), "capacity"),
    (lambda rt, c: rt.new_cache(rt.config.ctx + 1), "capacity"),
])
def test_bad_arguments_raise_request_errors(tiny, call, field):
    cache = tiny.new_cache(16)
    with pytest.raises(RequestError) as err:
        call(tiny, cache)
    assert err.value.field == field
    assert cache.length == 0  # nothing half-written


def test_binding_refuses_foreign_caches_and_buffers(tiny, smol):
    """The extension itself checks what the runtime would: a cache of another model, wrong
    dtypes, short logits."""
    small, big = tiny.new_cache(16), smol.new_cache(16)
    mask = np.ones((1, 1), bool)
    logits = np.empty((1, tiny._model.head_columns), np.float32)
    cases = [
        ([(big.keys, big.values, 0, [1], [0], mask)], logits, "cache"),
        ([(small.keys.astype(np.float32), small.values, 0, [1], [0], mask)], logits, "cache"),
        ([(small.keys, small.values[:, :, :8], 0, [1], [0], mask)], logits, "cache"),
        ([(small.keys, small.values, 16, [1], [0], mask)], logits, "cache"),
        ([(small.keys, small.values, -1, [1], [0], mask)], logits, "cache"),
        ([(small.keys, small.values, 0, [1], [0], np.ones((1, 2), bool))], logits, "mask"),
        ([(small.keys, small.values, 0, [1], [0])], logits, "segments"),
        ([(small.keys, small.values, 0, [1], [0], mask)], np.empty((1, 3), np.float32), "logits"),
    ]
    for segments, out, field in cases:
        with pytest.raises(RequestError) as err:
            tiny._model.forward(segments, [0], out)
        assert err.value.field == field, segments
    good = [(small.keys, small.values, 0, [1], [0], mask)]
    for inputs in (np.zeros((2, tiny.config.hidden), np.float32), np.zeros((1, 3), np.float32),
                   np.zeros((1, tiny.config.hidden))):
        with pytest.raises(RequestError) as err:
            tiny._model.forward(good, [0], logits, inputs=inputs)
        assert err.value.field == "inputs"


def test_inputs_in_place_of_embeddings_give_the_tokens_logits(tiny):
    """A step fed hidden rows (a drafter's slots) computes what the same rows as tokens give."""
    tokens, positions = [3, 17, 40], [0, 1, 2]
    want = tiny.forward(tiny.new_cache(16), tokens, positions)
    cache = tiny.new_cache(16)
    logits = np.empty((3, tiny._model.head_columns), np.float32)
    tiny._model.forward([(cache.keys, cache.values, 0, [0, 0, 0], positions, np.tri(3, dtype=bool))],
                        [0, 1, 2], logits, inputs=tiny._model.embed(tokens))
    assert np.array_equal(logits[:, :tiny.config.vocab], want)


def test_concurrent_callers_get_their_own_results(tiny):
    """Requests on their own threads share one runtime: each gets what it would alone."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [[1, 9, 33, 120 + i, 7] for i in range(6)]

    def decode(prompt):
        cache = tiny.new_cache(32)
        out = [tiny.forward(cache, prompt, np.arange(len(prompt)))[-1]]
        for step in range(4):
            out.append(tiny.forward(cache, [int(out[-1].argmax())], [len(prompt) + step])[0])
        return np.stack(out)

    alone = [decode(p) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(decode, prompts))
    for a, b in zip(alone, together):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_1"])
def test_the_drafters_embedding_rows_are_the_ggufs_dequantized_rows(tmp_path, weight_type):
    """DSpark's anchor rows (dequantized per draft, Q8_0 directly) equal gguf's dequantization."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from dspark.drafters.dspark.model import gguf_embedding

    model = tiny_gguf(tmp_path / "m.gguf", weight_type, head_type=weight_type)
    ids = np.array([0, 7, TINY["vocab"] - 1, 7])
    want = dequantize(np.asarray(model.raw("token_embd.weight"))[ids],
                      GGMLQuantizationType[model.tensor_type("token_embd.weight")])
    got = gguf_embedding(model)(ids)
    assert got.dtype == np.float32 and np.array_equal(got, want.reshape(len(ids), -1))
