"""The speculative engine on tiny random-weight GGUF models (tests/fixtures/gguf_pair.py) run
by dspark's kernels, as served models are."""
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dspark.decoding import generation
from dspark.decoding.adaptive import AdaptiveDraftLength, best_k, expected_rates
from dspark.decoding.engine import PromptTooLong, SpeculativeEngine, VerifyCost
from dspark.llm.kernel_runtime import KernelRuntime
from dspark.runtimes.protocol import TargetRuntime
from dspark.decoding.proposers import standard_proposers
from dspark.decoding.rejection import accept_among
from dspark.decoding.sampling import SamplingParams, SpeculativeParams, distribution
from dspark.decoding.stats import DecodeStats
from tests.fixtures.gguf_pair import PAIR_SHAPE, write_pair
from tests.unit.llm.llm_gguf_factory import write_llama_gguf

CTX = 128


def _runtimes() -> dict[str, KernelRuntime]:
    """The target; the same weights at a coarser quantization (a mostly agreeing draft); its first
    block (a partly agreeing one); an unrelated model of the same vocabulary."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        target, first_block = write_pair(folder)
        coarse = write_llama_gguf(folder / "coarse.gguf", "Q4_1", **PAIR_SHAPE)
        other = write_llama_gguf(folder / "other.gguf", "Q8_0", **{**PAIR_SHAPE, "seed": 8})
        return {name: KernelRuntime(path, threads=1, max_context=CTX) for name, path in
                (("target", target), ("coarse", coarse), ("first_block", first_block), ("other", other))}


LMS = _runtimes()
VOCAB = LMS["target"].config.vocab


def make_engine(target, draft, min_confidence: float = 0.15, **options) -> SpeculativeEngine:
    return SpeculativeEngine(target, standard_proposers(draft, draft_min_confidence=min_confidence),
                             **options)


# seed 0: the draft is the target (everything accepted); then ever less agreeing drafts
ENGINES = {seed: make_engine(LMS["target"], LMS[draft]) for seed, draft in
           enumerate(("target", "coarse", "first_block", "other"))}


def with_confidence(engine: SpeculativeEngine, min_confidence: float) -> SpeculativeEngine:
    """The same models; draft chains stop after a token below ``min_confidence``."""
    return make_engine(engine.target, engine.proposers["draft"].lm, min_confidence)


def run(engine, prompt, sampling, spec, stats=None):
    return [t for chunk in engine.generate(prompt, sampling, spec, stats) for t in chunk]


@settings(max_examples=30, deadline=None)
@given(engine_seed=st.sampled_from(sorted(ENGINES)),
       prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=60),
       method=st.sampled_from(["draft", "ngram", "suffix", "hybrid", "tree"]),
       k=st.integers(1, 6), width=st.integers(1, 4), adaptive=st.booleans(),
       max_tokens=st.integers(1, 40), min_confidence=st.sampled_from([0.0, 0.4, 0.9]))
def test_greedy_speculation_equals_plain_decoding(engine_seed, prompt, method, k, width, adaptive,
                                                  max_tokens, min_confidence):
    engine = with_confidence(ENGINES[engine_seed], min_confidence)
    sampling = SamplingParams(max_tokens=max_tokens)
    plain = run(engine, prompt, sampling, SpeculativeParams("none"))
    stats = DecodeStats()
    spec = SpeculativeParams(method, num_speculative_tokens=k, tree_width=width, adaptive=adaptive)
    assert run(engine, prompt, sampling, spec, stats) == plain
    assert stats.generated_tokens == len(plain)
    assert stats.rounds <= len(plain)


def test_speculation_saves_target_passes_with_a_good_draft():
    engine = with_confidence(ENGINES[0], 0.0)
    prompt = [1, 2, 3, 4, 5]
    stats = {m: DecodeStats() for m in ("none", "draft", "tree")}
    for method, s in stats.items():
        run(engine, prompt, SamplingParams(max_tokens=60), SpeculativeParams(method, adaptive=False), s)
    assert stats["none"].rounds == 60
    assert stats["draft"].acceptance_rate == 1.0 and stats["tree"].acceptance_rate == 1.0
    assert stats["draft"].rounds == stats["tree"].rounds == 12  # 4 drafts + 1 per pass


def test_draft_chain_stops_after_a_token_the_draft_doubts():
    prompt = [1, 2, 3, 4, 5]
    sampling = SamplingParams(max_tokens=40)
    spec = SpeculativeParams("draft", num_speculative_tokens=6, adaptive=False)
    stats = {c: DecodeStats() for c in (0.0, 0.2, 1.01)}
    outputs = {c: run(with_confidence(ENGINES[2], c), prompt, sampling, spec, s)
               for c, s in stats.items()}
    assert outputs[0.0] == outputs[0.2] == outputs[1.01]
    assert stats[1.01].proposed == stats[1.01].draft_calls <= stats[1.01].rounds  # 1 per pass
    assert stats[1.01].proposed < stats[0.2].proposed < stats[0.0].proposed
    assert stats[0.2].acceptance_rate > stats[0.0].acceptance_rate


def test_adaptive_k_follows_acceptance_and_cost():
    assert best_k(0.95, 0.05, 8) == 8  # cheap draft, nearly always right: draft far ahead
    assert best_k(0.2, 0.1, 8) == 1  # mostly wrong: one guess per pass
    assert best_k(0.95, 1.0, 8) <= 2  # a draft as costly as the target barely pays
    assert best_k(0.7, 0.1, 8) < best_k(0.9, 0.1, 8)


def test_the_verify_length_weighs_the_rows_a_pass_costs():
    """R (1 + a + ... + a^k) / (T(k + 1) + k c): where rows are cheap (a 1B-8B model on a CPU,
    +4 % a row) it guesses deep, where they are dear (+60 % a row) shallow, and a draft that
    costs as much as the target does not pay even when always right."""
    cheap, dear = (lambda n: 1 + 0.04 * (n - 1)), (lambda n: 1 + 0.6 * (n - 1))
    assert best_k(0.9, 0.05, 8, cheap) >= 6 and best_k(0.9, 0.05, 8, dear) <= 2
    rates = expected_rates(0.99, 1.0, 4, cheap)
    assert rates.argmax() == 0  # plain decoding
    assert expected_rates(0.9, 0.05, 4, cheap).argmax() > 0


def test_the_pass_cost_table_is_measured_at_load():
    """Passes timed on the runtime (here a clock each forward advances by 10 ms + 2 ms a row)
    seed the cost by rows before any request ran."""
    now = [0.0]

    class Timed(InexactTrees):
        def forward(self, cache, tokens, positions, tree_mask=None, past_visible=None):
            now[0] += 0.010 + 0.002 * (len(tokens) - 1)
            return super().forward(cache, tokens, positions, tree_mask, past_visible)

    cost = VerifyCost()
    cost.measure(Timed(LMS["target"]), clock=lambda: now[0])
    assert cost(1) == 1.0 and cost(8) == pytest.approx(1 + 0.2 * 7)


@pytest.mark.parametrize("row_cost,every,guessing", [(0.4, 4, False), (0.05, 4, True), (0.4, 1, True)])
def test_prompt_lookup_guesses_only_where_its_rows_pay(row_cost, every, guessing):
    """The same lookups, right in one round of four (only the first guess): where a pass's extra
    rows are dear (0.4 of a row each, as SmolLM2 on an AVX2 CPU) prompt lookup pauses and the
    rounds are plain; cheap rows, or guesses right in every round, keep it guessing."""
    from dspark.decoding.proposers.base import DraftRequest
    from dspark.decoding.proposers.ngram import PromptLookupProposer

    history = [5, 6, 7, 8] * 16  # the lookup always finds four tokens
    request = DraftRequest(history, SamplingParams(), SpeculativeParams("ngram"), np.random.default_rng(0),
                           DecodeStats(), 1024, lambda n: 1 + row_cost * (n - 1))
    drafter = PromptLookupProposer().start(request)
    guessed = []
    for i in range(60):
        tree = drafter.propose(history, 4, 4)
        guessed.append(bool(tree.tokens))
        kept = tree.tokens[:1] if i % every == 0 else []
        drafter.verified(tree, list(range(len(kept))), kept + [1], None, 0.01)
    assert guessed[0]  # the first round guesses
    assert all(guessed[20:]) if guessing else sum(guessed[20:]) <= 4, guessed


def test_a_draft_that_does_not_pay_pauses_for_longer_each_time_and_resumes_when_it_pays():
    length = AdaptiveDraftLength(4, 0.05, verify_cost=lambda n: 1 + 0.05 * (n - 1))
    pauses, plain_rounds = [], 0
    for _ in range(12):  # drafted rounds, each never right and almost a target pass
        while not length.should_draft():
            plain_rounds += 1
        length.update(proposed=4, accepted=0, cost_ratio=0.9)
        if length.gate.pause:
            pauses.append(length.gate.pause)
    assert pauses[:7] == [1, 2, 4, 8, 16, 32, 32]  # once the smoothed figures say it does not pay
    assert plain_rounds == sum(pauses[:-1])
    for _ in range(20):  # a draft that became cheap and right
        while not length.should_draft():
            pass
        length.update(proposed=4, accepted=4, cost_ratio=0.02)
    assert length.gate.pause == 0 and length.gate.backoff == 1 and length.k == 4 and length.should_draft()


def test_the_draft_method_decodes_plainly_where_its_draft_does_not_pay():
    """The unrelated draft (ENGINES[3]) is as large as the target and never right: after the
    first rounds the request mostly decodes plainly, with the same text."""
    sampling = SamplingParams(max_tokens=120)
    stats = {adaptive: DecodeStats() for adaptive in (False, True)}
    outputs = [run(ENGINES[3], [1, 2, 3, 4, 5], sampling, SpeculativeParams("draft", adaptive=adaptive), s)
               for adaptive, s in stats.items()]
    assert outputs[0] == outputs[1] == run(ENGINES[3], [1, 2, 3, 4, 5], sampling, SpeculativeParams("none"))
    assert stats[False].draft_calls >= stats[False].rounds
    assert stats[True].draft_calls < stats[True].rounds / 2


def test_hybrid_without_a_repeated_ngram_is_the_draft_alone():
    """(Lookup and draft chains in one pass, on a model that copies: test_spec_real_model.py.)"""
    engine = ENGINES[2]
    fresh = list(range(20))
    s_draft, s_hybrid = DecodeStats(), DecodeStats()
    one = SamplingParams(max_tokens=2)
    run(engine, fresh, one, SpeculativeParams("draft", num_speculative_tokens=3, adaptive=False), s_draft)
    run(engine, fresh, one, SpeculativeParams("hybrid", num_speculative_tokens=3, adaptive=False), s_hybrid)
    assert s_hybrid.draft_calls == s_draft.draft_calls > 0


@pytest.mark.parametrize("method,width,seeded", [("draft", 1, False), ("tree", 3, False), ("ngram", 1, False),
                                                 ("hybrid", 1, False), ("suffix", 3, False), ("none", 1, False),
                                                 ("none", 1, True)])
def test_sampled_speculation_follows_the_target_distribution(method, width, seeded, monkeypatch):
    """Lossless sampling: the joint law of the first two tokens equals the target's (G-test
    at alpha 0.001 over 1500 fixed-seed runs; a lossy rule, e.g. always accepting the draft,
    fails it). Unseeded requests go through the rejection sampler, here with generators of
    fixed seeds; seeded ones draw each position from (seed, position), the same text for every
    method (the next test), so plain seeded sampling's law is theirs."""
    engine = ENGINES[2]
    prompt = [1, 2, 1, 3, 1]
    # the top 3 tokens of each step: few enough outcomes for the test, the same law for every method
    sampling = SamplingParams(max_tokens=2, temperature=1.0, top_k=3)
    expected = exact_two_token_distribution_small(engine, prompt, sampling, VOCAB)
    counts = np.zeros_like(expected)
    n = 1500
    for seed in range(n):
        if not seeded:
            monkeypatch.setattr(generation, "default_rng", lambda _none, seed=seed: np.random.default_rng(seed))
        s = SamplingParams(max_tokens=2, temperature=1.0, top_k=3, seed=seed if seeded else None)
        x1, x2 = run(engine, prompt, s, SpeculativeParams(method, num_speculative_tokens=2,
                                                            tree_width=width))
        counts[x1, x2] += 1
    assert g_test_p_value(counts, expected * n) > 1e-3


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_a_seed_gives_the_same_text_on_every_call_and_for_every_method(temperature, top_p):
    """A seeded sampled text is plain sampling's for that seed, whatever the method, the draft,
    or what the proposers learnt from earlier requests (the suffix tree has seen the text)."""
    engine = make_engine(LMS["target"], LMS["coarse"])
    prompt = [4, 1, 4, 1, 5, 9, 2, 6]
    for seed in (0, 1, 2):
        sampling = SamplingParams(max_tokens=24, temperature=temperature, top_p=top_p, seed=seed)
        plain = run(engine, prompt, sampling, SpeculativeParams("none"))
        for method in ("draft", "tree", "ngram", "suffix", "hybrid", "none"):
            for _ in range(2):
                assert run(engine, prompt, sampling, SpeculativeParams(method, tree_width=3)) == plain, (seed, method)
    texts = {tuple(run(engine, prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=seed),
                       SpeculativeParams("suffix"))) for seed in range(5)}
    assert len(texts) > 1  # the seed matters


