"""A draft pair made by `dspark llm import TARGET --name NAME --draft DRAFT` and served by a real
tritonserver: SmolLM2-135M (the demo's GGUF) as its own draft model. Every method's greedy text
over /generate and gRPC streaming is plain decoding's, and the draft's guesses are accepted;
through the OpenAI API the draft methods give plain decoding's greedy, seeded and
schema-constrained replies."""
from __future__ import annotations

import json

import openai
import pytest
from click.testing import CliRunner

from dspark.cli.main import cli
from dspark.llm.importer import import_source
from dspark.paths import project_root
from tests.conftest import serving
from tests.integration.conftest import serve_openai
from tests.integration.spec_client import completion, metric, stream_once

pytestmark = pytest.mark.integration

MODEL = "smol_pair"
PROMPT = "Python's list comprehensions are"


@pytest.fixture(scope="module")
def pair_server(request, tmp_path_factory):
    gguf = import_source(project_root() / "model_repository" / "spec_lm" / "1" / "smollm2")
    repository = tmp_path_factory.mktemp("pair_repository")
    made = CliRunner().invoke(cli, ["llm", "import", str(gguf), "--name", MODEL, "--draft", str(gguf),
                                    "-r", str(repository)])
    assert made.exit_code == 0, made.output
    with serving(request, [repository]) as server:
        yield server


def test_the_imported_pair_serves_every_method_with_plain_greedy_text(pair_server):
    plain = completion(pair_server, MODEL, PROMPT, max_tokens=24, speculative={"method": "none"})
    assert len(plain) > 20
    for method in ("draft", "tree", "hybrid", "suffix", "ngram"):
        accepted = metric(pair_server, MODEL, "dspark_speculative_accepted_total")
        spec = {"method": method, "adaptive": False}  # the model as its own draft never pays
        assert completion(pair_server, MODEL, PROMPT, max_tokens=24, speculative=spec) == plain, method
        if method in ("draft", "tree"):
            # everything guessed is right: most tokens come from the draft, the rest are the passes' own
            assert metric(pair_server, MODEL, "dspark_speculative_accepted_total") >= accepted + 12, method
    streamed = stream_once(pair_server, MODEL, PROMPT, {"max_tokens": 24, "speculative": {"method": "tree"}})
    assert streamed.final and streamed.text == plain


def test_the_draft_methods_through_the_openai_api_give_plain_decodings_replies(pair_server):
    api = serve_openai(pair_server)
    try:
        client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=120)
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                   "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}
        cases = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.8, "seed": 5},
                 "schema": {"temperature": 0, "response_format": {"type": "json_schema",
                                                "json_schema": {"name": "person", "schema": schema, "strict": True}}}}

        def reply(method: str, case: str) -> str:
            return client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Describe a person in JSON."}], max_tokens=40,
                extra_body={"speculative": {"method": method, "adaptive": False}}, **cases[case]).choices[0].message.content

        for case in cases:
            plain = reply("none", case)
            assert reply("draft", case) == plain and reply("tree", case) == plain, case
        person = json.loads(reply("tree", "schema"))
        assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    finally:
        api.stop()
