"""Grammar-constrained decoding (``sampling_parameters.guided``): the output follows the grammar,
speculation keeps it lossless (greedy text identical for every method, a forbidden draft token
rejected, sampled text distributed as plain constrained sampling), bad specs named."""
import json
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from dspark.decoding.constraint import Grammars, Guided, closed_objects
from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.proposers import standard_proposers
from dspark.decoding.rejection import verify
from dspark.decoding.sampling import SamplingParams, SpeculativeParams, distribution
from dspark.decoding.stats import DecodeStats
from dspark.decoding.tree import DraftTree
from dspark.errors import RequestError
from dspark.llm.kernel_runtime import KernelRuntime
from tests.fixtures.gguf_pair import EOS_ID, write_pair
from tests.unit.decoding.test_spec_engine import g_test_p_value

METHODS = ("none", "draft", "tree", "ngram", "suffix", "hybrid")


def _letters(vocab: int) -> list[bytes]:
    """A made-up vocabulary for the tiny models: a..z, then "A1", "B1"...; EOS special."""
    names = [bytes([97 + i]) if i < 26 else f"{chr(65 + i % 26)}{i // 26}".encode() for i in range(vocab)]
    names[EOS_ID] = b"</s>"
    return names


@pytest.fixture(scope="module")
def tiny():
    with tempfile.TemporaryDirectory() as scratch:
        target_path, draft_path = write_pair(Path(scratch))
        target = KernelRuntime(target_path, threads=1, max_context=128)
        draft = KernelRuntime(draft_path, threads=1, max_context=128)
    tokens = _letters(target.config.vocab)
    index = {t: i for i, t in enumerate(tokens)}

    def encode(text: str) -> list[int]:  # longest match first over the made-up vocabulary
        data, ids = text.encode(), []
        while data:
            size = next(n for n in (3, 2, 1) if data[:n] in index)
            ids.append(index[data[:size]])
            data = data[size:]
        return ids

    grammars = Grammars(lambda: tokens, encode, [EOS_ID], [EOS_ID])
    engine = SpeculativeEngine(target, standard_proposers(draft), eos_ids=[EOS_ID], grammars=grammars)
    return engine, tokens


def _run(engine, prompt, sampling, method, stats=None):
    return [t for new in engine.generate(prompt, sampling, SpeculativeParams(method, num_speculative_tokens=3),
                                         stats) for t in new]


def test_constrained_greedy_text_is_the_same_for_every_method_and_follows_the_grammar(tiny):
    engine, tokens = tiny
    for regex in ("(ab|cd)+e", "[a-f]{3,9}", "x(yz)*"):
        sampling = SamplingParams(max_tokens=20, guided={"regex": regex})
        outputs = {}
        for method in METHODS:
            stats = DecodeStats()
            outputs[method] = _run(engine, [5, 6, 7, 5, 6, 7, 5], sampling, method, stats)
            text = b"".join(tokens[t] for t in outputs[method]).decode()
            if stats.finish_reason == "eos":
                assert re.fullmatch(regex, text), (regex, method, text)
            else:  # cut by max_tokens: a prefix of a match
                assert stats.finish_reason == "length", (regex, method)
        assert len(set(map(tuple, outputs.values()))) == 1, (regex, outputs)


def test_a_draft_token_the_grammar_forbids_is_rejected_and_the_bonus_is_masked(tiny):
    engine, tokens = tiny
    constraint = engine.grammars.compile(Guided(regex="a[be]"))
    vocab = len(tokens)
    logits = np.zeros((3, vocab), np.float32)
    logits[:, 3] = 9.0  # "d": the target's favourite everywhere, which the grammar never allows
    logits[0, 0] = 5.0  # "a" at the root
    logits[1, 4] = 1.0  # "e" below "a" (second to "d")
    tree = DraftTree.chain([0, 3])  # "a" then the forbidden "d"
    new, path = verify(logits, tree, SamplingParams(), np.random.default_rng(0), constraint,
                       frozenset([EOS_ID]))
    assert new == [0, 4] and path == [0]  # "a" accepted, "d" rejected, "e" the masked argmax
    assert constraint.finished


