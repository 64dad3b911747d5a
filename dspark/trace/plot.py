"""`dspark trace --png FILE`: the report's two pictures in one PNG: the per-token time split (one
stacked bar: draft, verify, sampling, streaming, waiting) and a histogram of each probe duration
(log-spaced microsecond bins, p50 and p99 marked). matplotlib draws it (requirements.txt: the
bench plots use it too); a server installed from requirements-runtime.txt alone lacks it and
--png says so."""
from __future__ import annotations

import math
from pathlib import Path

from dspark.trace.report import Summary, Trace, percentile

WIDTH_IN, PANEL_IN, DPI = 8.0, 2.2, 100
COLUMNS = 2  # histograms per row


def layout(summary: Summary) -> tuple[int, int]:
    """(histogram rows, figure height in pixels): the split on top, the histograms below."""
    rows = math.ceil(len(summary.histograms) / COLUMNS)
    return rows, int(round((PANEL_IN * (1 + rows)) * DPI))


def write_png(trace: Trace, summary: Summary, path: Path) -> list[str]:
    """Draw the picture into ``path``; returns its panels' titles, top to bottom, left to right."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--png needs matplotlib: `pip install matplotlib`") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    rows, height = layout(summary)
    figure = plt.figure(figsize=(WIDTH_IN, height / DPI), dpi=DPI)
    grid = figure.add_gridspec(1 + rows, COLUMNS)
    titles = []
    split = figure.add_subplot(grid[0, :])
    left = 0.0
    for name, us in summary.per_token_us.items():
        split.barh([0], [us], left=[left], label=f"{name} {us:.0f}")
        left += us
    title = (f"per output token: {left:.0f} us ({summary.output_tokens} tokens, {summary.requests} requests)"
             if summary.output_tokens else "per output token: no request ended in the window")
    split.set_title(title, fontsize=9)
    split.set_yticks([])
    split.set_xlabel("us", fontsize=8)
    if summary.output_tokens:
        split.legend(ncol=5, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35), frameon=False)
    titles.append(title)
    for index, (name, (n, p50, _p90, p99)) in enumerate(summary.histograms.items()):
        axis = figure.add_subplot(grid[1 + index // COLUMNS, index % COLUMNS])
        values = [max(v, 1) for v in trace.durations[name]]
        low, high = min(values), max(values)
        bins = [low * (high / low) ** (i / 30) for i in range(31)] if high > low else [low * 0.9, low * 1.1]
        axis.hist(values, bins=bins)
        axis.set_xscale("log")
        axis.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.xaxis.set_major_formatter(ScalarFormatter())
        axis.xaxis.set_minor_formatter(NullFormatter())
        axis.set_xlabel("us", fontsize=7)
        for q, style in ((percentile(values, 50), "--"), (percentile(values, 99), ":")):
            axis.axvline(q, color="black", linestyle=style, linewidth=0.8)
        title = f"{name}: n {n}, p50 {p50:.0f} us, p99 {p99:.0f} us"
        axis.set_title(title, fontsize=8)
        axis.tick_params(labelsize=7)
        titles.append(title)
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=DPI)
    plt.close(figure)
    return titles
