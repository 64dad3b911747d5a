"""Proposers: one module per way of guessing tokens, all behind ``base.Proposer``.

| method | module | needs |
|---|---|---|
| ``none`` | ``base.PlainDecoding`` | - |
| ``ngram`` | ``ngram`` (prompt lookup) | - |
| ``suffix`` | ``suffix`` (SuffixDecoding: this request + earlier outputs) | - |
| ``draft`` | ``draft_model`` (a draft LM's chain) | a draft LM (parameter ``draft_llm``) |
| ``tree`` | ``draft_tree`` (a draft LM's tree) | a draft LM (parameter ``draft_llm``) |
| ``dspark`` | ``dspark`` (DSpark block drafter) | the DSpark drafter |
| ``hybrid`` | ``hybrid`` (a model-based proposer + a lookup) | a model-based proposer |
"""
from __future__ import annotations

from typing import Optional

from dspark.decoding.proposers.base import Drafter, DraftRequest, PlainDecoding, Proposer
from dspark.decoding.proposers.draft_model import DRAFT_MIN_CONFIDENCE, DraftModelProposer
from dspark.decoding.proposers.draft_tree import DraftTreeProposer
from dspark.decoding.proposers.hybrid import HybridProposer
from dspark.decoding.proposers.ngram import PromptLookupProposer
from dspark.decoding.proposers.suffix import OutputCache, SuffixProposer

# Hybrid trusts a prompt-lookup match of at least this many tokens (1 token is mostly noise).
HYBRID_MIN_NGRAM = 2

__all__ = ["Drafter", "DraftRequest", "PlainDecoding", "Proposer", "standard_proposers"]


def standard_proposers(draft_lm=None, model_proposers: tuple[Proposer, ...] = (),
                       draft_min_confidence: float = DRAFT_MIN_CONFIDENCE,
                       output_cache: Optional[OutputCache] = None) -> list[Proposer]:
    """Every proposer the given models allow: the lookups always; ``draft`` and ``tree`` with a
    draft LM; ``model_proposers`` (e.g. DSpark's) as given; ``hybrid`` over the first
    model-based proposer (``model_proposers`` before the draft LM's chain) and prompt lookup."""
    proposers: list[Proposer] = [PromptLookupProposer(), SuffixProposer(output_cache)]
    models = list(model_proposers)
    if draft_lm is not None:
        chain = DraftModelProposer(draft_lm, draft_min_confidence)
        models.append(chain)
        proposers += [chain, DraftTreeProposer(draft_lm, draft_min_confidence)]
    proposers += list(model_proposers)
    if models:
        proposers.append(HybridProposer(models[0], PromptLookupProposer(min_ngram=HYBRID_MIN_NGRAM)))
    return proposers
