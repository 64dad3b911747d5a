"""The LM graph: matches a numpy reference, and a row's logits are bit-identical however the
tokens are batched (one at a time, in chunks, or as a tree) - what greedy equality rests on."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dspark.runtimes.toy_lm.runtime import KernelLM, OnnxLM
from dspark.runtimes.toy_lm.graph import LMConfig, alibi_slopes, build_lm_onnx, random_weights

CFG = LMConfig(n_layer=2, d_model=32, n_head=2, vocab=24, ctx=96)


@pytest.fixture(scope="module", params=[1, 2], ids=["1thread", "2threads"])
def lm(request):
    weights = random_weights(CFG, seed=3)
    return OnnxLM(build_lm_onnx(weights, CFG), threads=request.param), weights


def reference_logits(weights, cfg: LMConfig, tokens) -> np.ndarray:
    """Plain numpy forward pass over the whole sequence (causal, ALiBi)."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    t, h, dh = len(tokens), cfg.n_head, cfg.head_dim

    def ln(x, g, b):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b

    x = w["tok_emb"][tokens]
    pos = np.arange(t)
    bias = -alibi_slopes(h)[:, None, None] * (pos[:, None] - pos[None, :])
    causal = pos[:, None] >= pos[None, :]
    for i in range(cfg.n_layer):
        p = f"h{i}."
        q, k, v = np.split(ln(x, w[p + "ln1.w"], w[p + "ln1.b"]) @ w[p + "qkv.w"] + w[p + "qkv.b"], 3, -1)
        q, k, v = (z.reshape(t, h, dh).transpose(1, 0, 2) for z in (q, k, v))
        s = np.where(causal, q @ k.transpose(0, 2, 1) / np.sqrt(dh) + bias, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + (a @ v).transpose(1, 0, 2).reshape(t, -1) @ w[p + "proj.w"] + w[p + "proj.b"]
        m = ln(x, w[p + "ln2.w"], w[p + "ln2.b"]) @ w[p + "fc.w"] + w[p + "fc.b"]
        m = 0.5 * m * (1 + np.tanh(np.sqrt(2 / np.pi) * (m + 0.044715 * m ** 3)))
        x = x + m @ w[p + "fc_proj.w"] + w[p + "fc_proj.b"]
    return ln(x, w["lnf.w"], w["lnf.b"]) @ w["tok_emb"].T


def one_at_a_time(model: OnnxLM, tokens) -> np.ndarray:
    cache = model.new_cache()
    return np.stack([model.forward(cache, [tok], [i])[0] for i, tok in enumerate(tokens)])


def test_graph_matches_numpy_reference(lm):
    model, weights = lm
    tokens = np.random.default_rng(0).integers(0, CFG.vocab, 40)
    np.testing.assert_allclose(one_at_a_time(model, tokens), reference_logits(weights, CFG, tokens),
                               rtol=1e-4, atol=1e-4)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), length=st.integers(2, 70), chunk=st.integers(2, 17))
def test_chunked_rows_are_bit_identical_to_single_steps(lm, seed, length, chunk):
    model, _ = lm
    tokens = np.random.default_rng(seed).integers(0, CFG.vocab, length)
    cache, rows = model.new_cache(), []
    for s in range(0, length, chunk):
        part = tokens[s:s + chunk]
        rows.append(model.forward(cache, part, np.arange(s, s + len(part))))
    assert np.array_equal(np.concatenate(rows), one_at_a_time(model, tokens))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), prefix=st.integers(1, 50), branches=st.integers(1, 4),
       depth=st.integers(1, 4))
def test_tree_pass_rows_equal_the_chain_they_lie_on(lm, seed, prefix, branches, depth):
    """Branches of a tree verified in one pass (siblings masked) give each branch's node the
    logits of decoding that branch alone, bit for bit; compacting a branch's cache rows then
    continues exactly like the chain."""
    model, _ = lm
    rng = np.random.default_rng(seed)
    paths = rng.integers(0, CFG.vocab, (branches, depth))
    history = rng.integers(0, CFG.vocab, prefix)
    cache = model.new_cache()
    model.forward(cache, history[:-1], np.arange(prefix - 1))
    base = cache.length
    # root + branches laid out branch after branch; node j of branch b sees the root and b[:j]
    n = branches * depth
    mask = np.zeros((n + 1, n + 1), bool)
    mask[:, 0] = True
    for b in range(branches):
        for j in range(depth):
            row = 1 + b * depth + j
            mask[row, 1 + b * depth:row + 1] = True
    ids = np.concatenate([history[-1:], paths.reshape(-1)])
    positions = np.concatenate([[prefix - 1], np.tile(np.arange(prefix, prefix + depth), branches)])
    tree = model.forward(cache, ids, positions, tree_mask=mask)
    for b in range(branches):
        chain = one_at_a_time(model, np.concatenate([history, paths[b]]))
        assert np.array_equal(tree[0], chain[prefix - 1])
        assert np.array_equal(tree[1 + b * depth:1 + (b + 1) * depth], chain[prefix:])
    last = branches - 1
    cache.keep_rows(base, np.array([0] + list(range(1 + last * depth, 1 + (last + 1) * depth))))
    nxt = model.forward(cache, [3], [prefix + depth])
    chain = one_at_a_time(model, np.concatenate([history, paths[last], [3]]))
    assert np.array_equal(nxt[0], chain[-1])


