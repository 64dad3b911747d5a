"""Sampling and speculation parameters (validated by pydantic: an error names the field) and the
logits -> distribution transform."""
from __future__ import annotations

from dataclasses import dataclass as record, field
from typing import Annotated, Optional

import numpy as np
from pydantic import ConfigDict, Field, field_validator
from pydantic.dataclasses import dataclass
from pydantic_core import PydanticCustomError

# Below this a temperature divides logits into overflow (and a subnormal one into inf - inf);
# 0 means greedy, anything in between is refused rather than silently changed.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 10.0
MAX_SEED = 2 ** 63 - 1
MAX_LOGPROBS = 20

_STRICT = ConfigDict(extra="forbid", strict=True)


@dataclass(config=_STRICT)
class SpeculativeParams:
    """How a request speculates. ``method`` names a proposer of the engine (the engine checks
    it is one it has); ``num_speculative_tokens`` is k (the start and upper bound when
    ``adaptive``), or the depth of a tree."""
    method: Annotated[str, Field(min_length=1, max_length=64)] = "hybrid"
    num_speculative_tokens: Annotated[int, Field(ge=1, le=16)] = 4
    tree_width: Annotated[int, Field(ge=1, le=8)] = 4
    adaptive: bool = True


@dataclass(config=_STRICT)
class SamplingParams:
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] = 64
    temperature: Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)] = 0.0
    top_k: Annotated[int, Field(ge=0)] = 0  # 0 = off
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    seed: Optional[Annotated[int, Field(ge=0, le=MAX_SEED)]] = None
    stop: list[Annotated[str, Field(min_length=1)]] = field(default_factory=list)
    # how many of the most likely alternatives to report with each token's log-probability
    # (0: the token's own only); None: no log-probabilities
    logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]] = None

    @field_validator("temperature")
    @classmethod
    def _greedy_or_usable(cls, value: float) -> float:
        if 0.0 < value < MIN_TEMPERATURE:
            raise PydanticCustomError("temperature_range", "must be 0 (greedy) or at least "
                                      f"{MIN_TEMPERATURE}: smaller values overflow the logits")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _as_list(cls, value):  # "stop": "x" means ["x"]
        return [value] if isinstance(value, str) else value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0




def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The sampling distribution (float64) after temperature, top-k and top-p."""
    z = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < len(z):
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = np.cumsum(p[order]) - p[order] < params.top_p  # smallest set reaching top_p
        mask = np.zeros_like(p, bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def position_uniforms(seed: int, position: int, size: int) -> np.ndarray:
    """One uniform in (0, 1) per token for absolute ``position`` of a request seeded ``seed``:
    from a counter-based generator (Philox) keyed by (seed, position) alone, so they do not
    depend on what was drawn before (a proposer's draws, the tokens accepted so far)."""
    key = np.array([seed, position], dtype=np.uint64)
    u = np.random.Generator(np.random.Philox(key=key)).random(size)
    return np.maximum(u, np.finfo(np.float64).tiny)


def seeded_token(p: np.ndarray, seed: int, position: int) -> int:
    """The token at ``position`` sampled from ``p`` by the Gumbel-max trick: argmax(log p + G),
    G = -log(-log U) i.i.d. standard Gumbel, is distributed exactly as p. Only p's support is
    scored (top-k and top-p make it small)."""
    support = np.flatnonzero(p)
    u = position_uniforms(seed, position, len(p))[support]
    return int(support[np.argmax(np.log(p[support]) - np.log(-np.log(u)))])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """The model's log-probabilities (float64) of one row of logits."""
    z = logits.astype(np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


@record(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target model (its raw distribution: before
    temperature, top-k and top-p) and the ``top`` most likely tokens with theirs, most likely
    first."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """``token``'s entry from the row of logits that emitted it."""
    logp = log_softmax(logits)
    best = np.argsort(-logp, kind="stable")[:top] if top else ()
    return TokenLogprob(int(token), float(logp[token]),
                        tuple((int(t), float(logp[t])) for t in best))


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    return int(min(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right"), len(p) - 1))