def test_a_seeded_draft_model_agrees_with_the_target_where_they_are_alike():
    """Seeded, the draft draws from the same uniform as the target: a draft equal to the target
    is always accepted, as under greedy decoding."""
    engine = make_engine(LMS["target"], LMS["target"])
    stats = DecodeStats()
    run(engine, [3, 1, 4], SamplingParams(max_tokens=24, temperature=1.0, seed=5),
        SpeculativeParams("draft", adaptive=False), stats)
    assert stats.accepted == stats.proposed > 0


def exact_two_token_distribution_small(engine, prompt, sampling, vocab) -> np.ndarray:
    target = engine.target
    cache = target.new_cache()
    p1 = distribution(target.forward(cache, prompt, np.arange(len(prompt)))[-1], sampling)
    joint = np.zeros((vocab, vocab))
    for x1 in np.flatnonzero(p1):
        cache.truncate(len(prompt))
        joint[x1] = p1[x1] * distribution(target.forward(cache, [x1], [len(prompt)])[0], sampling)
    return joint


def g_test_p_value(observed: np.ndarray, expected: np.ndarray) -> float:
    """Likelihood-ratio test; cells with expectation < 5 are pooled into one."""
    from math import exp, lgamma, log

    obs, exp_ = observed.ravel(), expected.ravel()
    small = exp_ < 5
    obs = np.append(obs[~small], obs[small].sum())
    exp_ = np.append(exp_[~small], exp_[small].sum())
    keep = exp_ > 0
    obs, exp_ = obs[keep], exp_[keep]
    nz = obs > 0
    g = 2 * float((obs[nz] * np.log(obs[nz] / exp_[nz])).sum())
    dof = len(obs) - 1
    # survival function of chi2(dof) at g via the regularised upper gamma (series for small x)
    a, x = dof / 2, g / 2
    if x < a + 1:
        term = total = 1 / a
        for i in range(1, 500):
            term *= x / (a + i)
            total += term
        return 1 - total * exp(-x + a * log(x) - lgamma(a))
    f, c, d = 1.0, 1e300, 0.0  # continued fraction (Lentz)
    b = x + 1 - a
    d = 1 / b
    f = d
    for i in range(1, 500):
        an = -i * (i - a)
        b += 2
        d = 1 / (an * d + b)
        c = b + an / c
        f *= d * c
    return f * exp(-x + a * log(x) - lgamma(a))


