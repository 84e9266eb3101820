"""Sections written by others: ``bench/llm_throughput.py`` and ``bench/embeddings.py``, each ``run(quick) -> dict``.

The dict is rendered as it comes: a ``"markdown"`` string is included verbatim; a
``"tables"`` list of ``{"headers", "rows", "caption"}`` (or a ``"rows"`` list of dicts)
becomes tables; ``"notes"`` and ``"plots"`` (PNG paths) are carried over; any other
scalar keys are listed as a two-column table.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.common import Context, Section, SectionSkipped, Table

__all__ = ["run", "to_section"]

log = logging.getLogger(__name__)

MODULES = {"llm_throughput": "bench.llm_throughput", "embeddings": "bench.embeddings"}
TITLES = {
    "llm_throughput": "Model server vs bare pipeline (bench/llm_throughput.py)",
    "embeddings": "Embeddings and other tasks (bench/embeddings.py)",
}
KNOWN = {"markdown", "tables", "rows", "notes", "plots", "title", "intro"}


def _dict_rows(rows: Sequence[Mapping[str, Any]]) -> Table:
    headers = list(dict.fromkeys(key for row in rows for key in row))
    return Table(headers, [[row.get(h) for h in headers] for row in rows])


def _tables(result: Mapping[str, Any]) -> list[Table]:
    tables = []
    for spec in result.get("tables") or []:
        if isinstance(spec, Mapping) and "headers" in spec:
            tables.append(Table(list(spec["headers"]), list(spec.get("rows", [])), str(spec.get("caption", ""))))
        elif isinstance(spec, Sequence) and spec and isinstance(spec[0], Mapping):
            tables.append(_dict_rows(spec))
    rows = result.get("rows")
    if isinstance(rows, Sequence) and rows and isinstance(rows[0], Mapping):
        tables.append(_dict_rows(rows))
    scalars = [[k, v] for k, v in result.items() if k not in KNOWN and isinstance(v, (int, float, str, bool))]
    if scalars:
        tables.append(Table(["figure", "value"], scalars))
    return tables


def to_section(key: str, result: Mapping[str, Any], out_dir: Path) -> Section:
    section = Section(key, str(result.get("title") or TITLES[key]), intro=str(result.get("intro", "")))
    if result.get("markdown"):
        section.intro = (section.intro + "\n\n" + str(result["markdown"])).strip()
    section.tables = _tables(result)
    section.notes = [str(n) for n in result.get("notes") or []]
    for plot in result.get("plots") or []:
        path = Path(plot)
        if path.is_file():
            if path.resolve().parent != out_dir.resolve():
                shutil.copy(path, out_dir / path.name)
            section.plots.append(path.name)
    section.data = {k: v for k, v in result.items() if k != "markdown"}
    return section


def run(ctx: Context, key: str) -> Section:
    name = MODULES[key]
    if importlib.util.find_spec(name) is None:
        raise SectionSkipped(f"{name.replace('.', '/')}.py is not in this tree yet")
    module = importlib.import_module(name)
    takes_loadgen = "loadgen" in inspect.signature(module.run).parameters  # the sections that send HTTP load
    result = module.run(ctx.quick, loadgen=ctx.loadgen) if takes_loadgen else module.run(ctx.quick)
    if not isinstance(result, Mapping):
        raise TypeError(f"{name}.run() returned {type(result).__name__}, expected a dict")
    return to_section(key, result, ctx.out_dir)
