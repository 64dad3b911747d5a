"""Sampling and speculation parameters (validated by pydantic: an error names the field) and the
logits -> distribution transform."""
from __future__ import annotations

from dataclasses import dataclass as record, field
from typing import Annotated, Optional

import numpy as np
from pydantic import ConfigDict, Field, field_validator
from pydantic.dataclasses import dataclass
from pydantic_core import PydanticCustomError

from dspark.decoding.constraint import Guided

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
    guided: Optional[Guided] = None  # the grammar the output follows (dspark.decoding.constraint)
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
    return sample_at(p, rng.random())


def sample_at(p: np.ndarray, u: float) -> int:
    """The token whose interval of the cumulative distribution holds ``u`` in [0, 1)."""
    return int(min(np.searchsorted(np.cumsum(p), u * p.sum(), side="right"), len(p) - 1))


_MASK64 = (1 << 64) - 1


def seeded_uniform(seed: int, position: int, stream: int = 0) -> float:
    """A uniform draw in [0, 1) that depends on (seed, position) only (SplitMix64 of the pair);
    ``stream`` 1, 2... give further independent draws for the same position.

    A seeded request draws the token at each position of the sequence from this number, so
    its text depends on the seed alone: not on which guesses a proposer made, how many rows a
    pass verified, or what the proposer learnt from earlier requests."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + stream * 0x8CB92BA72F3D8DD7
         + 0x632BE59BD9B4E019) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return (x >> 11) / float(1 << 53)