def test_accept_among_is_exact_for_iid_candidates():
    """The recursive rejection rule over i.i.d. candidates from q emits exactly p."""
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.3, 0.15, 0.05])
    q = np.array([0.1, 0.2, 0.3, 0.4])
    counts = np.zeros(4)
    n = 20000
    for _ in range(n):
        cands = [int(c) for c in rng.choice(4, size=3, p=q)]
        idx, token = accept_among(p, q, cands, rng)
        counts[cands[idx] if idx >= 0 else token] += 1
    assert g_test_p_value(counts, p * n) > 1e-3


def test_prompt_longer_than_context_is_refused_with_lengths():
    engine = ENGINES[0]
    with pytest.raises(PromptTooLong, match=f"prompt is {CTX} tokens but the context is {CTX}"):
        run(engine, [1] * CTX, SamplingParams(), SpeculativeParams("none"))


def test_generation_stops_at_the_context_end():
    engine = ENGINES[1]
    stats = DecodeStats()
    out = run(engine, [1] * (CTX - 5), SamplingParams(max_tokens=50), SpeculativeParams("tree"), stats)
    assert len(out) == 6 and stats.finish_reason == "length"  # the last one needs no cache row


def test_cancellation_stops_between_passes():
    engine = ENGINES[1]
    calls = []
    stats = DecodeStats()
    out = [t for c in engine.generate([1, 2], SamplingParams(max_tokens=50), SpeculativeParams("none"),
                                      stats, cancelled=lambda: calls.append(1) or len(calls) > 3) for t in c]
    assert len(out) == 3 and stats.finish_reason == "cancelled"


