"""Text in, text out: tokenizer, stop strings and streamed deltas over the token engine."""
from __future__ import annotations

import codecs
from collections.abc import Callable, Iterator
from pathlib import Path

from dspark.decoding.engine import DecodeStats, SpeculativeEngine
from dspark.decoding.lm import OnnxLM
from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.decoding.tokenizer import BPETokenizer


class TextGenerator:
    def __init__(self, engine: SpeculativeEngine, tokenizer: BPETokenizer):
        self.engine = engine
        self.tokenizer = tokenizer

    @classmethod
    def from_files(cls, target: Path, draft: Path | None, tokenizer: Path,
                   threads: int = 1) -> "TextGenerator":
        return cls(SpeculativeEngine(OnnxLM(target, threads),
                                     OnnxLM(draft, threads) if draft else None),
                   BPETokenizer.load(tokenizer))

    def stream(self, prompt: str, sampling: SamplingParams, spec: SpeculativeParams,
               stats: DecodeStats | None = None,
               cancelled: Callable[[], bool] | None = None) -> Iterator[str]:
        """Yield text deltas. Text that could still start a stop string is held back until it
        cannot; the stop string and everything after it are never sent."""
        stats = stats if stats is not None else DecodeStats()
        ids = self.tokenizer.encode(prompt)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text, sent = "", 0
        hold = max((len(s) for s in sampling.stop), default=1) - 1
        for new in self.engine.generate(ids, sampling, spec, stats, cancelled):
            text += decoder.decode(self.tokenizer.decode(new))
            cut = _find_stop(text, sampling.stop, max(0, sent - hold))
            if cut is not None:
                if cut > sent:
                    yield text[sent:cut]
                stats.finish_reason = "stop"
                return
            safe = len(text) - hold
            if safe > sent:
                yield text[sent:safe]
                sent = safe
        text += decoder.decode(b"", final=True)
        if len(text) > sent:
            yield text[sent:]

    def complete(self, prompt: str, sampling: SamplingParams, spec: SpeculativeParams,
                 stats: DecodeStats | None = None) -> str:
        return "".join(self.stream(prompt, sampling, spec, stats))


def _find_stop(text: str, stops: list[str], start: int) -> int | None:
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None
