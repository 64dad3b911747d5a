"""`dspark bench`: measurements. `bench infer` drives any model on a running server."""
from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path
from typing import Optional

import click
import numpy as np

from dspark.triton.tensors import TRITON_TO_NUMPY, wire_name


@click.group()
def bench() -> None:
    """Benchmarks; each prints a table and can write JSON."""


def _random_inputs(config: dict, batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    arrays = {}
    for entry in config["input"]:
        dims = [int(d) for d in entry["dims"]]
        shape = ([batch] if config.get("max_batch_size", 0) > 0 else []) + [1 if d == -1 else d for d in dims]
        dtype = TRITON_TO_NUMPY[entry["data_type"]]
        if dtype.kind == "f":
            arrays[entry["name"]] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind in "iu":
            arrays[entry["name"]] = rng.integers(0, 8, size=shape).astype(dtype)
        else:
            raise click.ClickException(f"bench infer cannot make random {entry['data_type']} for input '{entry['name']}'")
    return arrays


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


@bench.command()
@click.argument("model")
@click.option("--url", default="127.0.0.1:8000", show_default=True, help="HTTP host:port (gRPC: pass --protocol grpc and its port).")
@click.option("--protocol", type=click.Choice(["http", "grpc"]), default="http", show_default=True)
@click.option("--concurrency", default=1, show_default=True)
@click.option("--requests", "total", default=500, show_default=True)
@click.option("--batch", default=1, show_default=True)
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
def infer(model: str, url: str, protocol: str, concurrency: int, total: int, batch: int,
          json_out: Optional[Path]) -> None:
    """Closed-loop load on MODEL: latency p50/p99 and throughput at a concurrency."""
    if protocol == "http":
        import tritonclient.http as client_module
        config = client_module.InferenceServerClient(url).get_model_config(model)
    else:
        import tritonclient.grpc as client_module
        config = client_module.InferenceServerClient(url).get_model_config(model, as_json=True)["config"]
    arrays = _random_inputs(config, batch, np.random.default_rng(0))
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    remaining = [total]

    def worker() -> None:
        client = client_module.InferenceServerClient(url)
        inputs = []
        for name, array in arrays.items():
            tensor = client_module.InferInput(name, list(array.shape), wire_name(
                next(e["data_type"] for e in config["input"] if e["name"] == name)))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        while True:
            with lock:
                if remaining[0] <= 0:
                    return
                remaining[0] -= 1
            start = time.perf_counter()
            try:
                client.infer(model, inputs)
                with lock:
                    latencies.append(time.perf_counter() - start)
            except Exception as error:  # count and report, keep the load going
                with lock:
                    errors.append(str(error))

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    result = {
        "model": model, "protocol": protocol, "concurrency": concurrency, "batch": batch,
        "requests": len(latencies), "errors": len(errors),
        "throughput_rps": len(latencies) / elapsed,
        "p50_ms": percentile(latencies, 50) * 1e3, "p99_ms": percentile(latencies, 99) * 1e3,
        "mean_ms": statistics.fmean(latencies) * 1e3 if latencies else float("nan"),
    }
    click.echo(f"{'model':<20} {'proto':<5} {'conc':>4} {'batch':>5} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6}")
    click.echo(f"{model:<20} {protocol:<5} {concurrency:>4} {batch:>5} {result['throughput_rps']:>9.1f} "
               f"{result['p50_ms']:>8.2f} {result['p99_ms']:>8.2f} {len(errors):>6}")
    if errors:
        click.echo(f"first error: {errors[0]}", err=True)
    if json_out:
        json_out.write_text(json.dumps(result, indent=2))
