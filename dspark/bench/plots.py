"""PNG plots of benchmark results (matplotlib, no display needed): for `model` and `system`,
latency against throughput, percentiles per level, and the server's resource use over time; for
`router`, latency over time per tier and goodput against the offered load. Every plot is drawn
from the result alone (its rows and series), so a saved result.json can be re-plotted."""
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


TIER_COLORS = {"diamond": "tab:blue", "gold": "tab:orange", "standard": "tab:gray"}


def plot_router(result: BenchResult, out_dir: Path, stem: str = "router") -> list[Path]:
    """Latency over time per tier (the first run of each scenario, one panel per mode; refused
    requests marked at their tier's deadline) and goodput against the offered load."""
    timeline = result.series.get("timeline") or {}
    if not timeline:
        return []
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    deadlines_ms = result.settings.get("deadlines_ms", {})
    panels = [key.split(" / ", 1) for key in timeline]
    scenarios, modes = list(dict.fromkeys(s for s, _ in panels)), list(dict.fromkeys(m for _, m in panels))
    fig, axes = plt.subplots(len(scenarios), len(modes), figsize=(4.5 * len(modes), 3.2 * len(scenarios)),
                             squeeze=False, sharey="row")
    for i, scenario in enumerate(scenarios):
        for j, mode in enumerate(modes):
            ax = axes[i][j]
            for tier, points in reversed(list(timeline.get(f"{scenario} / {mode}", {}).items())):
                ok = [(at, ms) for at, ms in points if ms is not None]
                refused = [at for at, ms in points if ms is None]
                color = TIER_COLORS.get(tier)
                if ok:
                    ax.scatter(*zip(*ok), s=3, color=color, label=tier)
                if refused:
                    ax.scatter(refused, [deadlines_ms.get(tier, 1.0)] * len(refused), s=6, marker="x", color=color,
                               alpha=0.4, label=f"{tier} refused")
            ax.set_yscale("log")
            ax.set_title(f"{scenario}\n{mode}", fontsize=8)
            ax.set_xlabel("arrival time (s)", fontsize=8)
            if j == 0:
                ax.set_ylabel("latency (ms)", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][-1].legend(fontsize=6, markerscale=3)
    written = [_save(fig, out_dir / f"{stem}_latency.png")]

    summaries = [r for r in result.rows if r.get("table") == "scenarios" and r.get("tier") == "all"]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for mode in dict.fromkeys(r["mode"] for r in summaries):
        mine = sorted((r for r in summaries if r["mode"] == mode), key=lambda r: r["offered_x"])
        ax.plot([r["offered_x"] for r in mine], [r["goodput_x"] for r in mine], marker="o", label=mode)
    top = max([r["offered_x"] for r in summaries], default=1.0)
    ax.plot([0, top], [0, top], color="lightgray", lw=0.8, ls=":")
    ax.axhline(1.0, color="lightgray", lw=0.8)
    ax.axhline(0.97, color="tab:red", lw=0.8, ls="--", label="target 0.97x")
    ax.set(xlabel="offered load (x measured capacity)", ylabel="goodput (x measured capacity)", ylim=(0, 1.2))
    ax.legend(fontsize=7)
    written.append(_save(fig, out_dir / f"{stem}_goodput.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
