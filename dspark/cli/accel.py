"""`dspark info` lines for the accelerator layer: execution providers, the models' choices."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import click


def model_provider_choices(repositories: Sequence[Path]) -> list[tuple[str, str]]:
    """(model, its provider choice and why) for every `onnx`-backend model in the repositories."""
    from dspark.accel.providers import ProviderRequest, choose
    from dspark.errors import ConfigError
    from dspark.repository.repo import load_entries

    entries, _ = load_entries(repositories)
    rows = []
    for entry in entries:
        if entry.config is None or entry.config.backend != "onnx":
            continue
        params = {key: value.string_value for key, value in entry.config.parameters.items()}
        try:
            rows.append((entry.name, choose(ProviderRequest.from_parameters(params)).describe()))
        except ConfigError as error:
            rows.append((entry.name, f"fails to load: {error}"))
    return rows


def echo_accelerator_info(repositories: Sequence[Path]) -> None:
    from dspark.accel.providers import probe_all

    click.echo("providers     (usable = in this onnxruntime build + a device + its libraries)")
    for info, result in probe_all():
        mark = "usable" if result.usable else "no    "
        click.echo(f"  {info.short:<9} {mark} {info.vendor}: {result.reason}")
    for model, choice in model_provider_choices(repositories):
        click.echo(f"  model {model}: {choice}")