def test_guesses_are_cut_at_a_forbidden_token_and_followed_by_the_forced_ones(tiny):
    engine, tokens = tiny
    a, b, c, d = (tokens.index(x) for x in (b"a", b"b", b"f", b"d"))  # "c" is the EOS token here
    constraint = engine.grammars.compile(Guided(regex="abf(x|y)"))
    before = constraint.allowed()
    assert constraint.steer([], 8) == [a, b, c]  # nothing guessed: the forced "abf"
    assert constraint.steer([a, b], 8) == [a, b, c]
    assert constraint.steer([a, d, c], 8) == [a]  # "d" is forbidden: its row would be wasted
    assert constraint.steer([], 2) == [a, b]  # within the limit
    assert (constraint.allowed() == before).all()  # the state is as it was
    constraint.advance(a)
    assert constraint.steer([], 8) == [b, c]


def test_fitted_guesses_take_fewer_passes_and_change_no_token(tiny):
    """A grammar that forces most of the text: a lookup with forced guesses verifies it in
    fewer passes than plain decoding and gives the same text."""
    engine, tokens = tiny
    sampling = SamplingParams(max_tokens=20, guided={"regex": "abdefghi(x|y)jklmnopq"})
    plain, steered = DecodeStats(), DecodeStats()
    expected = _run(engine, [5, 6, 7], sampling, "none", plain)
    assert _run(engine, [5, 6, 7], sampling, "ngram", steered) == expected
    assert steered.rounds < plain.rounds / 2, (steered.rounds, plain.rounds)


def test_constrained_sampling_follows_the_masked_target_distribution(tiny):
    """The first two tokens' joint law under the grammar equals plain constrained sampling's
    (G-test at alpha 0.001 over fixed seeds), with a draft model and with a tree."""
    engine, tokens = tiny
    regex = "[abdefg][abd]"
    allowed = [[t in (b"a", b"b", b"d", b"e", b"f", b"g") for t in tokens], [t in (b"a", b"b", b"d") for t in tokens]]
    prompt = [4, 9, 4, 9, 4]
    sampling = SamplingParams(max_tokens=2, temperature=1.0)
    target = engine.target
    cache = target.new_cache()
    first = target.forward(cache, prompt, np.arange(len(prompt)))[-1]
    p1 = distribution(np.where(allowed[0], first, -np.inf), sampling)
    expected = np.zeros((len(tokens), len(tokens)))
    for x1 in np.flatnonzero(p1):
        cache.truncate(len(prompt))
        second = target.forward(cache, [x1], [len(prompt)])[0]
        expected[x1] = p1[x1] * distribution(np.where(allowed[1], second, -np.inf), sampling)
    n = 800
    for method in ("draft", "tree"):
        counts = np.zeros_like(expected)
        for seed in range(n):
            s = SamplingParams(max_tokens=2, temperature=1.0, seed=seed, guided={"regex": regex})
            x1, x2 = _run(engine, prompt, s, method)
            counts[x1, x2] += 1
        assert g_test_p_value(counts, expected * n) > 1e-3, method


@pytest.mark.parametrize("guesses,top_p", [([], 1.0), ([0], 1.0), ([3], 1.0), ([0], 0.9)])
def test_an_unseeded_constrained_draw_follows_the_masked_distribution(tiny, guesses, top_p):
    """Unseeded, with no guess, an allowed guess, a forbidden one, and under top-p: the token
    emitted is distributed as the masked row's sampling distribution (G-test, a fixed rng).
    A token drawn from the whole row is kept only where the grammar allows it."""
    engine, tokens = tiny
    row = np.random.default_rng(1).normal(0.0, 1.5, len(tokens)).astype(np.float32)
    row[3] = 4.0  # "d": the likeliest, and forbidden
    allowed = np.array([t in (b"a", b"b", b"e") for t in tokens])
    sampling = SamplingParams(temperature=1.0, top_p=top_p)
    expected = distribution(np.where(allowed, row, -np.inf), sampling)
    logits, rng, n = np.tile(row, (len(guesses) + 1, 1)), np.random.default_rng(0), 1500
    counts = np.zeros(len(tokens))
    for _ in range(n):
        new, _ = verify(logits, DraftTree.chain(guesses), sampling, rng,
                        engine.grammars.compile(Guided(regex="[abe]")), frozenset([EOS_ID]))
        counts[new[0]] += 1
    assert counts[~allowed].sum() == 0 and g_test_p_value(counts, expected * n) > 1e-3


