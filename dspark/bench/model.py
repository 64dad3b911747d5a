"""`bench model` and `bench system`: one model, or several with a traffic mix, on any Triton server.

For each level (a concurrency, or a request rate) the load generator measures windows until
stable; meanwhile the server's and its stubs' CPU and memory are sampled, and Triton's /metrics
is read before and after each level. The result has one row per level and model (a ``total`` row
too when several models share the traffic), bands from the windows, and the resource series.
"""
from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dspark.bench import inputs as input_data
from dspark.bench.client import make_transport
from dspark.bench.load import LoadGenerator, LoadSettings, Point, Target, bands, summarize
from dspark.bench.progress import Progress, Silent
from dspark.bench.resources import ResourceSampler, model_counters, scrape, server_pid, summarize_samples
from dspark.bench.results import BenchResult, Metric
from dspark.bench.table import Column
from dspark.errors import ConfigError

TOTAL = "total"


@dataclass(frozen=True)
class ModelSpec:
    """A model in the mix: name, share of the traffic, and where its inputs come from."""

    name: str
    weight: float = 1.0
    input_data: Path | None = None

    @classmethod
    def parse(cls, text: str) -> "ModelSpec":
        """``NAME``, ``NAME:WEIGHT`` or ``NAME:WEIGHT:INPUT_DATA.json``."""
        name, *rest = text.split(":", 2)
        try:
            weight = float(rest[0]) if rest and rest[0] else 1.0
        except ValueError:
            raise ConfigError("model", f"{text!r}: expected NAME[:WEIGHT[:INPUT_DATA.json]]") from None
        if not name or weight <= 0:
            raise ConfigError("model", f"{text!r}: expected NAME[:WEIGHT[:INPUT_DATA.json]] with WEIGHT > 0")
        return cls(name, weight, Path(rest[1]) if len(rest) > 1 else None)


@dataclass
class LoadBenchSettings:
    models: list[ModelSpec]
    url: str = "127.0.0.1:8000"
    protocol: str = "http"
    mode: str = "concurrency"
    levels: list[float] = field(default_factory=lambda: [1.0])
    batch: int = 1
    shapes: dict[str, list[int]] = field(default_factory=dict)
    load: LoadSettings = field(default_factory=LoadSettings)
    timeout_s: float = 60.0
    metrics_url: str | None = None
    server_pid: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    parameters: dict = field(default_factory=dict)   # request parameters sent with every request
    sample_interval_s: float = 0.5

    def to_json(self) -> dict:
        data = asdict(self)
        data["models"] = [{"name": m.name, "weight": m.weight, "input_data": str(m.input_data) if m.input_data else None}
                          for m in self.models]
        data["headers"] = sorted(self.headers)  # names only: a key is not a setting to publish
        return data


def parse_levels(text: str) -> list[float]:
    """``1,2,4`` or perf_analyzer's ``START:END[:STEP]`` range."""
    try:
        if ":" in text:
            parts = [float(p) for p in text.split(":")]
            start, end = parts[0], parts[1]
            step = parts[2] if len(parts) > 2 else 1.0
            if step <= 0 or end < start:
                raise ValueError
            levels, value = [], start
            while value <= end + 1e-9:
                levels.append(round(value, 6))
                value += step
            return levels
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError("levels", f"{text!r}: expected a list (1,2,4) or START:END[:STEP]") from None


