"""Text in, text out: tokenizer, chat template, stop strings and streamed deltas over the token
engine."""
from __future__ import annotations

import codecs
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Optional

from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.sampling import SamplingParams, SpeculativeParams, TokenLogprob
from dspark.decoding.stats import DecodeStats
from dspark.errors import RequestError
from dspark.runtimes.protocol import Tokenizer

class Detokenizer:
    """Text deltas of a growing token sequence. Byte-level BPE splits characters across tokens:
    an incremental UTF-8 decoder over the tokens' exact bytes holds an unfinished character back."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, new: list[int]) -> str:
        return self._utf8.decode(self.tokenizer.decode_bytes(new))

    def flush(self) -> str:
        """The end of the text: the bytes of a character the generation stopped inside (a reply
        cut by its token limit) are dropped, never sent as U+FFFD; their tokens still count."""
        self._utf8.reset()
        return ""


class Delta(str):
    """A text delta; ``logprobs`` (when the request asked for them): one entry per token whose
    text ends in this delta (``TextGenerator.logprob_entry``); ``final``: the text ends here."""
    logprobs: Optional[list[dict]] = None
    final: bool = False


def join_deltas(pieces: list[str]) -> str:
    """One delta of several, their log-probabilities in order."""
    joined = Delta("".join(pieces))
    if any(getattr(piece, "logprobs", None) is not None for piece in pieces):
        joined.logprobs = [e for piece in pieces for e in (getattr(piece, "logprobs", None) or [])]
    return joined


class TextGenerator:
    def __init__(self, engine: SpeculativeEngine, tokenizer: Tokenizer,
                 max_token_bytes: Optional[int] = None):
        self.engine = engine
        self.tokenizer = tokenizer
        # the longest token's UTF-8 length bounds how few tokens a text can be: a prompt longer
        # than context x this is refused before it is tokenized
        self.max_token_bytes = max_token_bytes or 256

    def encode(self, prompt: str, field: str = "text_input") -> list[int]:
        """Token ids of a prompt; one too long for the context is refused by its size first,
        so an oversized prompt costs no tokenization."""
        size = len(prompt.encode("utf-8"))
        if size > self.engine.context * self.max_token_bytes:
            raise RequestError(field, f"prompt is {size} bytes, more than the context of "
                                      f"{self.engine.context} tokens can hold; shorten it")
        return self.tokenizer.encode(prompt)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.tokenizer.chat_template)

    @property
    def chat_stop(self) -> tuple[str, ...]:
        """Stop strings every chat reply gets from the model's chat format (none for most)."""
        return tuple(self.tokenizer.chat_stop)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The model's chat template over ``messages``, the assistant's turn opened."""
        if not self.has_chat_template:
            raise RequestError("sampling_parameters.chat", "this model has no chat template")
        size = sum(len(m["content"].encode("utf-8")) for m in messages)
        if size > self.engine.context * self.max_token_bytes:
            raise RequestError("messages", f"the messages are {size} bytes, more than the context "
                                           f"of {self.engine.context} tokens can hold; shorten them")
        return self.encode(self.tokenizer.apply_chat_template(messages), "messages")

    def stream(self, prompt: "str | list[int]", sampling: SamplingParams, spec: SpeculativeParams,
               stats: Optional[DecodeStats] = None,
               cancelled: Optional[Callable[[], bool]] = None) -> Iterator[str]:
        """Yield text deltas. Text that could still start a stop string is held back until it
        cannot; the stop string and everything after it are never sent."""
        stats = stats if stats is not None else DecodeStats()
        ids = self.encode(prompt) if isinstance(prompt, str) else prompt
        tokens = self.engine.generate(ids, sampling, spec, stats, cancelled)
        detokenizer = Detokenizer(self.tokenizer)
        text, sent = "", 0
        hold = max((len(s) for s in sampling.stop), default=1) - 1
        # with logprobs: each token's entry and where its text starts, until its delta is sent
        pending: list[tuple[int, dict]] = []
        want = sampling.logprobs is not None

        def delta(end: int, last: bool = False) -> str:
            piece = Delta(text[sent:end])
            piece.final = last
            if want:
                piece.logprobs = [e for start, e in pending if start < end or last]
                pending[:] = [(start, e) for start, e in pending if not (start < end or last)]
            return piece

        try:
            for new in tokens:
                if want:
                    for entry in new.logprobs:
                        pending.append((len(text), self.logprob_entry(entry)))
                        text += detokenizer.add([entry.token])
                else:
                    text += detokenizer.add(new)
                cut = _find_stop(text, sampling.stop, max(0, sent - hold))
                if cut is not None:
                    if cut > sent:
                        pending[:] = [(start, e) for start, e in pending if start < cut]
                        yield delta(cut, last=True)
                    stats.finish_reason = "stop"
                    return
                safe = len(text) - hold
                if safe > sent and not new.last:  # the last tokens' text goes in the final delta
                    yield delta(safe)
                    sent = safe
            text += detokenizer.flush()
            cut = _find_stop(text, sampling.stop, max(0, sent - hold))
            if cut is not None:
                stats.finish_reason = "stop"
                text = text[:cut]
                pending[:] = [(start, e) for start, e in pending if start < cut]
            if len(text) > sent or pending:
                yield delta(len(text), last=True)
        finally:
            tokens.close()  # ends the request's round loop now, also when the consumer stops

    def token_entry(self, token: int, logprob: float) -> dict:
        raw = self.tokenizer.decode_bytes([token])
        return {"id": token, "text": raw.decode("utf-8", errors="replace"), "bytes": list(raw),
                "logprob": logprob}

    def logprob_entry(self, entry: TokenLogprob) -> dict:
        """A token's log-probabilities as the APIs report them: its id, text, UTF-8 bytes,
        logprob and ``top_logprobs`` (the same, for the most likely tokens)."""
        return {**self.token_entry(entry.token, entry.logprob),
                "top_logprobs": [self.token_entry(t, v) for t, v in entry.top]}

    def complete(self, prompt: "str | list[int]", sampling: SamplingParams,
                 spec: SpeculativeParams, stats: Optional[DecodeStats] = None) -> str:
        return "".join(self.stream(prompt, sampling, spec, stats))


def _find_stop(text: str, stops: list[str], start: int) -> int | None:
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def send_coalesced(pieces: Iterable[str], send: Callable[[str], None],
                   min_interval_s: float = 0.0) -> str:
    """Send ``pieces`` (produced on a helper thread) as one message per ``send`` call,
    joining whatever arrived while the previous send was in flight or within
    ``min_interval_s`` of it. Generation never waits for the transport, and each message's
    fixed cost (Triton's IPC + gRPC, ~0.5-1 ms) is paid at most once per interval. The first
    piece goes out at once; an error while producing is raised here after the pieces before
    it were sent; if ``send`` raises, production stops at the next piece.

    Returns the text that production ended with and that was not sent (a delta marked
    ``final``, or what arrived after the last send), for the caller's final message: a short
    reply then costs one message, not two.

    The sending thread sleeps until a message is due, and the producer wakes it only for a
    piece that arrives when one is, or at the end: never per piece, as on 2 cores each thread
    wake-up preempts a decoding thread."""
    state = _Coalescer(min_interval_s)
    producer = threading.Thread(target=state.produce, args=(pieces,), daemon=True)
    producer.start()
    rest = Delta("")
    try:
        while (message := state.next_message()) is not None:
            text, last = message
            if last:
                rest = text
                break
            send(text)
            state.sent()
    finally:
        state.stop()
    producer.join()
    if state.failure is not None:
        raise state.failure
    return rest


class _Coalescer:
    """What ``send_coalesced``'s two threads share: the pieces not yet sent, and when to wake."""

    def __init__(self, min_interval_s: float):
        self.min_interval_s = min_interval_s
        self.buffer: list[str] = []
        self.last_sent = float("-inf")
        self.done = self.stopped = False
        self.failure: Optional[BaseException] = None
        self._ready = threading.Condition()

    def produce(self, pieces: Iterable[str]) -> None:
        try:
            for piece in pieces:
                with self._ready:
                    if self.stopped:
                        break
                    self.buffer.append(piece)
                    if getattr(piece, "final", False):
                        self.done = True  # the sender takes it with the rest, as the last
                        self._ready.notify()
                    elif time.monotonic() >= self.last_sent + self.min_interval_s:
                        self._ready.notify()
        except BaseException as error:  # noqa: BLE001 - handed to the sending thread
            self.failure = error
        with self._ready:
            self.done = True
            self._ready.notify()

    def next_message(self) -> Optional[tuple[str, bool]]:
        """The text of the next message once it is due, and whether production had ended when
        it was taken (nothing comes after it); None when it has and everything was sent."""
        with self._ready:
            while not self.done:
                wait = self.last_sent + self.min_interval_s - time.monotonic()
                if wait <= 0 and self.buffer:
                    break
                # until the message is due; once due, until the producer has a piece
                self._ready.wait(wait if wait > 0 else None)
            if not self.buffer:
                return None
            text, self.buffer = join_deltas(self.buffer), []
            return text, self.done and self.failure is None

    def sent(self) -> None:
        with self._ready:
            self.last_sent = time.monotonic()

    def stop(self) -> None:
        with self._ready:
            self.stopped = True
