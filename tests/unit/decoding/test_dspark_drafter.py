"""The DSpark drafter's serving forward (numpy) on a tiny random drafter, and the
confidence-scheduled verification policy."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dspark.decoding.dspark_drafter import FORMAT, DrafterConfig, DSparkDrafter
from dspark.decoding.dspark_schedule import CostCurve, DraftGate, choose_verify_length, expected_tokens
from dspark.errors import ConfigError, RequestError

TARGET_VOCAB = 100
CFG = DrafterConfig(hidden=32, n_head=4, n_kv_head=2, head_dim=8, ffn=64, rope_base=10000.0,
                    n_layer=2, block=5, markov_rank=6, taps=(1, 2, 3), target_vocab=TARGET_VOCAB)


def tiny_weights(seed=0, cfg=CFG, n_vocab=40):
    rng = np.random.default_rng(seed)
    H, r = cfg.hidden, cfg.markov_rank

    def m(*shape, s=0.3):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    w = {"tap_norm": 1 + m(3 * H, s=0.1), "tap_mean": m(3 * H, s=0.5), "tap_std": 1 + np.abs(m(3 * H)), "fc": m(H, 3 * H, s=0.1), "ctx_norm": np.ones(H, np.float32),
         "last_proj": m(H, H, s=0.2),
         "mask_emb": m(H), "emb_norm": 1 + m(H, s=0.1), "last_norm": 1 + m(H, s=0.1), "out_norm": np.ones(H, np.float32), "markov_w1": m(n_vocab + 1, r),
         "markov_w2": m(r, n_vocab), "conf_w": m(H + r, 2), "conf_b": np.zeros(2, np.float32)}
    for i in range(cfg.n_layer):
        p = f"layers.{i}."
        w.update({p + "attn_norm": np.ones(H, np.float32), p + "ffn_norm": np.ones(H, np.float32),
                  p + "wq": m(H, H, s=0.2), p + "wk": m(cfg.n_kv_head * cfg.head_dim, H, s=0.2),
                  p + "wv": m(cfg.n_kv_head * cfg.head_dim, H, s=0.2), p + "wo": m(H, H, s=0.2),
                  p + "w_gate": m(cfg.ffn, H, s=0.2), p + "w_up": m(cfg.ffn, H, s=0.2),
                  p + "w_down": m(H, cfg.ffn, s=0.2)})
    return w


EMBED = np.random.default_rng(7).standard_normal((TARGET_VOCAB, CFG.hidden)).astype(np.float32)
VOCAB_IDS = np.arange(0, 80, 2)  # 40 draft tokens: the even ids below 80


def embed_rows(ids):
    return EMBED[np.asarray(ids)]


def make(weights=None, backend="numpy"):
    return DSparkDrafter(CFG, weights or tiny_weights(), VOCAB_IDS, embed_rows, backend=backend)


def with_context(drafter, n=7, seed=1):
    ctx = drafter.new_context(64)
    taps = np.random.default_rng(seed).standard_normal((n, 3 * CFG.hidden)).astype(np.float32)
    drafter.extend(ctx, taps)
    return ctx, taps


def test_greedy_block_shapes_vocab_and_confidence():
    d = make()
    ctx, _ = with_context(d)
    p = d.propose(ctx, anchor=5, k=5)
    assert p.tokens.shape == (5,) and p.tokens.dtype == np.int64
    assert set(p.tokens.tolist()) <= set(VOCAB_IDS.tolist())
    assert p.probs is None
    assert p.confidence.shape == (5,)
    assert np.all((p.confidence >= 0) & (p.confidence <= 1))
    assert ctx.length == 7  # drafting does not grow the context


def test_sampled_proposal_is_a_full_vocab_distribution_zero_outside_draft_vocab():
    d = make()
    ctx, _ = with_context(d)
    p = d.propose(ctx, anchor=3, k=4, temperature=0.8, rng=np.random.default_rng(0))
    assert p.probs.shape == (4, TARGET_VOCAB)
    np.testing.assert_allclose(p.probs.sum(1), 1.0, rtol=1e-5)
    outside = np.setdiff1d(np.arange(TARGET_VOCAB), VOCAB_IDS)
    assert np.all(p.probs[:, outside] == 0)
    assert np.all(p.probs[np.arange(4), p.tokens] > 0)  # each token was drawn from its row


def test_deterministic_greedy_and_seeded_sampling():
    d = make()
    ctx, _ = with_context(d)
    a, b = d.propose(ctx, 9, 5), d.propose(ctx, 9, 5)
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.confidence, b.confidence)
    s1 = d.propose(ctx, 9, 5, 1.0, np.random.default_rng(42))
    s2 = d.propose(ctx, 9, 5, 1.0, np.random.default_rng(42))
    assert np.array_equal(s1.tokens, s2.tokens) and np.array_equal(s1.probs, s2.probs)


def test_drafting_stops_where_the_confident_prefix_ends():
    d = make()
    ctx, _ = with_context(d)
    full = d.propose(ctx, 9, 5)
    prefix = np.cumprod(full.confidence)
    cut = float(prefix[2]) + 1e-6  # falls below at slot 2: three drafts
    short = d.propose(ctx, 9, 5, stop_below=cut)
    assert len(short.tokens) == 3 and np.array_equal(short.tokens, full.tokens[:3])
    assert np.allclose(short.confidence, full.confidence[:3])
    s = d.propose(ctx, 9, 5, 0.8, np.random.default_rng(1), stop_below=1.5)
    assert len(s.tokens) == 1 and s.probs.shape[0] == 1


def test_markov_bias_follows_the_previous_draft_token():
    """A bias W1[prev] @ W2 that sends each token of a chain to the next one makes the block
    follow that chain from the anchor; without the bias the backbone alone decides."""
    w = tiny_weights()
    chain = [4, 17, 9, 30, 2, 21]  # draft-vocabulary indices; chain[0] is the anchor
    w["markov_w1"] = np.zeros_like(w["markov_w1"])
    w["markov_w2"] = np.zeros_like(w["markov_w2"])
    for i, (a, b) in enumerate(zip(chain, chain[1:])):
        w["markov_w1"][a, i] = 1.0
        w["markov_w2"][i, b] = 200.0
    biased = make(w)
    ctx, taps = with_context(biased)
    p = biased.propose(ctx, int(VOCAB_IDS[chain[0]]), 5)
    expect = VOCAB_IDS[chain[1:]]
    assert np.array_equal(p.tokens, expect)
    plain = make(tiny_weights())
    ctx2 = plain.new_context(64)
    plain.extend(ctx2, taps)
    assert not np.array_equal(plain.propose(ctx2, int(VOCAB_IDS[chain[0]]), 5).tokens, expect)


def test_context_matters_and_rollback_restores_it():
    d = make()
    ctx, taps = with_context(d, n=6)
    before = d.block_pass(ctx, 11, 4)[0]
    other = np.random.default_rng(9).standard_normal((3, 3 * CFG.hidden)).astype(np.float32)
    d.extend(ctx, other)
    assert not np.allclose(d.block_pass(ctx, 11, 4)[0], before)
    ctx.truncate(6)
    np.testing.assert_allclose(d.block_pass(ctx, 11, 4)[0], before, rtol=1e-5, atol=1e-6)
    # extending in pieces equals extending at once
    one = d.new_context(64)
    d.extend(one, taps[:2])
    d.extend(one, taps[2:])
    np.testing.assert_allclose(d.block_pass(one, 11, 4)[0], before, rtol=1e-5, atol=1e-6)


def test_massive_activations_are_clipped():
    """A residual-stream outlier (SmolLM2 has dimensions ~1000x the median) saturates at the
    clip: the context is the same for 1e4 and 1e8 there, and finite."""
    d = make()
    taps = np.random.default_rng(5).standard_normal((2, 3 * CFG.hidden)).astype(np.float32)
    a, b = taps.copy(), taps.copy()
    a[:, 7], b[:, 7] = 1e4, 1e8
    ca, cb = d.new_context(8), d.new_context(8)
    d.extend(ca, a)
    d.extend(cb, b)
    assert np.all(np.isfinite(ca.features[:2]))
    np.testing.assert_allclose(ca.features[:2], cb.features[:2], rtol=1e-5, atol=1e-6)


def test_bad_inputs_name_the_field():
    d = make()
    ctx = d.new_context(4)
    with pytest.raises(RequestError, match="taps"):
        d.extend(ctx, np.zeros((2, 5), np.float32))
    with pytest.raises(RequestError, match="context"):
        d.extend(ctx, np.zeros((5, 3 * CFG.hidden), np.float32))
    with pytest.raises(RequestError, match="num_speculative_tokens"):
        d.propose(ctx, 1, CFG.block + 1)


def test_load_round_trip_and_refusals(tmp_path):
    w = tiny_weights()
    cfg = {k: v for k, v in CFG.__dict__.items() if k != "target_vocab"}
    meta = {"format": FORMAT, "config": {**cfg, "taps": list(CFG.taps)}}
    path = tmp_path / "d.npz"
    np.savez(path, **{k: v.astype(np.float16) for k, v in w.items()}, vocab_ids=VOCAB_IDS,
             __config__=np.frombuffer(json.dumps(meta).encode(), np.uint8))
    d = DSparkDrafter.load(path, embed_rows, TARGET_VOCAB)
    ref = DSparkDrafter(CFG, {k: v.astype(np.float16) for k, v in w.items()}, VOCAB_IDS, embed_rows)
    c1, _ = with_context(d)
    c2, _ = with_context(ref)
    assert np.array_equal(d.propose(c1, 2, 5).tokens, ref.propose(c2, 2, 5).tokens)
    bad = tmp_path / "bad.npz"
    np.savez(bad, **w, vocab_ids=VOCAB_IDS,
             __config__=np.frombuffer(json.dumps({**meta, "format": "x"}).encode(), np.uint8))
    with pytest.raises(ConfigError, match="format"):
        DSparkDrafter.load(bad, embed_rows, TARGET_VOCAB)
    with pytest.raises(ConfigError, match="vocab_ids"):
        DSparkDrafter.load(path, embed_rows, 50)
    with pytest.raises(ConfigError, match="backend"):
        DSparkDrafter.load(path, embed_rows, TARGET_VOCAB, backend="gpu")


# ------------------------------------------------------------------ confidence scheduling
def test_expected_tokens():
    np.testing.assert_allclose(expected_tokens([1.0, 0.5, 0.5]), [1, 2, 2.5, 2.75])
    np.testing.assert_allclose(expected_tokens([]), [1.0])


def test_flat_cost_verifies_everything_steep_cost_only_the_confident_prefix():
    conf = np.array([0.9, 0.8, 0.5, 0.3, 0.1])
    flat = CostCurve((1.0,) * 6)
    assert choose_verify_length(conf, flat) == 5
    steep = CostCurve.from_relative([1, 1.2, 1.4, 1.6, 1.8, 2.0])
    # E(n) = 1, 1.9, 2.62, 2.98, 3.09, 3.10; / c(n+1): 1, 1.58, 1.87, 1.86, 1.72, 1.55 -> n = 2
    assert choose_verify_length(conf, steep) == 2
    assert choose_verify_length(np.zeros(5), steep) == 0
    assert choose_verify_length(np.zeros(5), steep, min_drafts=1) == 1
    # the curve bounds n: 3 rows = anchor + 2 drafts
    assert choose_verify_length(np.ones(5), CostCurve((1.0, 1.0, 1.0))) == 2


def test_draft_cost_favours_longer_blocks_once_paid():
    conf = np.array([0.6, 0.6, 0.6])
    curve = [1, 1.5, 2.0, 2.5]
    cheap = choose_verify_length(conf, CostCurve.from_relative(curve))
    paid = choose_verify_length(conf, CostCurve.from_relative(curve, draft_relative=3.0))
    assert paid >= cheap


def test_measured_curve_is_monotone_and_bad_curves_are_refused():
    calls = []

    def run(n):
        calls.append(n)

    c = CostCurve.measure(run, 4, repeats=3, run_draft=lambda: None)
    assert c.max_rows == 4 and list(c.seconds) == sorted(c.seconds)
    assert calls.count(4) == 4  # warm-up + 3 repeats
    with pytest.raises(ConfigError, match="cost_curve"):
        CostCurve((1.0, 0.0))
    with pytest.raises(ConfigError, match="draft_seconds"):
        CostCurve((1.0,), draft_seconds=float("nan"))


def test_draft_gate_pauses_drafting_that_does_not_pay_for_longer_each_time():
    gate = DraftGate(smoothing=0.5, margin=0.1, max_pause=4)
    pattern = []
    for _ in range(40):
        drafted = gate.should_draft()
        pattern.append(drafted)
        if drafted:
            gate.update(tokens=1, rows_cost=1.5, draft_cost=0.3)  # 1 token for 1.8 units
    # pauses of 1, 2, 4, 4, ... rounds between drafted rounds
    runs = [len(r) for r in "".join("d" if p else "." for p in pattern).split("d") if r]
    assert runs[:3] == [1, 2, 4] and max(runs) == 4
    good = DraftGate(smoothing=0.5)
    for _ in range(20):
        assert good.should_draft()
        good.update(tokens=3, rows_cost=1.5, draft_cost=0.3)


# the C kernels need head_dim a multiple of 64
KERNEL_CFG = DrafterConfig(hidden=128, n_head=2, n_kv_head=1, head_dim=64, ffn=128, rope_base=10000.0,
                           n_layer=2, block=5, markov_rank=6, taps=(1, 2, 3), target_vocab=TARGET_VOCAB)
KERNEL_EMBED = np.random.default_rng(8).standard_normal((TARGET_VOCAB, KERNEL_CFG.hidden)).astype(np.float32)


@pytest.mark.parametrize("isa", ["scalar", "auto"])
def test_kernel_backend_computes_the_same_block_up_to_8bit_weights(isa, monkeypatch):
    """dspark's C kernels (8-bit weights and activations, fp16 context keys/values) against the
    float32 numpy pass: same hidden states and logits within the quantization error, the same
    greedy drafts, a context extended in pieces."""
    monkeypatch.setenv("DSPARK_SIMD", isa)
    weights = tiny_weights(seed=3, cfg=KERNEL_CFG)

    def rows(ids):
        return KERNEL_EMBED[np.asarray(ids)]

    ref = DSparkDrafter(KERNEL_CFG, weights, VOCAB_IDS, rows)
    fast = DSparkDrafter(KERNEL_CFG, weights, VOCAB_IDS, rows, backend="kernel")
    assert isa == "auto" or fast.kernel.model.isa == isa
    taps = np.random.default_rng(2).standard_normal((9, 3 * KERNEL_CFG.hidden)).astype(np.float32)
    c1, c2 = ref.new_context(64), fast.new_context(64)
    ref.extend(c1, taps)
    fast.extend(c2, taps[:4])
    fast.extend(c2, taps[4:])
    for anchor in (0, 8, 13):
        for want, got in zip(ref.block_pass(c1, anchor, 5), fast.block_pass(c2, anchor, 5)):
            assert got.shape == want.shape
            assert np.linalg.norm(got - want) <= 0.08 * np.linalg.norm(want)  # ~3 % from the weights alone
        assert c2.length == 9  # a block pass leaves the context as it was
    agree = [np.array_equal(ref.propose(c1, a, 5).tokens, fast.propose(c2, a, 5).tokens) for a in range(0, 80, 2)]
    assert sum(agree) >= 0.8 * len(agree)
