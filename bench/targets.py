"""Issue 24's targets in one table, gathered from what the sections of this run already report.

Each target names its section and how to read its verdict there: the verdict line a section
writes in its notes (found by a loose pattern, so a rewording that keeps "met"/"MISSED" still
reads), or the figures in its ``data`` (LLM 8 streams against the bare continuous-batching
pipeline, from the ``llm_throughput`` section's rows). A section that did not run, was skipped or
failed, or that wrote no such verdict, gives its row the reason instead; when none of the
sections ran, there is no table.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.common import Section

__all__ = ["ISSUE24", "Row", "Target", "gather", "markdown"]

#: The verdict word a section's line carries.
VERDICT = re.compile(r"\b(met|MISSED|NOT met|missed)\b")
#: Figures worth showing when a line has no parenthesised figure after its verdict.
FIGURE = re.compile(r"\d+(?:\.\d+)?\s?(?:MiB|x|s|emb/s|tok/s)(?![\w/])")
LLM_STREAMS, LLM_TARGET = 8, 0.90


@dataclass(frozen=True, slots=True)
class Row:
    target: str
    section: str
    verdict: str  # met | MISSED | not run | skipped | failed | no verdict
    figure: str


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    section: str
    read: Callable[[Section], tuple[str, str] | None]  # (verdict, figure), or None when the section says nothing


def _from_note(pattern: str) -> Callable[[Section], tuple[str, str] | None]:
    """The first note matching ``pattern`` (a regex, case-insensitive) that carries a verdict word."""
    wanted = re.compile(pattern, re.IGNORECASE)

    def read(section: Section) -> tuple[str, str] | None:
        for note in section.notes:
            found = VERDICT.search(note) if wanted.search(note) else None
            if found is not None:
                return ("met" if found.group(1) == "met" else "MISSED"), _figure(note, found.end())
        return None

    return read


def _figure(note: str, after: int) -> str:
    rest = note[after:].lstrip(" :")
    if rest.startswith("("):
        return rest[1:rest.find(")")] if ")" in rest else rest[1:]
    figures = FIGURE.findall(note)
    return ", ".join(figures[:3]) if figures else note[:120]


def _llm_streams(section: Section) -> tuple[str, str] | None:
    """8 streams through the model server over the bare continuous-batching pipeline, from the section's rows."""
    rows = section.data.get("rows")
    if not isinstance(rows, Sequence):
        return None
    row = next((r for r in rows if isinstance(r, Mapping) and r.get("streams") == LLM_STREAMS), None)
    if row is None:
        return None
    server, bare = _number(row, "server tok/s"), _number(row, "bare tok/s")
    if server is None or not bare:
        return None
    value = server / bare
    return ("met" if value >= LLM_TARGET else "MISSED"), f"{value:.2f}x ({server:.1f} vs {bare:.1f} tok/s)"


def _number(row: Mapping[str, Any], key: str) -> float | None:
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) else None


ISSUE24: tuple[Target, ...] = (
    Target("Cold start: SmolLM2 stopped -> first token <= 2.5 s and <= 1.10x the bare load + first token",
           "coldstart", _from_note(r"^Target\b.*bare pipeline")),
    Target("Embeddings: 1 client x 1 text >= 0.8x the bare pipeline's batches of 1", "embeddings",
           _from_note(r"^Target 1 client")),
    Target("Embeddings: 16 clients x 1 text >= 0.8x the bare pipeline's batches of 16", "embeddings",
           _from_note(r"^Target 16 client")),
    Target(f"LLM: {LLM_STREAMS} streams >= {LLM_TARGET:.2f}x the bare continuous-batching pipeline",
           "llm_throughput", _llm_streams),
    Target("Memory: router + SmolLM2 model server <= 1.3x llama.cpp's server (263 MiB recorded)", "memory",
           _from_note(r"memory target")),
)


def gather(sections: Sequence[Section], targets: Sequence[Target] = ISSUE24) -> list[Row]:
    """One row per target; none at all when not one of their sections is in ``sections``."""
    by_key = {section.key: section for section in sections}
    if not any(target.section in by_key for target in targets):
        return []
    rows = []
    for target in targets:
        section = by_key.get(target.section)
        if section is None:
            rows.append(Row(target.name, target.section, "not run", "section not in this run"))
        elif section.status != "ok":
            rows.append(Row(target.name, target.section, section.status, (section.notes or [""])[0][:120]))
        else:
            read = target.read(section)
            verdict, figure = read if read is not None else ("no verdict", "the section reported none")
            rows.append(Row(target.name, target.section, verdict, figure))
    return rows


def markdown(rows: Sequence[Row]) -> list[str]:
    if not rows:
        return []
    lines = ["## Issue 24 targets", "", "| target | verdict | figure | section |", "|---|---|---|---|"]
    lines += [f"| {r.target} | {'**MISSED**' if r.verdict == 'MISSED' else r.verdict} | {r.figure} | {r.section} |"
              for r in rows]
    return [*lines, "", "*Gathered from the sections below (their verdict lines and figures); no target of "
            "its own is measured here.*", ""]
