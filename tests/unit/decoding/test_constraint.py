"""Grammar-constrained decoding (dspark.decoding.constraint): the ``guided`` spec is checked when
parsed, the verifier masks every row it walks, so a draft token the grammar forbids is rejected,
sampled tokens follow the masked distribution, and on the demo's real model (SmolLM2-135M, its
own GGUF draft) every speculative method gives constrained plain decoding's text, valid under
the schema."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from dspark.decoding.constraint import Grammars, Vocabulary
from dspark.decoding.proposers.base import BaseDrafter
from dspark.decoding.rejection import verify
from dspark.decoding.request import parse_generate_options
from dspark.decoding.sampling import SamplingParams, SpeculativeParams, distribution
from dspark.decoding.stats import DecodeStats
from dspark.decoding.tree import DraftTree
from dspark.errors import RequestError
from dspark.paths import project_root
from dspark.triton.models import llm_generator
from tests.unit.decoding.test_spec_engine import g_test_p_value

SMOLLM2 = project_root() / "model_repository" / "spec_lm" / "1" / "smollm2"
TOY_TOKENS = [b"<eos>", b"a", b"b", b"c", b"x", b"y", b"ab", b"<ctl>"]
EOS = 0
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["admin", "user"]}, "maxItems": 2}}}


def _toy_encode(text: str) -> list[int]:
    return [TOY_TOKENS.index(ch.encode()) for ch in text]


TOY = Grammars(Vocabulary(TOY_TOKENS, [EOS], _toy_encode, special_ids=[EOS, 7]))


def _guided(spec: dict):
    return parse_generate_options(json.dumps({"guided": spec}), SpeculativeParams()).sampling


def test_guided_kinds_parse_and_errors_name_the_field():
    for spec in ({"json_schema": PERSON}, {"json_object": True}, {"regex": "[0-9]+"},
                 {"choice": ["yes", "no"]}, {"grammar": 'start: "a" | "b"'}):
        assert _guided(spec).guided.kind == next(iter(spec))
    cases = [({"json_schema": {"type": "nope"}}, "guided.json_schema"),
             ({"regex": "(("}, "guided.regex"), ({"grammar": "start: missing"}, "guided.grammar"),
             ({"choice": []}, "guided.choice"), ({"json_object": False}, "guided.json_object"),
             ({"regex": "a", "choice": ["b"]}, "guided"), ({}, "guided"), ({"xml": "a"}, "guided.xml")]
    for spec, field in cases:
        with pytest.raises(RequestError) as caught:
            _guided(spec)
        assert caught.value.field == field, spec
    with pytest.raises(RequestError) as caught:
        parse_generate_options(json.dumps({"guided": "json"}), SpeculativeParams())
    assert caught.value.field == "guided"


def test_mask_follows_the_grammar_and_ends_with_only_eos():
    constraint = TOY.constraint(_guided({"choice": ["ab", "ax"]}).guided)
    allowed = constraint.mask(10)  # logits wider than the vocabulary: the extra ids are forbidden
    assert list(np.flatnonzero(allowed)) == [1, 6]  # "a", "ab"; never the control token
    assert constraint.consume(1) and list(np.flatnonzero(constraint.mask())) == [2, 4]
    assert not constraint.is_finished()
    assert constraint.consume(4) and constraint.is_accepting() and constraint.is_finished()
    assert list(np.flatnonzero(constraint.mask())) == [EOS]
    constraint.rollback(1)
    assert not constraint.is_accepting() and constraint.consume(2) and constraint.is_finished()


def test_a_draft_token_the_grammar_forbids_is_rejected():
    """The target's top token and the draft are "x", which the grammar forbids: the draft is
    rejected and the target's best allowed token comes instead (greedy and sampled)."""
    logits = np.zeros((3, len(TOY_TOKENS)), np.float32)
    logits[:, 4] = 10.0  # x
    logits[:, 2] = 5.0  # b
    logits[:, 3] = 1.0  # c
    tree = DraftTree.chain([4, 4])
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=1)):
        constraint = TOY.constraint(_guided({"regex": "[bc]+"}).guided)
        new, path = verify(logits, tree, sampling, np.random.default_rng(0), constraint)
        assert path == [] and len(new) == 1 and new[0] in (2, 3)
    constraint = TOY.constraint(_guided({"regex": "[bc]+"}).guided)
    assert verify(logits, tree, SamplingParams(), np.random.default_rng(0), constraint) == ([2], [])
    # unconstrained, the same pass accepts both drafts
    assert verify(logits, tree, SamplingParams(), np.random.default_rng(0)) == ([4, 4, 4], [0, 1])


