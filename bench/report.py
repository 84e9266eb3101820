"""The report: ``latest.md`` (machine header, one table per section, plots) and ``latest.json``."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import subprocess
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from bench import targets
from bench.common import Section, Table, fmt
from bench.deps import Tools
from bench.procs import ROOT

__all__ = ["machine_info", "render", "write"]

log = logging.getLogger(__name__)

PACKAGES = ("openvino", "openvino-genai", "uvicorn", "starlette", "httpx", "aiohttp", "uvloop", "httptools")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _tool_version(argv: Sequence[str]) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (done.stdout + done.stderr).strip().splitlines()
    return text[0] if text else "unknown"


def _git_commit() -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=False)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=False)
    return done.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def machine_info(tools: Tools) -> dict[str, Any]:
    import psutil

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "packages": versions,
        "wrk": _tool_version([tools.wrk, "-v"]) if tools.wrk else "absent",
        "nginx": _tool_version([tools.nginx, "-v"]) if tools.nginx else "absent",
        "commit": _git_commit(),
        "loadavg_start": os.getloadavg(),
    }


def _table_md(table: Table) -> list[str]:
    lines = ["| " + " | ".join(table.headers) + " |", "|" + "---|" * len(table.headers)]
    lines += ["| " + " | ".join(fmt(cell) for cell in row) + " |" for row in table.rows]
    if table.caption:
        lines += ["", f"*{table.caption}*"]
    return [*lines, ""]


def _section_md(section: Section) -> list[str]:
    lines = [f"## {section.title}", ""]
    if section.status != "ok":
        lines += [f"**{section.status.upper()}**", ""]
    if section.intro:
        lines += [section.intro, ""]
    for table in section.tables:
        lines += _table_md(table)
    for note in section.notes:
        first, _, rest = note.partition("\n")
        lines += [f"- {first}"] + (["", "  ```", *[f"  {ln}" for ln in rest.splitlines()], "  ```"] if rest else [])
    if section.notes:
        lines.append("")
    lines += [f"![{name}]({name})" for name in section.plots]
    if section.plots:
        lines.append("")
    lines += [f"*Section time: {section.seconds:.0f} s.*", ""]
    return lines


def _header_md(machine: dict[str, Any], args: str, total_s: float) -> list[str]:
    packages = ", ".join(f"{k} {v}" for k, v in machine["packages"].items())
    load = machine["loadavg_start"]
    end = machine.get("loadavg_end", (float("nan"),) * 3)
    return [
        "# ovrouter benchmark",
        "",
        f"- **Date:** {machine['date']} — `python -m bench {args}`".rstrip() + f", {total_s:.0f} s in all",
        f"- **Machine:** {machine['cpu']}, {machine['logical_cores']} logical cores "
        f"({machine['physical_cores']} physical), {machine['memory_gib']} GiB RAM, Linux {machine['kernel']}",
        f"- **Load average** (1/5/15 min) at start {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}, "
        f"at end {end[0]:.2f}/{end[1]:.2f}/{end[2]:.2f} (anything above ~0.5 at start means a noisy neighbour)",
        f"- **Software:** Python {machine['python']}, {packages}",
        f"- **Tools:** {machine['wrk']}; {machine['nginx']}",
        f"- **Load generator:** {machine.get('loadgen', 'unknown')}",
        f"- **Commit:** {machine['commit']}",
        "",
        "Every figure is measured in this run on this machine; ratios compare against a baseline from the same run. "
        "All traffic is on loopback; the load generator, the proxy under test and the backend share the cores.",
        "",
    ]


def render(machine: dict[str, Any], sections: list[Section], args: str, total_s: float) -> str:
    lines = _header_md(machine, args, total_s)
    lines += ["| section | status | time |", "|---|---|---|"]
    lines += [f"| [{s.title}](#{_anchor(s.title)}) | {s.status} | {s.seconds:.0f} s |" for s in sections]
    lines.append("")
    lines += targets.markdown(targets.gather(sections))
    for section in sections:
        lines += _section_md(section)
    return "\n".join(lines)


def _anchor(title: str) -> str:
    kept = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -")
    return kept.replace(" ", "-")


def write(out_dir: Path, machine: dict[str, Any], sections: list[Section], args: str, total_s: float) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "latest.md"
    path.write_text(render(machine, sections, args, total_s))
    raw = {"machine": machine, "sections": [_section_json(s) for s in sections],
           "issue24_targets": [dataclasses.asdict(row) for row in targets.gather(sections)]}
    (out_dir / "latest.json").write_text(json.dumps(raw, indent=1, default=str))
    log.info("wrote %s", path)
    return path


def _section_json(section: Section) -> dict[str, Any]:
    tables = [{"headers": list(t.headers), "rows": t.rows, "caption": t.caption} for t in section.tables]
    return {"key": section.key, "title": section.title, "status": section.status, "seconds": section.seconds,
            "tables": tables, "notes": section.notes, "data": section.data}
