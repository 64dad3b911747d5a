"""Text generators over the models a speculative model serves."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from dspark.decoding.engine import SpeculativeEngine
from dspark.runtimes.toy_lm.runtime import KernelLM, OnnxLM
from dspark.decoding.proposers import standard_proposers
from dspark.decoding.text import TextGenerator
from dspark.runtimes.toy_lm.tokenizer import BPETokenizer

DRAFT_RUNTIMES = {"kernel": KernelLM, "onnxruntime": OnnxLM}


def toy_generator(target: Path, draft: Optional[Path], tokenizer: Path, threads: int = 1,
                  draft_runtime: str = "kernel", batch_verification: bool = False,
                  context: Optional[int] = None) -> TextGenerator:
    """The 5 M-parameter LM pair trained here (``spec_target``/``spec_draft``): a fast test
    fixture. ``draft_runtime``: "kernel" (dspark's C forward pass) or "onnxruntime"."""
    draft_lm = DRAFT_RUNTIMES[draft_runtime](draft, threads) if draft else None
    engine = SpeculativeEngine(OnnxLM(target, threads), standard_proposers(draft_lm),
                               context=context, batch_verification=batch_verification)
    bpe = BPETokenizer.load(tokenizer)
    return TextGenerator(engine, bpe, max_token_bytes=max(len(t) for t in bpe.tokens))


def llm_generator(folder: Path, threads: int = 2, max_context: Optional[int] = None,
                  batch_verification: bool = False,
                  model_proposers: Optional[tuple] = None) -> TextGenerator:
    """A real LLM imported by ``dspark llm import`` (``folder``: import.json naming the GGUF,
    tokenizer.json) on dspark's kernels, with the model-free proposers and ``model_proposers`` (default: DSpark's when a drafter was
    trained for this model)."""
    if model_proposers is None:
        from dspark.decoding.proposers.dspark import dspark_proposers

        model_proposers = dspark_proposers(folder)
    from dspark.llm.tokenizer import LlamaTokenizer

    from dspark.llm.importer import import_source
    from dspark.llm.kernel_runtime import DEFAULT_MAX_CONTEXT, KernelRuntime

    # the runtime maps the GGUF only while packing it: its own mapping, dropped after load,
    # gives back the ~60 MiB of pages packing touched (sharing the drafter's kept them resident)
    target = KernelRuntime(import_source(folder), threads=threads,
                           max_context=max_context or DEFAULT_MAX_CONTEXT)
    tokenizer = LlamaTokenizer.load(folder / "tokenizer.json")
    engine = SpeculativeEngine(target, standard_proposers(model_proposers=model_proposers),
                               eos_ids=[tokenizer.eos_id], batch_verification=batch_verification)
    longest = max(len(tokenizer.decode_bytes([i])) for i in range(tokenizer.vocab_size))
    return TextGenerator(engine, tokenizer, max_token_bytes=longest)
