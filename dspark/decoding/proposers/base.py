"""The one interface every proposer implements (as vLLM's v1 spec_decode proposers do).

A ``Proposer`` is made once per model (it holds the draft model, a global index, ...) and is
selected per request by ``speculative.method`` = its ``name``. For each request it starts a
``Drafter``, which holds that request's state (a draft KV cache, an index over its tokens, its
adaptive draft length) and, every round, proposes a ``DraftTree`` below the last committed
token. The engine verifies the tree in one target pass (``dspark.decoding.rejection``) and tells
the drafter what was kept. Whatever a drafter proposes, greedy output equals plain decoding and
sampled output follows the target's distribution: a proposer only changes the speed. For
sampled requests a drafter either records in ``tree.q[node]`` the distribution it drew
``node``'s children from (i.i.d. draws), or proposes deterministically (no ``q``). With
``DraftRequest.chains_only`` a drafter proposes chains (the engine keeps a tree's first path
otherwise).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Optional, Protocol, runtime_checkable

import numpy as np

from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.decoding.stats import DecodeStats
from dspark.decoding.tree import DraftTree


@dataclass
class DraftRequest:
    """What a drafter knows about its request. ``context``: the longest sequence (prompt +
    output) the target caches; ``verify_cost(n)``: the measured cost of a target pass over n
    rows relative to one row (for proposers that choose how many guesses to send)."""
    prompt: list[int]
    sampling: SamplingParams
    spec: SpeculativeParams
    rng: np.random.Generator
    stats: DecodeStats
    context: int
    verify_cost: Callable[[int], float]
    # greedy on a target whose tree rows are not bitwise equal to a chain's: propose chains
    # (a branch's rows could flip a near-tie and break identity with plain decoding)
    chains_only: bool = False


@runtime_checkable
class Drafter(Protocol):
    """One request's proposer state."""

    def prefilled(self, taps: Optional[np.ndarray]) -> None:
        """The target has read the prompt but its last token; ``taps``: the target's tapped hidden
        states of those rows (``dspark.llm.taps``) when the proposer ``wants_taps``, else None."""

    def propose(self, history: list[int], max_depth: int, max_nodes: int) -> DraftTree:
        """Guesses below ``history[-1]``: at most ``max_depth`` deep and ``max_nodes`` nodes (the
        cache room and the token budget); an empty tree means plain decoding this round."""

    def verified(self, tree: DraftTree, path: list[int], new: list[int],
                 taps: Optional[np.ndarray], target_s: float) -> None:
        """The pass kept ``path`` (nodes of ``tree``) and emitted ``new`` (the path's tokens and the
        target's own next one); ``taps``: tapped states of the rows now committed (the root and
        the path); ``target_s``: the pass's seconds (0 when unknown: the
        round shared its pass with a prompt's rows)."""

    def finish(self, output: list[int]) -> None:
        """The request ended with ``output`` (also when cancelled); release per-request state."""


class BaseDrafter:
    """No-op hooks, for drafters that need only some of them."""

    def prefilled(self, taps: Optional[np.ndarray]) -> None:
        pass

    def propose(self, history: list[int], max_depth: int, max_nodes: int) -> DraftTree:
        return DraftTree()

    def verified(self, tree: DraftTree, path: list[int], new: list[int],
                 taps: Optional[np.ndarray], target_s: float) -> None:
        pass

    def finish(self, output: list[int]) -> None:
        pass


@runtime_checkable
class Proposer(Protocol):
    name: ClassVar[str]  # the speculative.method that selects it
    wants_taps: ClassVar[bool]  # the engine computes the target's tapped hidden states for it

    def start(self, request: DraftRequest) -> Drafter:
        """A drafter for one request (may start work in the background, e.g. a draft prefill)."""


class PlainDecoding:
    """``none``: no guesses, one target pass per token (the same round loop)."""

    name: ClassVar[str] = "none"
    wants_taps: ClassVar[bool] = False

    def start(self, request: DraftRequest) -> Drafter:
        return BaseDrafter()


def agreed(chain: list[int], new: list[int]) -> int:
    """How many leading tokens of a proposed chain the pass kept."""
    n = 0
    for proposed, kept in zip(chain, new[:-1]):
        if proposed != kept:
            break
        n += 1
    return n