ROW_COLUMNS = [
    Column("model"), Column("label"), Column("protocol", "proto"), Column("level", "conc", "g"), Column("qps", "req/s", ".1f"),
    Column("p50_ms", "p50 ms", ".2f"), Column("p90_ms", "p90 ms", ".2f"), Column("p95_ms", "p95 ms", ".2f"),
    Column("p99_ms", "p99 ms", ".2f"), Column("error_rate", "errors", ".1%"), Column("stable", "stable"),
    Column("qps_band", "± req/s", ".1%"), Column("p99_band", "± p99", ".1%"),
    Column("server_queue_ms", "server queue ms", ".2f"), Column("server_compute_ms", "server compute ms", ".2f"),
    Column("server_batch", "batch formed", ".2f"), Column("server_cpu_pct", "server CPU %", ".0f"),
    Column("model_stubs_cpu_pct", "model stubs CPU %", ".0f"), Column("model_stubs_rss_mib", "model stubs MiB", ".0f"),
    Column("stubs_cpu_pct", "all stubs CPU %", ".0f"),
]
STREAM_COLUMNS = [Column("ttft_p50_ms", "TTFT p50 ms", ".1f"), Column("ttft_p99_ms", "TTFT p99 ms", ".1f"),
                  Column("itl_p50_ms", "ITL p50 ms", ".2f"), Column("itl_p99_ms", "ITL p99 ms", ".2f")]
METRICS = [Metric("qps", "higher"), Metric("p50_ms", "lower"), Metric("p90_ms", "lower"), Metric("p95_ms", "lower"),
           Metric("p99_ms", "lower"), Metric("error_rate", "lower"), Metric("ttft_p50_ms", "lower"),
           Metric("ttft_p99_ms", "lower"), Metric("itl_p50_ms", "lower"), Metric("itl_p99_ms", "lower")]


def _row(target: Target | None, settings: LoadBenchSettings, point: Point, records, windows) -> dict:
    row = {"model": target.model if target else TOTAL, **({"label": target.label} if target and target.label else {}),
           "protocol": settings.protocol, "mode": point.mode, "level": point.level,
           "batch": settings.batch, **summarize(records, point.duration_s), "stable": point.stable,
           "windows": len(point.windows)}
    band = bands(windows[-settings.load.stable_windows:])
    row["band"] = band
    row["qps_band"], row["p99_band"] = band.get("qps"), band.get("p99_ms")
    return row


