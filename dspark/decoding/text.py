"""Text in, text out: tokenizer, stop strings and streamed deltas over the token engine."""
from __future__ import annotations

import codecs
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from dspark.decoding.engine import DecodeStats, SpeculativeEngine
from dspark.decoding.lm import KernelLM, OnnxLM
from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.decoding.tokenizer import BPETokenizer

DRAFT_RUNTIMES = {"kernel": KernelLM, "onnxruntime": OnnxLM}


class TextGenerator:
    def __init__(self, engine: SpeculativeEngine, tokenizer: BPETokenizer):
        self.engine = engine
        self.tokenizer = tokenizer

    @classmethod
    def from_files(cls, target: Path, draft: Path | None, tokenizer: Path, threads: int = 1,
                   draft_runtime: str = "kernel") -> "TextGenerator":
        """``draft_runtime``: "kernel" (dspark's C forward pass) or "onnxruntime"."""
        draft_lm = DRAFT_RUNTIMES[draft_runtime](draft, threads) if draft else None
        return cls(SpeculativeEngine(OnnxLM(target, threads), draft_lm),
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


_DONE = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def send_coalesced(pieces: Iterable[str], send: Callable[[str], None],
                   min_interval_s: float = 0.0) -> None:
    """Send ``pieces`` (produced on a helper thread) as one message per ``send`` call,
    joining whatever arrived while the previous send was in flight or within
    ``min_interval_s`` of it. Generation never waits for the transport, and each message's
    fixed cost (Triton's IPC + gRPC, ~0.5-1 ms) is paid at most once per interval. The first
    piece goes out at once; an error while producing is raised here after the pieces before
    it were sent; if ``send`` raises, production stops at the next piece."""
    items: queue.Queue = queue.Queue()
    stop = threading.Event()

    def produce() -> None:
        try:
            for piece in pieces:
                items.put(piece)
                if stop.is_set():
                    break
        except BaseException as error:  # noqa: BLE001 - handed to the sending thread
            items.put(_Failed(error))
        items.put(_DONE)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    buffer: list[str] = []
    last = float("-inf")
    failure = None
    try:
        done = False
        while not done:
            wait = None if not buffer else last + min_interval_s - time.monotonic()
            try:
                item = items.get() if wait is None else items.get(timeout=max(wait, 0.0))
            except queue.Empty:
                item = None
            while item is not None:  # take everything already queued
                if item is _DONE:
                    done = True
                elif isinstance(item, _Failed):
                    failure = item.error
                else:
                    buffer.append(item)
                try:
                    item = items.get_nowait()
                except queue.Empty:
                    item = None
            if buffer and (done or time.monotonic() >= last + min_interval_s):
                send("".join(buffer))
                buffer, last = [], time.monotonic()
    finally:
        stop.set()
    producer.join()
    if failure is not None:
        raise failure
