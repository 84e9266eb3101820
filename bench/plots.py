"""PNG plots with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["bars", "distributions", "latency_curves", "lines", "stacked", "timeline"]

log = logging.getLogger(__name__)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    log.info("wrote %s", path)
    return path.name


def lines(path: Path, title: str, xlabel: str, ylabel: str, series: Mapping[str, Mapping[float, float]]) -> str:
    """One line per series over shared x values (e.g. req/s vs connections)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, points in series.items():
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=label)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({x for points in series.values() for x in points}))
    ax.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)


def latency_curves(path: Path, title: str, panels: Mapping[str, Mapping[str, Mapping[float, float]]]) -> str:
    """Latency by percentile (log y), one panel per condition, one line per target."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (panel, series) in zip(axes[0], panels.items(), strict=True):
        for label, pct in series.items():
            xs = sorted(pct)
            ax.plot(xs, [pct[x] for x in xs], label=label)
        ax.set(title=panel, xlabel="percentile", ylabel="latency (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    return _save(fig, path)


def distributions(path: Path, title: str, panels: Mapping[str, Mapping[str, Sequence[float]]]) -> str:
    """Empirical CDFs of raw samples, one panel per metric, one line per target."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False)
    for ax, (panel, series) in zip(axes[0], panels.items(), strict=True):
        for label, samples in series.items():
            ordered = sorted(samples)
            if ordered:
                ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)
        ax.set(title=panel, xlabel="ms", ylabel="fraction of samples")
        ax.set_xscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    return _save(fig, path)


def bars(path: Path, title: str, ylabel: str, groups: Mapping[str, Mapping[str, float]]) -> str:
    """Grouped bars: one group per condition, one bar per target."""
    plt = _pyplot()
    labels = list(dict.fromkeys(label for bars_ in groups.values() for label in bars_))
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        xs = [g + i * width for g in range(len(groups))]
        ax.bar(xs, [groups[g].get(label, 0.0) for g in groups], width, label=label)
    ax.set_xticks([g + width * (len(labels) - 1) / 2 for g in range(len(groups))], list(groups))
    ax.set(title=title, ylabel=ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    return _save(fig, path)


def stacked(path: Path, title: str, xlabel: str, bars: Mapping[str, Mapping[str, float]]) -> str:
    """Horizontal stacked bars: one bar per target, one colour per slice (same slice order in every bar)."""
    plt = _pyplot()
    names = list(bars)
    slices = list(dict.fromkeys(part for parts in bars.values() for part in parts))
    fig, ax = plt.subplots(figsize=(9.0, 2.0 + 0.8 * len(names)))
    left = [0.0] * len(names)
    for part in slices:
        widths = [bars[name].get(part, 0.0) for name in names]
        ax.barh(names, widths, left=left, label=part)
        for y, (x0, width) in enumerate(zip(left, widths, strict=True)):
            if width >= 0.25:
                ax.text(x0 + width / 2, y, f"{width:.2f}", ha="center", va="center", fontsize="x-small")
        left = [x0 + width for x0, width in zip(left, widths, strict=True)]
    ax.set(title=title, xlabel=xlabel)
    ax.invert_yaxis()
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize="small", ncol=4, loc="upper center", bbox_to_anchor=(0.45, -0.3))
    return _save(fig, path)


def timeline(path: Path, title: str, panels: Mapping[str, Sequence[tuple[float, float, bool]]]) -> str:
    """Request latency over time around an event at t=0: dots for successes, red crosses for failures."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6), squeeze=False)
    for ax, (panel, points) in zip(axes[0], panels.items(), strict=True):
        ok = [(t, ms) for t, ms, good in points if good]
        bad = [(t, ms) for t, ms, good in points if not good]
        if ok:
            ax.scatter(*zip(*ok, strict=True), s=6, label="ok")
        if bad:
            ax.scatter(*zip(*bad, strict=True), s=24, marker="x", color="red", label="failed")
        ax.axvline(0, color="grey", linestyle="--", linewidth=1)
        ax.set(title=panel, xlabel="s since the fault (request end)", ylabel="latency (ms)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    return _save(fig, path)
