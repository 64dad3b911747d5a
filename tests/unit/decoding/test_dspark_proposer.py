"""``speculative.method = "dspark"`` on a tiny llama GGUF (the kernel runtime, with taps) and a
tiny DSpark drafter (its numpy reference and its kernel backend): greedy output equals plain decoding, sampled output follows the target's
distribution, and the block drafter's accepted tokens really save target passes."""
from __future__ import annotations

import numpy as np
import pytest

from dspark.decoding.dspark_drafter import DrafterConfig, DSparkDrafter
from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.proposers import standard_proposers
from dspark.decoding.proposers.dspark import DSparkProposer
from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.decoding.stats import DecodeStats
from dspark.decoding.tree import DraftTree
from dspark.llm.kernel_runtime import KernelRuntime
from dspark.llm.taps import TAP_LAYERS
from tests.unit.llm.llm_gguf_factory import write_llama_gguf
from tests.unit.decoding.test_dspark_drafter import tiny_weights
from tests.unit.decoding.test_spec_engine import g_test_p_value

# head dim 64, as the drafter's kernels need; the target deep enough for every tapped block
HIDDEN, VOCAB, TARGET_LAYERS = 128, 288, max(TAP_LAYERS) + 1
CFG = DrafterConfig(hidden=HIDDEN, n_head=2, n_kv_head=1, head_dim=64, ffn=128, rope_base=10000.0,
                    n_layer=1, block=5, markov_rank=32, taps=TAP_LAYERS, target_vocab=VOCAB)
PROMPTS = [[5, 9, 13, 200, 41], [7] * 3, list(range(30, 70))]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark_target")
    path = write_llama_gguf(root / "t.gguf", "Q8_0", n_layer=TARGET_LAYERS, hidden=HIDDEN, ffn=128,
                            n_head=2, n_kv_head=1, vocab=VOCAB, seed=3)
    return KernelRuntime(path, threads=1)


def plain(engine, prompt, sampling):
    return [t for c in engine.generate(prompt, sampling, SpeculativeParams("none")) for t in c]


def follower_weights(target, vocab_ids, strength: float = 50.0):
    """A drafter whose Markov head replays the target's greedy transitions seen on PROMPTS (a
    tiny random model soon loops, so these predict it well) and whose confidence is high: its
    blocks get accepted, partly, which exercises every path of the round loop."""
    w = tiny_weights(seed=4, cfg=CFG, n_vocab=len(vocab_ids))
    engine = SpeculativeEngine(target, [], eos_ids=[])
    to_draft = {int(t): i for i, t in enumerate(vocab_ids)}
    codes = {}
    w["markov_w1"][:] = 0
    w["markov_w2"][:] = 0
    for prompt in PROMPTS:
        seq = prompt[-1:] + plain(engine, prompt, SamplingParams(max_tokens=40))
        for a, b in zip(seq, seq[1:]):
            if a in to_draft and b in to_draft and len(codes) < CFG.markov_rank:
                code = codes.setdefault(a, len(codes))
                w["markov_w1"][to_draft[a], code] = 1.0
                w["markov_w2"][code, to_draft[b]] = strength
    w["conf_w"][:] = 0
    w["conf_b"][:] = 4.0
    return w


def make_engine(target, backend: str, strength: float = 50.0) -> SpeculativeEngine:
    vocab_ids = np.arange(3, 280)  # the control tokens and a few others are outside it
    emb = np.random.default_rng(2).standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    drafter = DSparkDrafter(CFG, follower_weights(target, vocab_ids, strength), vocab_ids,
                            lambda ids: emb[ids], backend=backend)
    return SpeculativeEngine(target, standard_proposers(model_proposers=(DSparkProposer(drafter),)),
                             eos_ids=[])


@pytest.fixture(scope="module", params=["kernel", "numpy"])
def engine(request, target):
    return make_engine(target, request.param)


@pytest.mark.parametrize("method", ["dspark", "hybrid"])
@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_greedy_dspark_equals_plain_decoding(engine, method, k):
    passes = 0
    for prompt in PROMPTS:
        for max_tokens in (1, 7, 33):
            sampling = SamplingParams(max_tokens=max_tokens)
            stats = DecodeStats()
            spec = SpeculativeParams(method, num_speculative_tokens=k)
            out = [t for c in engine.generate(prompt, sampling, spec, stats) for t in c]
            assert out == plain(engine, prompt, sampling)
            passes += stats.rounds
            assert stats.generated_tokens == len(out)
    if k > 1:  # the follower drafter's blocks are accepted: fewer passes than tokens
        assert passes < 3 * (1 + 7 + 33)


