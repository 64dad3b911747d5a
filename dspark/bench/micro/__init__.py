"""Registered operator benchmarks (`dspark bench micro`): each is a function of keyword settings
that returns a BenchResult. Modules register on import; ``load_all`` imports them."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from dspark.bench.results import BenchResult
from dspark.errors import ConfigError

MODULES = ("fused", "sgemm", "pool", "gemm")


@dataclass(frozen=True)
class MicroBenchmark:
    name: str
    summary: str
    run: Callable[..., BenchResult]


REGISTRY: dict[str, MicroBenchmark] = {}


def register(name: str, summary: str) -> Callable[[Callable[..., BenchResult]], Callable[..., BenchResult]]:
    def decorate(run: Callable[..., BenchResult]) -> Callable[..., BenchResult]:
        REGISTRY[name] = MicroBenchmark(name, summary, run)
        return run
    return decorate


def load_all() -> dict[str, MicroBenchmark]:
    for module in MODULES:
        importlib.import_module(f"dspark.bench.micro.{module}")
    return REGISTRY


def get(name: str) -> MicroBenchmark:
    registry = load_all()
    if name not in registry:
        raise ConfigError("benchmark", f"no micro benchmark {name!r}; registered: {', '.join(sorted(registry))}")
    return registry[name]


def log_nothing(_: str) -> None:
    """The default progress sink: the CLI passes one that prints to stderr."""