def test_sampled_tokens_under_a_mask_follow_the_masked_distribution():
    """Candidates drawn i.i.d. from a q that puts most mass on forbidden tokens: the emitted
    token is distributed as the target's distribution restricted to the allowed tokens."""
    rng = np.random.default_rng(3)
    vocab = len(TOY_TOKENS)
    row = rng.normal(size=vocab).astype(np.float32)
    sampling = SamplingParams(temperature=0.8)
    constraint = TOY.constraint(_guided({"regex": "(a|b|c|ab)y"}).guided)
    allowed = constraint.mask()
    p = distribution(np.where(allowed, row, -np.inf), sampling)
    q = np.array([0.0, 0.1, 0.05, 0.05, 0.4, 0.3, 0.1, 0.0])
    counts, n = np.zeros(vocab), 12000
    for _ in range(n):
        tree = DraftTree()
        for token in rng.choice(vocab, size=3, p=q):
            tree.add(int(token), -1)
        tree.q[-1] = q
        logits = np.tile(row, (len(tree.tokens) + 1, 1))
        new, _ = verify(logits, tree, sampling, rng, constraint)
        counts[new[0]] += 1
        constraint.rollback(len(new))
    assert counts[~allowed].sum() == 0
    assert g_test_p_value(counts[allowed], p[allowed] * n) > 1e-3


class ForbiddenProposer:
    """Proposes a run of "!!!!" tokens, which no JSON object allows after its first token."""

    name = "forbidden"
    wants_taps = False

    def __init__(self, token: int):
        self.token = token

    def start(self, request):
        token = self.token

        class Drafter(BaseDrafter):
            def propose(self, history, max_depth, max_nodes):
                return DraftTree.chain([token] * min(4, max_depth))

        return Drafter()


@pytest.fixture(scope="module")
def generator():
    from dspark.llm.tokenizer import LlamaTokenizer

    bang = LlamaTokenizer.load(SMOLLM2 / "tokenizer.json").encode("!!!!")
    assert len(bang) == 1
    # the default model proposers (DSpark's drafter, trained for SmolLM2) and the forbidden one
    from dspark.triton.models import dspark_proposers

    return llm_generator(SMOLLM2, threads=2, max_context=512, draft=SMOLLM2,
                         model_proposers=(*dspark_proposers(SMOLLM2), ForbiddenProposer(bang[0])))


USER = "Describe a user of a web shop as JSON: name, age and tags."
ANSWER = 'Reply with a JSON object with a key "answer" whose value is the capital of France.'


def _run(generator, guided: dict, method: str, stats: DecodeStats, prompt: str = USER, **sampling) -> str:
    ids = generator.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=80, guided=_guided(guided).guided, **sampling)
    return generator.complete(ids, params, SpeculativeParams(method, num_speculative_tokens=4, tree_width=3),
                              stats)


def test_every_method_gives_constrained_plain_greedy_text_valid_under_the_schema(generator):
    methods = generator.engine.methods
    assert {"none", "ngram", "suffix", "draft", "tree", "dspark", "hybrid", "forbidden"} <= set(methods)
    plain_stats = DecodeStats()
    plain = _run(generator, {"json_schema": PERSON}, "none", plain_stats)
    jsonschema.validate(json.loads(plain), PERSON)
    assert plain_stats.finish_reason == "stop"
    for method in methods:
        stats = DecodeStats()
        assert _run(generator, {"json_schema": PERSON}, method, stats) == plain, method
        assert stats.finish_reason == "stop", method
        if method == "draft":  # the draft is the target: the grammar keeps its guesses
            assert stats.accepted > 0
        if method == "forbidden":
            assert stats.proposed > 0 and stats.accepted == 0


def test_sampled_constrained_output_is_valid_for_every_kind(generator):
    for seed, method in enumerate(("none", "draft", "hybrid")):
        stats = DecodeStats()
        text = _run(generator, {"json_schema": PERSON}, method, stats, temperature=1.0, seed=seed)
        jsonschema.validate(json.loads(text), PERSON)
        # any object: unbounded, so a sampled one may outrun max_tokens; greedy it is complete
        text = _run(generator, {"json_object": True}, method, DecodeStats(), ANSWER)
        assert json.loads(text) == {"answer": "Paris"}
        text = _run(generator, {"regex": "[A-Z][a-z]{2,8} [0-9]{2}"}, method, DecodeStats(), temperature=1.0,
                    seed=seed)
        assert re.fullmatch("[A-Z][a-z]{2,8} [0-9]{2}", text), text
        text = _run(generator, {"choice": ["alpha", "beta gamma"]}, method, DecodeStats(), temperature=1.0,
                    seed=seed)
        assert text in ("alpha", "beta gamma")
