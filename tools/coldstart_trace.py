"""Where a cold start of each kind goes through the router: sent -> assigned -> loaded -> first request -> answer.

Starts a router (one spare interpreter, warm ``cache_dir``) with the small models in ``models/``
and, round by round, sends each kind one request while it is stopped, then runs the bare
pipeline (``bench/coldkinds.py``) in a fresh process; prints the medians of the slices from the
model server's ``/health`` start marks next to the bare load and first answer:

    to assigned       request sent -> the spare took its assignment (the router's part)
    to load_start     the assignment -> the engine's load began (arguments, spec, loader thread)
    load              the engine's load (``of which pipeline``: the engine's own load_s)
    loaded->request   the engine loaded -> the request handed to it (server listening, the ready line, the
                      router noticing it and forwarding the request)
    request->answer   the request handed to the engine -> its whole answer at the client

``--compare TREE`` runs a second router whose processes import the code of another checkout
(``PYTHONPATH=TREE``), its rounds interleaved with this tree's, for an A/B on a loaded machine.

Usage: ``PYTHONPATH=$PWD .venv/bin/python tools/coldstart_trace.py [--rounds 3] [--kinds speech vlm ...]
[--compare /path/to/other/checkout]``; ``--kinds llm`` adds SmolLM2 (no bare side here).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench import coldkinds
from bench.coldstart import _spares_settled
from bench.procs import Procs
from bench.routerctl import Router, router_config, start_router

Row = dict[str, float]
#: ``--kinds llm``: SmolLM2 (its bare side is ``bench/coldstart.py``'s, not run here)
LLM = coldkinds.Kind("llm", "SmolLM2-135M-Instruct.Q4_1.gguf")


def _cold(router: Router, kind: coldkinds.Kind) -> Row:
    """One request to the stopped ``kind``; its slices."""
    with httpx.Client(timeout=600) as client:  # made before the clock starts (its SSL context)
        sent = time.time()
        answer = coldkinds.send(client, router.url, kind)
        done = time.time()
    if answer.status_code != 200:
        raise RuntimeError(f"{kind.name}: {answer.status_code} {answer.text[:300]}")
    m: dict[str, Any] = router.get(f"/upstream/{kind.name}/health").get("startup") or {}
    router.unload(kind.name)
    return {"total": done - sent, "to assigned": m["process"] - sent, "to load_start": m["load_start"] - m["process"],
            "load": m["loaded"] - m["load_start"], "of which pipeline": m.get("engine_load_s") or 0.0,
            "loaded->request": m["first_request"] - m["loaded"], "request->answer": done - m["first_request"]}


def _router(procs: Procs, tmp: Path, kinds: list[coldkinds.Kind], tree: str, name: str) -> Router:
    config = router_config(tmp / name, coldkinds.model_entries(kinds))
    config["router"]["spare_interpreters"] = 1
    os.environ["PYTHONPATH"], before = tree, os.environ.get("PYTHONPATH", "")
    try:  # the router and every model server it starts import ``tree``'s code
        router = start_router(procs, tmp / name, config, name=name)
    finally:
        os.environ["PYTHONPATH"] = before
    for kind in kinds:  # the blobs into cache_dir, written once (not counted)
        router.load(kind.name)
        router.unload(kind.name)
    return router


def _print(label: str, rows: dict[str, list[Row]]) -> None:
    print(label)
    for task, found in rows.items():
        if not found:
            continue
        med = {key: statistics.median(r[key] for r in found) for key in found[0]}
        print(f"  {task:14s} " + " ".join(f"{k}={v:.3f}" for k, v in med.items()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", nargs="*", default=[k.task for k in coldkinds.present()])
    parser.add_argument("--compare", help="another checkout, run interleaved with this one")
    args = parser.parse_args()
    kinds = [k for k in [*coldkinds.present(), LLM] if k.task in args.kinds]
    tmp = Path(tempfile.mkdtemp(prefix="coldtrace-"))
    here = str(Path(__file__).resolve().parent.parent)
    trees = {"this tree": here, **({"compare": str(Path(args.compare).resolve())} if args.compare else {})}
    with Procs(tmp / "logs") as procs:
        routers = {label: _router(procs, tmp, kinds, tree, f"router-{i}") for i, (label, tree) in
                   enumerate(trees.items())}
        for kind in kinds:
            if kind is not LLM:
                coldkinds.bare(sys.executable, kind, tmp / "bare" / kind.task)
        rows: dict[str, dict[str, list[Row]]] = {label: {k.task: [] for k in kinds} for label in [*trees, "bare"]}
        loads = []
        for index in range(args.rounds):
            loads.append(os.getloadavg()[0])
            order = list(routers.items()) if index % 2 == 0 else list(reversed(routers.items()))
            for kind in kinds:
                for label, router in order:
                    for other in routers.values():
                        _spares_settled(other, 1)
                    rows[label][kind.task].append(_cold(router, kind))
                if kind is LLM:
                    continue
                bare = coldkinds.bare(sys.executable, kind, tmp / "bare" / kind.task)
                rows["bare"][kind.task].append({"load+first": bare["load_s"] + bare["first_s"],
                                                "load": bare["load_s"], "first": bare["first_s"]})
        print(f"load average (1 min) per round: {', '.join(f'{x:.1f}' for x in loads)}; medians of {args.rounds}")
        for label, found in rows.items():
            _print(f"{label} ({trees.get(label, 'bench/coldkinds.py')})", found)
        print("logs in", tmp)


if __name__ == "__main__":
    main()
