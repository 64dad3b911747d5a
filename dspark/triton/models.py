"""Model assembly for the speculative backend: an imported LLM (and a draft LLM that shares its
vocabulary) on dspark's kernels, its tokenizer and its proposers, as one text generator. It
lives on the Triton side, which picks the generator; ``dspark.decoding`` only runs it."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from dspark.decoding.constraint import Grammars
from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.prefix_cache import PrefixCache
from dspark.decoding.proposers import standard_proposers
from dspark.decoding.proposers.dspark import DSparkProposer
from dspark.decoding.text import TextGenerator

log = logging.getLogger(__name__)


def dspark_proposers(folder: Path, weights: str | Path | None = None, threads: int = 2) -> tuple[DSparkProposer, ...]:
    """DSpark's proposer for a model imported by ``dspark llm import`` when a drafter was trained
    for it (the weights name the GGUF they were trained on; default: the drafter trained for
    SmolLM2-135M-Instruct), else none: the model still serves every other method."""
    from dspark.drafters.dspark.model import DSparkDrafter, default_weights, drafter_target
    from dspark.llm.gguf_model import GGUFModel
    from dspark.llm.importer import import_source

    path = Path(weights or default_weights())
    if not path.is_file():
        log.info("dspark: no drafter weights at %s; method 'dspark' not offered", path)
        return ()
    source = import_source(folder)
    trained_on = drafter_target(path)
    if trained_on != source.name:
        log.info("dspark: drafter %s was trained for %s, not %s; method 'dspark' not offered",
                 path, trained_on, source.name)
        return ()
    return (DSparkProposer(DSparkDrafter.for_gguf(GGUFModel(source), path, "kernel", threads)),)


def grammars(tokenizer) -> Grammars:
    """Constrained decoding over this tokenizer's vocabulary (its tokens' bytes; the encoder
    without the BOS it adds to prompts)."""
    def encode(text: str) -> list[int]:
        ids = tokenizer.encode(text)
        return ids[1:] if tokenizer.add_bos and ids[:1] == [tokenizer.bos_id] else ids

    return Grammars(lambda: tokenizer.token_bytes, encode, [tokenizer.eos_id], tokenizer.special_ids)


def llm_generator(folder: Path, threads: int = 2, max_context: Optional[int] = None,
                  batch_verification: bool = False, model_proposers: Optional[tuple] = None,
                  draft: Optional[Path] = None, prefix_cache_mb: float = 0) -> TextGenerator:
    """A real LLM imported by ``dspark llm import`` (``folder``: import.json naming the GGUF,
    tokenizer.json) on dspark's kernels, with the model-free proposers, ``model_proposers``
    (default: DSpark's when a drafter was trained for this model) and, with ``draft`` (another
    imported folder whose GGUF lists the same tokens), the draft model's ``draft`` and ``tree``.
    ``prefix_cache_mb`` > 0: a prefix cache of that many MiB of the target's KV rows."""
    from dspark.llm.importer import check_same_vocabulary, import_source
    from dspark.llm.kernel_runtime import DEFAULT_MAX_CONTEXT, KernelRuntime
    from dspark.llm.tokenizer import LlamaTokenizer

    if model_proposers is None:
        model_proposers = dspark_proposers(folder, threads=threads)
    context = max_context or DEFAULT_MAX_CONTEXT
    source = import_source(folder)
    draft_lm = None
    if draft is not None:
        draft_source = import_source(draft)
        check_same_vocabulary(source, draft_source)
        # its own KV cache per request, as long as the target's (it drafts up to the same end)
        draft_lm = KernelRuntime(draft_source, threads=threads, max_context=context)
    # the runtime maps the GGUF only while packing it: its own mapping, dropped after load,
    # gives back the ~60 MiB of pages packing touched (sharing the drafter's kept them resident)
    target = KernelRuntime(source, threads=threads, max_context=context)
    if draft_lm is not None and draft_lm.config.ctx < target.config.ctx:
        from dspark.errors import ConfigError

        raise ConfigError("draft", f"its context is {draft_lm.config.ctx} tokens, the target's "
                          f"{target.config.ctx}: set the parameter max_context to at most {draft_lm.config.ctx}",
                          draft_source)
    tokenizer = LlamaTokenizer.load(folder / "tokenizer.json")
    prefix_cache = PrefixCache(int(prefix_cache_mb * (1 << 20))) if prefix_cache_mb > 0 else None
    engine = SpeculativeEngine(target, standard_proposers(draft_lm, model_proposers=model_proposers),
                               eos_ids=[tokenizer.eos_id], batch_verification=batch_verification,
                               grammars=grammars(tokenizer), prefix_cache=prefix_cache)
    engine.verify_cost.measure(target)  # this model's pass costs by rows, before the first request
    longest = max(len(tokenizer.decode_bytes([i])) for i in range(tokenizer.vocab_size))
    return TextGenerator(engine, tokenizer, max_token_bytes=longest)