def test_rollback_by_length_forgets_rejected_rows(lm):
    model, _ = lm
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, CFG.vocab, 30)
    cache = model.new_cache()
    model.forward(cache, tokens[:20], np.arange(20))
    model.forward(cache, rng.integers(0, CFG.vocab, 6), np.arange(20, 26))  # rejected drafts
    cache.truncate(20)
    logits = model.forward(cache, tokens[20:], np.arange(20, 30))
    assert np.array_equal(logits, one_at_a_time(model, tokens)[20:])
    with pytest.raises(ValueError, match="roll back"):
        cache.truncate(31)


def test_context_overflow_is_refused(lm):
    model, _ = lm
    cache = model.new_cache()
    model.forward(cache, np.zeros(CFG.ctx - 1, np.int64), np.arange(CFG.ctx - 1))
    with pytest.raises(ValueError, match="context full"):
        model.forward(cache, [1, 2], [CFG.ctx - 1, CFG.ctx])


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), prefix=st.integers(1, 60), chunk=st.integers(1, 6),
       width=st.integers(1, 4))
def test_kernel_draft_matches_the_graph(seed, prefix, chunk, width):
    """The C forward pass (what serves drafts) gives the ORT graph's logits to float rounding,
    for a long prefix (handed to ORT), short chunks, a level of siblings that see only part
    of the cache, and after a compaction; and both write the same cache."""
    weights = random_weights(CFG, seed=5)
    graph = build_lm_onnx(weights, CFG)
    ort_lm, kernel_lm = OnnxLM(graph), KernelLM(graph)
    rng = np.random.default_rng(seed)
    history = rng.integers(0, CFG.vocab, prefix)
    caches = {m: m.new_cache() for m in (ort_lm, kernel_lm)}

    def both(*args, **kwargs):
        out = [m.forward(c, *args, **kwargs) for m, c in caches.items()]
        np.testing.assert_allclose(out[1], out[0], rtol=1e-4, atol=1e-4)

    both(history[:-chunk] if prefix > chunk else history[:1], np.arange(max(prefix - chunk, 1)))
    start = caches[ort_lm].length
    both(history[start:], np.arange(start, prefix))
    length = caches[ort_lm].length
    visible = rng.random((width, length)) < 0.7
    visible[:, 0] = True
    both(rng.integers(0, CFG.vocab, width), np.full(width, prefix), tree_mask=np.eye(width, dtype=bool),
         past_visible=visible)
    for m, c in caches.items():
        c.keep_rows(length, np.array([width - 1]))
    both([3, 4], [prefix + 1, prefix + 2])
    n = caches[ort_lm].length
    for a, b in zip(caches[ort_lm].keys + caches[ort_lm].values,
                    caches[kernel_lm].keys + caches[kernel_lm].values):
        np.testing.assert_allclose(b[:, :n], a[:, :n], rtol=1e-4, atol=1e-4)


def test_kernel_draft_serves_concurrent_requests_from_their_own_caches():
    """Requests share one KernelLM on their own threads (the GIL is released in the C pass)."""
    from concurrent.futures import ThreadPoolExecutor
    model = KernelLM(build_lm_onnx(random_weights(CFG, seed=9), CFG))
    prompts = [np.random.default_rng(s).integers(0, CFG.vocab, 40) for s in range(4)]

    def decode(tokens):
        cache = model.new_cache()
        return np.stack([model.forward(cache, [tok], [i])[0] for i, tok in enumerate(tokens)])

    alone = [decode(p) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(decode, prompts * 5))
    for i, logits in enumerate(together):
        assert np.array_equal(logits, alone[i % 4])