async def _run(settings: LoadBenchSettings, progress: Progress) -> tuple[list[dict], dict]:
    transport = make_transport(settings.protocol, settings.url, settings.timeout_s, settings.headers)
    max_inflight = int(max(settings.levels)) if settings.mode == "concurrency" else settings.load.max_inflight
    await transport.open(max_inflight)
    try:
        targets, infos = [], {}
        for spec in settings.models:
            try:
                info = input_data.ModelInfo.from_config(await transport.model_config(spec.name))
            except Exception as error:
                raise ConfigError("model", f"cannot read the config of {spec.name!r} at {settings.url} "
                                  f"({settings.protocol}): {error}") from None
            if info.decoupled and settings.protocol != "grpc-stream":
                raise ConfigError("protocol", f"model {spec.name} is decoupled (it streams its answer): "
                                  "use --protocol grpc-stream")
            if settings.batch > max(1, info.max_batch_size):
                raise ConfigError("batch", f"{settings.batch} exceeds {spec.name}'s max_batch_size "
                                  f"{info.max_batch_size}")
            arrays = (input_data.from_file(spec.input_data, info, settings.batch, settings.shapes)
                      if spec.input_data else input_data.generated(info, settings.batch, settings.shapes))
            targets.append(Target(spec.name, [transport.prepare(info, a, settings.parameters) for a in arrays],
                                  spec.weight))
            infos[spec.name] = info

        def on_window(mode: str, level: float, index: int, window: dict) -> None:
            progress.note(f"{mode} {level:g}: window {index}: {window['qps']:.1f} req/s, p50 {window['p50_ms']:.2f} ms, "
                          f"p99 {window['p99_ms']:.2f} ms, errors {window['requests'] - window['ok']}")

        generator = LoadGenerator(transport, targets, settings.load, on_window)
        pid = settings.server_pid or server_pid(settings.url)
        sampler = ResourceSampler(pid, settings.sample_interval_s).start() if pid else None
        rows: list[dict] = []
        spans: list[dict] = []
        metrics_notes: set[str] = set()
        try:
            for level in settings.levels:
                before = scrape(settings.metrics_url) if settings.metrics_url else None
                point = await generator.run_point(settings.mode, level)
                after = scrape(settings.metrics_url) if settings.metrics_url else None
                progress.advance()
                samples = sampler.between(*point.bounds) if sampler else []
                spans.append({"level": level, "start": point.bounds[0] - (sampler.t0 if sampler else point.started),
                              "end": point.bounds[1] - (sampler.t0 if sampler else point.started)})
                for target in targets:
                    mine = [r for r in point.records if r.target == target.name]
                    row = _row(target, settings, point, mine,
                               point.windows if len(targets) == 1 else point.windows_of(target.name))
                    counters = (model_counters(before, after, target.model)
                                if before is not None and after is not None else None)
                    if settings.metrics_url and counters is None:
                        metrics_notes.add(f"Triton's metrics at {settings.metrics_url} did not answer: no server "
                                          "columns (pass --metrics-url)")
                    elif counters is not None and mine and not counters["success"] + counters["failure"]:
                        metrics_notes.add(f"Triton's metrics at {settings.metrics_url} counted none of "
                                          f"{target.model}'s requests (another server's?): no server columns "
                                          "(pass --metrics-url)")
                    elif counters is not None:
                        row["server"] = counters
                        for key, short in (("server_queue_us_per_request", "server_queue_ms"),
                                           ("server_compute_us_per_request", "server_compute_ms")):
                            if key in row["server"]:
                                row[short] = row["server"][key] / 1e3
                        row["server_batch"] = row["server"].get("server_mean_batch")
                    row.update(summarize_samples(samples, target.model))
                    rows.append(row)
                if len(targets) > 1:
                    total = _row(None, settings, point, point.records, point.windows)
                    total.update(summarize_samples(samples))
                    rows.append(total)
        finally:
            resources = {"pid": pid, "process": sampler.server_name if sampler else None,
                         "interval_s": settings.sample_interval_s,
                         "samples": sampler.stop() if sampler else [], "points": spans}
        return rows, {"resources": resources, "models": {k: asdict(v) for k, v in infos.items()},
                      "metrics_notes": sorted(metrics_notes)}
    finally:
        await transport.close()


def run_load_bench(settings: LoadBenchSettings, progress: Progress | None = None) -> BenchResult:
    """Measure every level; the result is `model` for one model, `system` for a mix."""
    rows, series = asyncio.run(_run(settings, progress or Silent()))
    streaming = any("ttft_p50_ms" in r for r in rows)
    level_title = "conc" if settings.mode == "concurrency" else "req/s in"
    columns = [Column(c.key, level_title, c.fmt) if c.key == "level" else c for c in ROW_COLUMNS]
    if streaming:
        columns[10:10] = STREAM_COLUMNS
    columns = [c for c in columns if any(c.key in r for r in rows)]
    notes = [f"{settings.protocol} to {settings.url}; {settings.mode} {', '.join(f'{v:g}' for v in settings.levels)}; "
             f"batch {settings.batch}; windows of {settings.load.window_s:g} s until {settings.load.stable_windows} "
             f"agree within {settings.load.stability:.0%} (at most {settings.load.max_windows}), "
             f"after {settings.load.warmup_s:g} s warm-up"]
    notes += series.pop("metrics_notes")
    if not series["resources"]["samples"]:
        notes.append("resource use not sampled: the server's process was not found on this machine (--server-pid)")
    unstable = [f"{r['model']}@{r['level']:g}" for r in rows if not r["stable"]]
    if unstable:
        notes.append(f"not stable within {settings.load.max_windows} windows: {', '.join(unstable)} "
                     "(figures from the last windows; widen --stability or add --max-windows)")
    return BenchResult(
        benchmark="model" if len(settings.models) == 1 else "system", settings=settings.to_json(), rows=rows,
        columns=columns, key_fields=["model", "label", "protocol", "mode", "level", "batch"], metrics=METRICS,
        notes=notes,
        series=series)