def test_a_finished_grammar_ends_the_text_with_its_last_character(tiny):
    engine, tokens = tiny
    stats = DecodeStats()
    out = _run(engine, [1, 2, 3], SamplingParams(max_tokens=30, guided={"choice": ["abc", "de"]}), "draft", stats)
    assert b"".join(tokens[t] for t in out) in (b"abc", b"de") and stats.finish_reason == "eos"


def test_bad_guided_specs_are_refused_naming_the_field(tiny):
    engine, _ = tiny
    with pytest.raises(ValidationError, match="exactly one"):
        SamplingParams(guided={"regex": "a", "choice": ["b"]})
    with pytest.raises(ValidationError, match="guided"):
        SamplingParams(guided={"regexp": "a"})
    with pytest.raises(RequestError, match=r"^guided\.regex: cannot be compiled \(.*\(\(.*; error: unclosed group\)$"):
        engine.start([1, 2], SamplingParams(guided={"regex": "(("}), SpeculativeParams("none"))
    with pytest.raises(RequestError, match=r"guided\.json_schema: cannot be compiled"):
        engine.start([1, 2], SamplingParams(guided={"json_schema": {"type": "nonsense"}}), SpeculativeParams("none"))
    without = SpeculativeEngine(engine.target)
    with pytest.raises(RequestError, match="guided: this model cannot constrain"):
        without.start([1, 2], SamplingParams(guided={"regex": "a"}), SpeculativeParams("none"))


def test_objects_listing_their_properties_are_closed_unless_the_schema_says_otherwise():
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {}}},
                                               "open": {"type": "object", "properties": {},
                                                        "additionalProperties": True}},
              "required": ["properties"], "$defs": {"D": {"properties": {"x": {"enum": [{"properties": {}}]}}}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert "additionalProperties" not in closed["properties"]  # a property map is not a schema
    assert closed["$defs"]["D"]["additionalProperties"] is False
    assert closed["$defs"]["D"]["properties"]["x"]["enum"] == [{"properties": {}}]  # values untouched
    assert closed["required"] == ["properties"]


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3}},
          "required": ["name", "age", "pets"]}


def test_json_schema_output_on_smollm2_is_valid_and_the_same_for_every_method():
    import jsonschema

    from dspark.paths import project_root
    from dspark.triton.models import llm_generator

    smollm2 = project_root() / "model_repository" / "spec_lm" / "1" / "smollm2"
    generator = llm_generator(smollm2, threads=2, max_context=512, model_proposers=(), draft=smollm2)
    prompt = generator.encode_chat([{"role": "user", "content": "Describe Ann, 31, who has a dog, as JSON."}])
    texts = set()
    for method in METHODS:
        stats = DecodeStats()
        text = "".join(generator.stream(prompt, SamplingParams(max_tokens=80, guided={"json_schema": SCHEMA}),
                                        SpeculativeParams(method), stats))
        jsonschema.validate(json.loads(text), SCHEMA)
        assert stats.finish_reason == "eos", method
        texts.add(text)
    assert len(texts) == 1, texts
    for seed in range(3):  # sampled: a bounded schema ends within max_tokens
        text = "".join(generator.stream(prompt, SamplingParams(max_tokens=120, temperature=1.0, seed=seed,
                                                               guided={"json_schema": SCHEMA}),
                                        SpeculativeParams("suffix")))
        jsonschema.validate(json.loads(text), SCHEMA)
    asked = generator.encode_chat([{"role": "user", "content": "Reply with a JSON object with keys name and "
                                                               "age for Ann, 31."}])
    text = "".join(generator.stream(asked, SamplingParams(max_tokens=60, guided={"json_object": True}),
                                    SpeculativeParams("hybrid")))
    assert json.loads(text) == {"name": "Ann", "age": 31}
