"""Accelerator parts of the CLI: the `dspark info` lines (execution providers, each model's choice,
the GemmEx shim's kernel path). `dspark bench gemm` lives in dspark/bench/micro/gemm.py."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import click


def model_provider_choices(repositories: Sequence[Path]) -> list[tuple[str, str]]:
    """(model, its provider choice and why) for every `onnx`-backend model in the repositories."""
    from dspark.runtimes.accel import tensorrt_engine
    from dspark.runtimes.accel.providers import ProviderRequest, choose
    from dspark.errors import ConfigError
    from dspark.repository.repo import load_entries

    entries, _ = load_entries(repositories)
    rows = []
    for entry in entries:
        if entry.config is None or entry.config.backend != "onnx":
            continue
        params = {key: value.string_value for key, value in entry.config.parameters.items()}
        try:
            choice = choose(ProviderRequest.from_parameters(params)).describe()
        except ConfigError as error:
            rows.append((entry.name, f"fails to load: {error}"))
            continue
        if params.get("engine") == "tensorrt":
            engine = tensorrt_engine.probe()
            choice = (f"{tensorrt_engine.ENGINE} ({engine.reason})" if engine.usable else
                      f"{choice}, {tensorrt_engine.ENGINE} not usable: {engine.reason}")
        rows.append((entry.name, choice))
    return rows


def echo_accelerator_info(repositories: Sequence[Path]) -> None:
    from dspark.runtimes.accel import gemm
    from dspark.runtimes.accel.providers import probe_all

    report = gemm.kernel_report()
    click.echo(f"GemmEx shim   {gemm.library_path().name}: paths built {', '.join(report.compiled)}; this CPU+OS runs "
               f"{', '.join(report.supported)}; chosen: {report.chosen}"
               + (f" ({gemm.SIMD_ENV}={report.override})" if report.override else
                  f" (auto; override with {gemm.SIMD_ENV}={'|'.join(gemm.PATHS)})"))
    cuda, why = gemm.cuda_available()
    click.echo(f"              CUDA back end: {'yes' if cuda else 'no'}, {why}")

    click.echo("providers     (usable = in this onnxruntime build + a device + its libraries)")
    for info, result in probe_all():
        mark = "usable" if result.usable else "no    "
        click.echo(f"  {info.short:<9} {mark} {info.vendor}: {result.reason}")
    for model, choice in model_provider_choices(repositories):
        click.echo(f"  model {model}: {choice}")


@click.group("accel")
def accel() -> None:
    """The accelerator layer: checks of its GPU path."""


@accel.command("check")
@click.option("--repository", type=click.Path(path_type=Path), default=None,
              help="the repository whose models are checked (default: the demo model_repository)")
@click.option("--size", type=int, default=4096, show_default=True, help="M = N = K of the throughput products")
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
@click.option("--strict", is_flag=True, help="fail when a check is skipped (or there is no GPU)")
def check(repository, **options) -> None:
    """Check the whole GPU path of the accelerator layer in one run (exit 1 when a check fails)."""
    from types import SimpleNamespace

    from dspark.paths import project_root
    from dspark.runtimes.accel.gpu_check import run_gpu_check

    repository = repository or project_root() / "model_repository"
    raise SystemExit(run_gpu_check(SimpleNamespace(repository=repository, **options)))
