"""The model bench checked against an independent load generator, side by side.

The reference is the plainest client there is: tritonclient's synchronous HTTP or gRPC client,
one per thread, each thread sending the next request when its answer arrives, timed with
perf_counter around ``infer``; it shares no code with dspark/bench's asyncio load generator.
For each protocol and concurrency the two alternate (dspark, plain, dspark, plain, ...), so
both see the same machine; the table gives both sides' throughput and percentiles, their ratio,
and whether dspark's repeated runs agree within the band it reports.
"""
from __future__ import annotations

import statistics
import threading
import time
from typing import Callable, Sequence

import numpy as np

from dspark.bench.compare import compare
from dspark.bench.inputs import ModelInfo, generated
from dspark.bench.load import LoadSettings
from dspark.bench.model import LoadBenchSettings, ModelSpec, run_load_bench
from dspark.bench.results import BenchResult, Metric
from dspark.bench.table import Column


def plain_loop(url: str, protocol: str, model: str, concurrency: int, seconds: float, warmup_s: float) -> dict:
    """Closed loop with tritonclient's sync client in threads; figures over the time after warm-up."""
    if protocol == "http":
        import tritonclient.http as client_module
        config = client_module.InferenceServerClient(url).get_model_config(model)
    else:
        import tritonclient.grpc as client_module
        config = client_module.InferenceServerClient(url).get_model_config(model, as_json=True)["config"]
    info = ModelInfo.from_config(config)
    arrays = generated(info, 1)[0]
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    start = time.perf_counter()
    measure_from, stop_at = start + warmup_s, start + warmup_s + seconds

    def worker(mine: list[float]) -> None:
        client = client_module.InferenceServerClient(url)
        inputs = []
        for spec in info.inputs:
            tensor = client_module.InferInput(spec.name, list(arrays[spec.name].shape), spec.wire_type)
            tensor.set_data_from_numpy(arrays[spec.name])
            inputs.append(tensor)
        while True:
            t0 = time.perf_counter()
            if t0 >= stop_at:
                return
            client.infer(model, inputs)
            t1 = time.perf_counter()
            if t1 >= measure_from and t1 < stop_at:
                mine.append(t1 - t0)

    threads = [threading.Thread(target=worker, args=(latencies[i],)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done = [1e3 * v for mine in latencies for v in mine]
    return {"qps": len(done) / seconds, "p50_ms": float(np.percentile(done, 50)),
            "p99_ms": float(np.percentile(done, 99))}


def run_crosscheck(urls: dict[str, str], model: str, levels: Sequence[int], repeats: int = 2, seconds: float = 6.0,
                   log: Callable[[str], None] = lambda _: None) -> BenchResult:
    rows = []
    for protocol, url in urls.items():
        for level in levels:
            ours: list[BenchResult] = []
            plain: list[dict] = []
            for _ in range(repeats):
                settings = LoadBenchSettings([ModelSpec(model)], url=url, protocol=protocol, levels=[float(level)],
                                             metrics_url=None,
                                             load=LoadSettings(warmup_s=1.0, window_s=seconds / 3, stable_windows=3,
                                                               max_windows=9, stability=0.10))
                ours.append(run_load_bench(settings))
                plain.append(plain_loop(url, protocol, model, level, seconds, 1.0))
                log(f"  {protocol} c={level}: dspark {ours[-1].rows[0]['qps']:.0f} req/s, plain {plain[-1]['qps']:.0f} req/s")
            first, second = ours[0].rows[0], ours[-1].rows[0]
            agree = not any(c.failed for c in compare(ours[0], ours[-1], metrics=["qps", "p50", "p99"], min_band=0.0))
            med = {k: statistics.median(r.rows[0][k] for r in ours) for k in ("qps", "p50_ms", "p99_ms")}
            ref = {k: statistics.median(p[k] for p in plain) for k in ("qps", "p50_ms", "p99_ms")}
            rows.append({
                "protocol": protocol, "level": level,
                "qps": med["qps"], "plain_qps": ref["qps"], "qps_ratio": med["qps"] / ref["qps"],
                "p50_ms": med["p50_ms"], "plain_p50_ms": ref["p50_ms"], "p50_ratio": med["p50_ms"] / ref["p50_ms"],
                "p99_ms": med["p99_ms"], "plain_p99_ms": ref["p99_ms"], "p99_ratio": med["p99_ms"] / ref["p99_ms"],
                "runs_qps": [r.rows[0]["qps"] for r in ours], "runs_p99": [r.rows[0]["p99_ms"] for r in ours],
                "band_qps": max(first["band"].get("qps", 0), second["band"].get("qps", 0)),
                "band_p99": max(first["band"].get("p99_ms", 0), second["band"].get("p99_ms", 0)),
                "runs_agree": "yes" if agree else "no",
                "stable": f"{sum(bool(r.rows[0]['stable']) for r in ours)}/{len(ours)}",
            })
    return BenchResult(
        benchmark="crosscheck", settings={"model": model, "urls": urls, "levels": list(levels), "repeats": repeats,
                                          "seconds": seconds},
        rows=rows,
        columns=[Column("protocol"), Column("level", "conc"), Column("qps", "dspark req/s", ".0f"),
                 Column("plain_qps", "plain req/s", ".0f"), Column("qps_ratio", "ratio", ".2f"),
                 Column("p50_ms", "dspark p50", ".2f"), Column("plain_p50_ms", "plain p50", ".2f"),
                 Column("p99_ms", "dspark p99", ".2f"), Column("plain_p99_ms", "plain p99", ".2f"),
                 Column("runs_qps", "dspark runs req/s", ".0f"), Column("band_qps", "± band", ".1%"),
                 Column("runs_p99", "dspark runs p99", ".1f"), Column("band_p99", "± band", ".1%"),
                 Column("stable", "dspark runs stable"), Column("runs_agree", "runs agree within band")],
        key_fields=["protocol", "level"], metrics=[Metric("qps", "higher"), Metric("p99_ms", "lower")],
        notes=[f"{model}: dspark's model bench (asyncio clients, {seconds:g} s of 3 windows after 1 s warm-up, medians "
               f"of {repeats} runs) alternating with a plain loop of tritonclient's sync client in threads "
               f"({seconds:g} s after 1 s warm-up); 'runs agree': dspark's runs differ by less than the band "
               "each reports (bench compare with no floor)"])
