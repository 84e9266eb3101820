"""What every section shares: the run context, and the result it hands to the report."""

from __future__ import annotations

import math
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from bench.deps import Tools
from bench.loadgen import Tool
from bench.procs import Procs

__all__ = [
    "Context",
    "env_without_proxies",
    "extreme",
    "pid_alive",
    "rss_mb",
    "Section",
    "SectionSkipped",
    "Table",
    "fmt",
    "median",
    "percentile",
    "ratio",
]

Status = Literal["ok", "skipped", "failed"]


class SectionSkipped(Exception):
    """A section cannot run on this machine or tree (a missing tool or component); the reason is reported."""


@dataclass(slots=True)
class Context:
    """Everything a section needs: where to write, what to use, how much to do."""

    quick: bool
    out_dir: Path
    tmp_dir: Path
    procs: Procs
    tools: Tools
    loadgen: Tool
    python: str = sys.executable

    def scale(self, full: float, quick: float) -> float:
        return quick if self.quick else full

    def count(self, full: int, quick: int) -> int:
        return quick if self.quick else full

    def plot_path(self, name: str) -> Path:
        return self.out_dir / f"{name}.png"

    @property
    def model_state(self) -> Path:
        """``state_dir`` shared by the real-model sections: the GGUF is converted to IR once per run."""
        return self.tmp_dir / "model-state"

    def section_tmp(self, name: str) -> Path:
        path = self.tmp_dir / name
        path.mkdir(parents=True, exist_ok=True)
        return path


@dataclass(slots=True)
class Table:
    headers: Sequence[str]
    rows: Sequence[Sequence[Any]]
    caption: str = ""


@dataclass(slots=True)
class Section:
    """One section of the report: tables, notes, plots, and the raw figures (for latest.json)."""

    key: str
    title: str
    status: Status = "ok"
    intro: str = ""
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def fmt(value: Any, digits: int = 2) -> str:
    """Table cell text: floats rounded to ``digits`` decimals, thousands separated; '-' for missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0 or math.isnan(value) or math.isnan(base):
        return None
    return value / base


def median(values: Sequence[float]) -> float:
    """Median of the non-NaN values (NaN marks a sample that did not happen, e.g. no recovery)."""
    clean = [v for v in values if not math.isnan(v)]
    return statistics.median(clean) if clean else float("nan")


def extreme(values: Sequence[float], pick: Callable[[Sequence[float]], float]) -> float:
    clean = [v for v in values if not math.isnan(v)]
    return pick(clean) if clean else float("nan")


def percentile(values: Sequence[float], pct: float) -> float:
    """Linear-interpolated percentile over all samples (numpy's default method)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def rss_mb(pid: int) -> tuple[float, float] | None:
    """(RSS, USS) in MiB of ``pid`` and its children; None when the process is gone."""
    import psutil

    try:
        proc = psutil.Process(pid)
        family = [proc, *proc.children(recursive=True)]
        rss = sum(p.memory_info().rss for p in family)
        uss = sum(p.memory_full_info().uss for p in family)
    except psutil.Error:
        return None
    return rss / 2**20, uss / 2**20


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    import psutil

    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def env_without_proxies() -> dict[str, str]:
    """The environment minus HTTP proxy settings (the bench only talks to loopback)."""
    return {k: v for k, v in os.environ.items() if k.lower() not in {"http_proxy", "https_proxy", "all_proxy"}}
