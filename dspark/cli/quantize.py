"""`dspark quantize MODEL --int8 | --int4`: a quantized version of an ONNX model in a repository,
measured against the float version it came from."""
from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Optional

import click

from dspark.paths import project_root

SOURCE_PREFIX = "dspark quantize"  # how a version this command made records its source


def _next_version(newest: str, method: str) -> str:
    from dspark.repository.modelspec import SEMVER_PATTERN

    major, minor = re.match(SEMVER_PATTERN, newest).groups()[:2]
    return f"{major}.{int(minor) + 1}.0+{method}"


def _size(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.2f} MiB"


@click.command()
@click.argument("model")
@click.option("--repository", type=click.Path(path_type=Path), default=lambda: project_root() / "model_repository",
              show_default="model_repository/", help="The model repository holding MODEL (with its modelspec.yaml).")
@click.option("--int8", "bits", flag_value=8, help="INT8 weights and activations (dynamic by default).")
@click.option("--int4", "bits", flag_value=4, help="INT4 weight-only MatMuls (MatMulNBits blocks).")
@click.option("--static", is_flag=True, help="INT8 with calibrated static activation scales (QDQ).")
@click.option("--calibration", type=click.Path(exists=True, path_type=Path), default=None,
              help=".npz with one array per input, samples along axis 0 (default: generated from the inputs).")
@click.option("--calibration-samples", default=32, show_default=True, help="Generated calibration samples.")
@click.option("--inputs", "inputs_path", type=click.Path(exists=True, path_type=Path), default=None,
              help=".npz of inputs to compare on (default: generated, --samples of them).")
@click.option("--samples", default=16, show_default=True, help="Generated comparison inputs.")
@click.option("--from-version", default=None, help="Semantic version to quantize (default: the newest).")
@click.option("--version", "new_version", default=None,
              help="Semantic version of the result (default: next minor, tagged, e.g. 1.1.0+int8-dynamic).")
@click.option("--block-size", default=32, show_default=True, help="INT4 block size along K.")
@click.option("--rounds", default=15, show_default=True, help="Timed rounds (interleaved, median).")
def quantize(model: str, repository: Path, bits: Optional[int], static: bool, calibration: Optional[Path],
             calibration_samples: int, inputs_path: Optional[Path], samples: int, from_version: Optional[str],
             new_version: Optional[str], block_size: int, rounds: int) -> None:
    """Make an INT8 or INT4 version of an ONNX MODEL, add it to the repository as a new version,
    and print its speed ratio and accuracy delta against the float version."""
    from dspark.runtimes.accel import quantize as q
    from dspark.errors import ConfigError
    from dspark.repository.modelspec import SPEC_FILENAME, ModelSpec, semver_key
    from dspark.repository.repo import add_version

    if bits is None:
        raise click.UsageError("choose --int8 or --int4")
    if static and bits != 8:
        raise click.UsageError("--static applies to --int8 only")
    method = "int4" if bits == 4 else ("int8-static" if static else "int8-dynamic")
    spec_path = repository / model / SPEC_FILENAME
    if not spec_path.is_file():
        raise click.ClickException(f"{spec_path} does not exist: MODEL must be a model of --repository with a "
                                   "modelspec.yaml (`dspark repo init` writes one)")
    try:
        spec = ModelSpec.load(spec_path)
        if spec.framework not in ("onnx", "onnxruntime"):
            raise ConfigError("framework", f"{model} is a {spec.framework} model; quantize takes ONNX models")
        # the newest version that is not itself a product of this command
        floats = [r.semver for r in spec.versions if not r.source.startswith(SOURCE_PREFIX)]
        source_version = from_version or max(floats, key=semver_key, default=None)
        if source_version is None:
            raise ConfigError("versions", f"{model} has no recorded float version to quantize")
        source = repository / model / str(spec.folder_of(source_version)) / spec.artifact_name
        new_version = new_version or _next_version(spec.version, method)
        calibration_feeds = None
        if method == "int8-static":
            calibration_feeds = (q.load_feeds(calibration, source) if calibration
                                 else q.generated_inputs(source, calibration_samples, seed=1))
        feeds = q.load_feeds(inputs_path, source) if inputs_path else q.generated_inputs(source, samples, seed=2)
        with tempfile.TemporaryDirectory(prefix="dspark-quantize-") as scratch:
            quantized = q.quantize(source, Path(scratch) / spec.artifact_name, method, calibration_feeds, block_size)
            result = q.compare(source, quantized, feeds, rounds=rounds)
            changed = q.quantized_ops(quantized)
            record = add_version(repository, model, quantized, new_version,
                                 source=f"{SOURCE_PREFIX} --{method} of {source_version}")
    except ConfigError as error:
        raise click.ClickException(str(error)) from None
    ops = ", ".join(f"{op} x{count}" for op, count in sorted(changed.items())) or "none (nothing to quantize)"
    click.echo(f"{model} {source_version} -> {record.semver} (folder {record.folder}): {spec.artifact_name} "
               f"{_size(result.float_bytes)} -> {_size(result.quantized_bytes)}; quantized ops: {ops}")
    where = f"{inputs_path}" if inputs_path else f"{len(feeds)} generated input(s)"
    click.echo(f"compared on {where}, ONNX Runtime CPU provider, 1 thread, medians of {rounds} interleaved rounds:")
    click.echo(f"  speed     float {result.float_ms:.3f} ms, {method} {result.quantized_ms:.3f} ms: "
               f"x{result.speedup:.2f}")
    top1 = f", top-1 agreement {result.top1_agreement:.1%}" if result.top1_agreement is not None else ""
    click.echo(f"  accuracy  max |delta| {result.max_abs_err:.3g}, mean |delta| {result.mean_abs_err:.3g}, "
               f"max relative {result.max_rel_err:.3g}{top1}")
    click.echo(f"Triton serves the newest version folder unless {model}'s serve_versions says otherwise.")
