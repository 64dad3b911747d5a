"""The interface every target runtime of the speculative engine offers (``dspark.decoding``):
a KV cache per request and a forward pass over new rows, with what the runtime can do declared as
typed members, not probed.

Runtime: ``dspark.llm.kernel_runtime.KernelRuntime`` (a GGUF LLM on dspark's C kernels, the
target and a draft model alike); ``Tokenizer``: what the text generator needs of a tokenizer.
"""
from __future__ import annotations

from typing import Any, ClassVar, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from dspark.errors import RequestError


class CacheRows:
    """What every KV cache here shares: ``length`` rows valid out of ``capacity``, and rollback by
    setting a shorter length (rows past it are stale and never attended to). Each runtime keeps
    its own storage and its own ``keep_rows(base, rows)`` (moving accepted rows into place)."""
    length: int
    capacity: int

    def check_room(self, new_rows: int) -> None:
        if self.length + new_rows > self.capacity:
            raise RequestError("tokens", f"context full: {self.length} cached + {new_rows} new > "
                                         f"{self.capacity}")

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back cache of length {self.length} to {length}")
        self.length = length

    def keep_rows(self, base: int, rows: np.ndarray) -> None:
        """Keep the new rows ``rows`` (offsets from ``base``) at base, base+1, ...; drop the rest."""
        raise NotImplementedError

    def read_rows(self, start: int, stop: int) -> Any:
        """A copy of rows ``start:stop`` (its ``nbytes`` says its size), for ``write_rows`` into
        another cache of the same model (prefix caching: runtimes that declare ``copies_rows``)."""
        raise NotImplementedError

    def write_rows(self, start: int, rows: Any) -> None:
        """Put rows from ``read_rows`` at ``start``; the cache then ends after them."""
        raise NotImplementedError


@runtime_checkable
class TargetRuntime(Protocol):
    """``config.ctx``: the longest context; ``config.vocab``: logits per row."""

    config: Any
    # a tree's rows come out bit for bit as the chains through it would (greedy requests may then
    # verify whole trees and stay identical to plain decoding; otherwise they verify chains only)
    exact_trees: ClassVar[bool] = False
    # ``forward(..., logit_rows=())`` and ``forward_batch(..., skip_logits=...)`` skip the head
    # product for rows nobody reads (a prompt's chunks)
    skips_logits: ClassVar[bool] = False
    # its caches' ``read_rows`` / ``write_rows`` copy rows between requests (in whole blocks of
    # 16 rows), so the engine may keep a prefix cache (``dspark.decoding.prefix_cache``)
    copies_rows: ClassVar[bool] = False

    def new_cache(self, capacity: Optional[int] = None) -> CacheRows:
        """An empty cache of ``capacity`` rows (default the context)."""
        ...

    def forward(self, cache: CacheRows, tokens: Sequence[int], positions: Sequence[int],
                tree_mask: Optional[np.ndarray] = None, want_taps: bool = False, **rows: Any):
        """Logits [T, vocab] of T new rows appended to ``cache`` (``(logits, taps)`` with
        ``want_taps``); ``tree_mask`` (T x T, default causal) says which new row sees which."""
        ...

    def forward_batch(self, items: Sequence[tuple], want_taps: bool = False, **rows: Any) -> list:
        """Several requests' ``(cache, tokens, positions, tree_mask)`` in one call; results in item
        order, bitwise equal to separate ``forward`` calls."""
        ...


class Tokenizer(Protocol):
    """What the generator needs of a tokenizer (``dspark.llm.tokenizer.LlamaTokenizer``)."""

    chat_template: Optional[str] = None  # the model's chat format; None: it cannot chat
    chat_stop: tuple[str, ...] = ()  # stop strings every chat reply gets from that format

    def encode(self, text: str) -> list[int]: ...

    def decode_bytes(self, ids: list[int]) -> bytes:
        """The tokens' exact bytes (a character may be split between tokens)."""
        ...

    def apply_chat_template(self, messages: list[dict]) -> str: ...