def test_block_acceptance_is_recorded_per_position(engine):
    stats = DecodeStats()
    spec = SpeculativeParams("dspark", num_speculative_tokens=5)
    list(engine.generate(PROMPTS[0], SamplingParams(max_tokens=40), spec, stats))
    assert stats.proposed_at and stats.proposed_at[0] >= stats.proposed_at[-1]
    assert all(a <= p for a, p in zip(stats.accepted_at, stats.proposed_at))
    assert stats.accepted > 0 and stats.mean_accepted_length > 1.0


def test_sampled_dspark_follows_the_target_distribution(target):
    """Joint law of the first two sampled tokens (top_k 3, so the target puts its mass on few
    tokens) over 1200 seeds against the exact one: G-test at alpha 0.001. The drafter mostly
    proposes the target's likeliest token, so a wrong proposal distribution in the tree (e.g.
    its draft distribution mixed half with uniform: over-accepting) fails it."""
    engine = make_engine(target, "kernel")
    prompt = [5, 9, 13, 200, 41]
    from dspark.decoding.sampling import distribution

    base = SamplingParams(max_tokens=2, temperature=1.0, top_k=3)
    cache = target.new_cache()
    p1 = distribution(target.forward(cache, prompt, np.arange(len(prompt)))[-1], base)
    expected = np.zeros((VOCAB, VOCAB))
    for x1 in np.flatnonzero(p1):
        cache.truncate(len(prompt))
        expected[x1] = p1[x1] * distribution(target.forward(cache, [x1], [len(prompt)])[0], base)
    counts = np.zeros_like(expected)
    n = 1200
    spec = SpeculativeParams("dspark", num_speculative_tokens=4)
    for seed in range(n):
        s = SamplingParams(max_tokens=2, temperature=1.0, top_k=3, seed=seed)
        x1, x2 = [t for c in engine.generate(prompt, s, spec) for t in c]
        counts[x1, x2] += 1
    assert g_test_p_value(counts, expected * n) > 1e-3


def request_drafter():
    """A tiny drafter's state for one request of prompt [1, 2, 3], and the drafter."""
    from dspark.decoding.proposers.base import DraftRequest

    emb = np.random.default_rng(2).standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    drafter = DSparkDrafter(CFG, tiny_weights(seed=4, cfg=CFG, n_vocab=VOCAB), np.arange(VOCAB),
                            lambda ids: emb[ids])
    request = DraftRequest([1, 2, 3], SamplingParams(), SpeculativeParams("dspark"),
                           np.random.default_rng(0), DecodeStats(), 64, lambda rows: 1.0)
    return DSparkProposer(drafter).start(request), drafter


def test_a_context_that_misses_rows_falls_back_to_plain_rounds():
    d, _ = request_drafter()
    d.prefilled(np.zeros((2, 3 * HIDDEN), np.float32))
    assert len(d.propose([1, 2, 3], 4, 4)) > 0
    assert len(d.propose([1, 2, 3, 4, 5], 4, 4)) == 0  # two committed rows without taps


def test_a_one_token_prompt_drafts_from_an_empty_context():
    """A one-token prompt has no rows before its root: the engine hands over no taps."""
    d, _ = request_drafter()
    d.prefilled(None)
    assert d.ctx.length == 0 and not d.lost
    d.verified(DraftTree(), [], [7], np.zeros((1, 3 * HIDDEN), np.float32), 0.01)
    assert len(d.propose([1, 7], 4, 4)) > 0


def test_rounds_that_do_not_draft_leave_the_context_to_the_next_draft():
    """A round the gate keeps plain reads no taps into the drafter (its cost is plain
    decoding's); the next drafted round reads every committed row first, in order."""
    d, drafter = request_drafter()
    taps = np.random.default_rng(5).standard_normal((6, 3 * HIDDEN)).astype(np.float32)
    d.prefilled(taps[:2])
    d.gate.pause = 2  # the next two rounds decode plainly
    history = [1, 2, 3]
    for row in (2, 3):
        assert len(d.propose(history, 4, 4)) == 0
        d.verified(DraftTree(), [], [history[-1] + 1], taps[row:row + 1], 0.01)
        history = history + [history[-1] + 1]
        assert d.ctx.length == 2  # the prompt's rows only: nothing read while the rounds were plain
    assert len(d.propose(history, 4, 4)) > 0
    assert d.ctx.length == 4
    expected = drafter.new_context(64)  # read as the request did: the prompt, then both rounds at once
    drafter.extend(expected, taps[:2])
    drafter.extend(expected, taps[2:4])
    np.testing.assert_array_equal(d.ctx.features[:4], expected.features[:4])
