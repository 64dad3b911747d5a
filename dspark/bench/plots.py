"""PNG plots of a model or system result (matplotlib, no display needed): latency against
throughput, percentiles per level, and the server's resource use over time."""
from __future__ import annotations

from pathlib import Path

from dspark.bench.results import BenchResult

PERCENTILES = ("p50_ms", "p90_ms", "p95_ms", "p99_ms")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(result: BenchResult) -> dict[str, list[dict]]:
    """Rows per model or label (and protocol when several), in level order."""
    groups: dict[str, list[dict]] = {}
    protocols = {r["protocol"] for r in result.rows}
    for row in result.rows:
        label = (row.get("label") or row["model"]) + (f" ({row['protocol']})" if len(protocols) > 1 else "")
        groups.setdefault(label, []).append(row)
    return {k: sorted(v, key=lambda r: r["level"]) for k, v in groups.items()}


def plot_result(result: BenchResult, out_dir: Path, stem: str = "model") -> list[Path]:
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    level_name = "concurrency" if result.settings.get("mode", "concurrency") == "concurrency" else "request rate (req/s)"
    title = f"{result.benchmark}: {', '.join(_series(result))}"
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, rows in _series(result).items():
        qps = [r["qps"] for r in rows]
        for key, style in (("p50_ms", "-o"), ("p99_ms", "--s")):
            ax.plot(qps, [r[key] for r in rows], style, label=f"{label} {key[:3]}")
        for r in rows:
            ax.annotate(f"{r['level']:g}", (r["qps"], r["p99_ms"]), textcoords="offset points", xytext=(3, 3), fontsize=7)
    ax.set(xlabel="throughput (req/s)", ylabel="latency (ms)", title=f"latency vs throughput ({level_name} marked)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    written.append(_save(fig, out_dir / f"{stem}_latency_vs_throughput.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, rows in _series(result).items():
        levels = [r["level"] for r in rows]
        for key in PERCENTILES + ("ttft_p50_ms", "itl_p50_ms"):
            if all(key in r for r in rows):
                ax.plot(levels, [r[key] for r in rows], "-o", label=f"{label} {key.removesuffix('_ms')}")
    ax.set(xlabel=level_name, ylabel="latency (ms)", title="latency percentiles per level")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    written.append(_save(fig, out_dir / f"{stem}_percentiles.png"))

    resources = result.series.get("resources", {})
    samples = resources.get("samples") or []
    if samples:
        fig, (cpu, mem) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
        t = [s["t"] for s in samples]
        cpu.plot(t, [s["server_cpu"] for s in samples], label="server")
        cpu.plot(t, [s["stubs_cpu"] for s in samples], label="backend stubs")
        cpu.plot(t, [s["machine_cpu"] * result.machine.get("cores", 1) for s in samples], ":", label="whole machine")
        cpu.set(ylabel="CPU (% of one core)", title=f"resource use of {resources.get('process')} (pid {resources.get('pid')})")
        mem.plot(t, [s["server_rss_mib"] for s in samples], label="server")
        mem.plot(t, [s["stubs_rss_mib"] for s in samples], label="backend stubs")
        mem.set(xlabel="time (s)", ylabel="RSS (MiB)")
        for span in resources.get("points", []):
            for ax in (cpu, mem):
                ax.axvspan(span["start"], span["end"], alpha=0.08, color="tab:green")
            cpu.annotate(f"{span['level']:g}", (span["start"], 0), fontsize=7, xytext=(2, 2), textcoords="offset points")
        for ax in (cpu, mem):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        written.append(_save(fig, out_dir / f"{stem}_resources.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