def test_batched_verification_gives_every_request_its_own_greedy_text():
    """Rounds of concurrent requests verified in shared target calls (RoundBatcher): each
    request's text equals its plain decoding, and fewer calls than passes were made."""
    import threading

    solo = ENGINES[2]
    batched = make_engine(solo.target, solo.proposers["draft"].lm, batch_verification=True)
    rng = np.random.default_rng(7)
    prompts = [list(rng.integers(0, VOCAB, n)) for n in (5, 17, 30, 9)]
    methods = ["none", "draft", "suffix", "hybrid"]
    sampling = SamplingParams(max_tokens=25)
    expected = [run(solo, p, sampling, SpeculativeParams("none")) for p in prompts]
    got, stats = [None] * 4, [DecodeStats() for _ in prompts]
    calls = batched.target_calls

    def one(i):
        got[i] = run(batched, prompts[i], sampling, SpeculativeParams(methods[i]), stats[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batched.close()
    assert got == expected
    assert batched.target_calls - calls < sum(s.rounds for s in stats)


def test_cancelling_a_batched_generation_ends_it_at_the_next_round():
    batched = make_engine(ENGINES[1].target, None, batch_verification=True)
    calls = []
    stats = DecodeStats()
    out = [t for c in batched.generate([1, 2], SamplingParams(max_tokens=50), SpeculativeParams("none"),
                                       stats, cancelled=lambda: calls.append(1) or len(calls) > 3)
           for t in c]
    batched.close()
    assert len(out) == 3 and stats.finish_reason == "cancelled"


def test_a_lone_request_decodes_on_its_own_thread():
    """With verification batched, a request alone needs no loop thread; one whose consumer
    leaves early is ended, the next is alone again, and a close ends a lone one as cancelled."""
    batched = make_engine(ENGINES[1].target, None, batch_verification=True)
    sampling = SamplingParams(max_tokens=30)
    stats = DecodeStats()
    left = batched.generate([1, 2], sampling, SpeculativeParams("none"), stats)
    next(left)
    left.close()
    assert stats.finish_reason == "stopped" and batched.batcher._thread is None
    stats = DecodeStats()
    assert run(batched, [1, 2], sampling, SpeculativeParams("none"), stats) == \
        run(ENGINES[1], [1, 2], sampling, SpeculativeParams("none"))
    assert stats.finish_reason == "length" and batched.batcher._thread is None
    stats = DecodeStats()
    closing = batched.generate([1, 2], sampling, SpeculativeParams("none"), stats)
    first = next(closing)
    batched.close()
    assert len(first + [t for new in closing for t in new]) < 30 and stats.finish_reason == "cancelled"


def test_end_of_sequence_ends_the_text_without_it():
    engine = ENGINES[2]
    prompt = [3, 1, 4, 1, 5]
    plain = run(engine, prompt, SamplingParams(max_tokens=30), SpeculativeParams("none"))
    eos = plain[6]
    with_eos = make_engine(engine.target, engine.proposers["draft"].lm, eos_ids=[eos])
    for method in ("none", "draft", "ngram", "suffix", "hybrid", "tree"):
        stats = DecodeStats()
        out = run(with_eos, prompt, SamplingParams(max_tokens=30), SpeculativeParams(method), stats)
        assert out == plain[:plain.index(eos)] and stats.finish_reason == "eos", method


def test_suffix_proposes_from_this_models_earlier_outputs():
    """A second request whose text repeats an earlier request's output is guessed from it."""
    engine = make_engine(ENGINES[2].target, None)
    sampling = SamplingParams(max_tokens=40)
    first = run(engine, [7, 3, 9], sampling, SpeculativeParams("suffix"))
    stats = DecodeStats()
    again = run(engine, [7, 3, 9], sampling, SpeculativeParams("suffix"), stats)
    assert again == first
    assert stats.accepted >= 30  # nearly every token came from the cached output
    fresh, cold = make_engine(ENGINES[2].target, None), DecodeStats()
    run(fresh, [7, 3, 9], sampling, SpeculativeParams("suffix"), cold)
    assert cold.accepted < stats.accepted


def test_verify_cost_learns_the_cost_per_row():
    cost = VerifyCost(prior_row_cost=0.05)
    assert cost(9) == pytest.approx(1.4)
    for _ in range(5):
        for rows in (1, 5, 9):
            cost.observe(rows, 0.010 + 0.002 * (rows - 1))  # a row costs a fifth of a pass
    assert cost(6) == pytest.approx(2.0, rel=0.02)


def test_one_slow_wide_pass_does_not_switch_speculation_off():
    """A noisy machine once made a 2-row pass look 10x a 1-row pass; sure guesses must still be
    verified afterwards, or wider passes are never measured again."""
    from dspark.decoding.adaptive import best_prefix

    cost = VerifyCost()
    for _ in range(10):
        cost.observe(1, 0.001)
    cost.observe(2, 0.010)
    assert best_prefix([1.0, 1.0], cost) == 2


class InexactTrees(TargetRuntime):
    """The same target, declaring that its tree rows are not bit for bit the chains': records
    the shape of every verify pass."""

    exact_trees = False

    def __init__(self, lm):
        self.lm, self.config, self.branched = lm, lm.config, []

    def new_cache(self, capacity=None):
        return self.lm.new_cache(capacity)

    def forward(self, cache, tokens, positions, tree_mask=None, past_visible=None):
        if tree_mask is not None:
            parents = [np.flatnonzero(row[:i]).max() if row[:i].any() else -1
                       for i, row in enumerate(tree_mask)]
            self.branched.append(len(set(parents)) < len(parents) - 1)
        return self.lm.forward(cache, tokens, positions, tree_mask, past_visible)


@pytest.mark.parametrize("method", ["suffix", "hybrid", "tree"])
def test_greedy_requests_verify_chains_on_a_target_without_exact_tree_rows(method):
    target = InexactTrees(ENGINES[2].target)
    engine = make_engine(target, ENGINES[2].proposers["draft"].lm)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 1, 4, 1, 5]
    sampling = SamplingParams(max_tokens=30)
    spec = SpeculativeParams(method, num_speculative_tokens=4, tree_width=3)
    assert run(engine, prompt, sampling, spec) == run(ENGINES[2], prompt, sampling, SpeculativeParams("none"))
    assert target.branched and not any(target.branched)
    if method == "tree":  # the same runtime saying its trees are exact gets trees
        spy = InexactTrees(ENGINES[2].target)
        spy.exact_trees = True
        run(make_engine(spy, ENGINES[2].proposers["draft"].lm), prompt, sampling, spec)
        assert any(spy.branched)
