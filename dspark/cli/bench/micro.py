"""`dspark bench micro`, and its named shortcuts `bench kernels`, `bench pool`, `bench gemm`: the
operator micro benchmarks, thin commands over dspark/bench/micro."""
from __future__ import annotations

from pathlib import Path

import click

from dspark.cli.bench.common import bench_errors, emit, progress_log


@click.command("kernels")
@click.option("--shape", "shapes", multiple=True, help="ROWSxDxN (repeatable); default: decode and prefill shapes")
@click.option("--threads", default=1, show_default=True, help="threads for every candidate")
@click.option("--rounds", default=21, show_default=True, help="interleaved repeats per shape (median)")
@click.option("--budget", default=10.0, show_default=True,
              help="seconds per shape; fewer rounds (at least 5) when they would take longer")
@click.option("--block-rows", type=int, default=None,
              help="openblas path: rows per LayerNorm+GELU block (default: 2 MiB of rows)")
@click.option("--blocks", default=None, metavar="KC/MC/NC/MB",
              help="packed path: K, row, column and outer-row block sizes (default: the library's)")
@click.option("--json", "json_path", type=click.Path(path_type=Path),
              default=Path("bench-results/kernels.json"), show_default=True)
@bench_errors
def bench_kernels(shapes: tuple[str, ...], threads: int, rounds: int, budget: float, block_rows: int | None,
                  blocks: str | None, json_path: Path) -> None:
    """Fused LayerNorm+GELU+MatMul vs unfused numpy/scipy vs ONNX Runtime (ORT_ENABLE_ALL)."""
    from dspark.bench.micro.fused import DEFAULT_SHAPES, run_fused

    emit(run_fused(shapes or DEFAULT_SHAPES, threads=threads, rounds=rounds, budget=budget, block_rows=block_rows,
                   blocks=blocks, log=progress_log), json_path)


@click.command("pool")
@click.option("--steps", default=3000, show_default=True, help="decode steps in the serving trace")
@click.option("--seeds", default=3, show_default=True, help="traces (different seeds); medians are reported")
@click.option("--headroom", default=1.25, show_default=True,
              help="bounded pools hold this many times the trace's peak bytes in use")
@click.option("--rounds", default=31, show_default=True, help="interleaved rounds of the request loop and model load")
@click.option("--weights", type=click.Path(path_type=Path), default=None,
              help="fused transformer weights to load  [default: the demo model's]")
@click.option("--json", "json_path", type=click.Path(path_type=Path),
              default=Path("bench-results/pool.json"), show_default=True)
@bench_errors
def bench_pool(steps: int, seeds: int, headroom: float, rounds: int, weights: Path | None, json_path: Path) -> None:
    """BFC pool vs first-fit vs np.empty on a serving-shaped trace, a request loop, model load."""
    from dspark.bench.micro.pool import run_pool

    emit(run_pool(steps=steps, seeds=seeds, headroom=headroom, rounds=rounds, weights=weights, log=progress_log),
         json_path)


@click.command("gemm")
@click.option("--size", default=1024, show_default=True, help="M = N = K of the product.")
@click.option("--rounds", default=11, show_default=True,
              help="Interleaved rounds (every candidate once per round, in a shuffled order).")
@click.option("--threads", default=1, show_default=True, help="OpenBLAS threads, which the shim's kernels use too.")
@click.option("--json-out", "json_path", type=click.Path(path_type=Path),
              default=Path("bench-results/gemm.json"), show_default=True)
@bench_errors
def bench_gemm(size: int, rounds: int, threads: int, json_path: Path) -> None:
    """The GemmEx shim against OpenBLAS's sgemm called directly, fp32 vs bf16 vs int8 per kernel path."""
    from dspark.bench.micro.gemm import run_gemm

    emit(run_gemm(size=size, rounds=rounds, threads=threads, log=progress_log), json_path)


@click.command("micro")
@click.argument("names", nargs=-1)
@click.option("--list", "list_only", is_flag=True, help="List the registered micro benchmarks.")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("bench-results"), show_default=True,
              help="Folder for <name>.json.")
@bench_errors
def micro(names: tuple[str, ...], list_only: bool, out_dir: Path) -> None:
    """Run registered operator benchmarks with their default settings (all when no NAME is given)."""
    from dspark.bench import micro as registry

    benchmarks = registry.load_all()
    if list_only:
        for entry in benchmarks.values():
            click.echo(f"{entry.name:<14} {entry.summary}")
        return
    for name in names or list(benchmarks):
        emit(registry.get(name).run(log=progress_log), out_dir / f"{name}.json")
