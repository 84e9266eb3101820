"""Per model kind: the engine's load with a warm ``cache_dir`` against none, in fresh processes, interleaved.

Prints, per kind and variant, the median wall time and CPU time (every thread of the process) of
``make_engine(spec)`` and which blobs of the cache folder each warm load rewrote (a blob rewritten
on every start is one the plugin could not import: no speed-up from it, only the cost of writing it).

Usage: ``PYTHONPATH=$PWD .venv/bin/python tools/cache_kinds.py [--rounds 5] [--kinds embeddings ...]
[--ov-config '{}' '{"ATTENTION_BACKEND": "SDPA"}']``: each ``ov_config`` a variant, with and without the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import coldkinds

ROOT = Path(__file__).resolve().parent.parent
KINDS = {kind.task: f"models/{kind.folder}" for kind in coldkinds.KINDS}
CHILD = """
import json, os, sys, time
from pathlib import Path
from modelserver.spare import warm_imports
kind, path, cache, ov_config = sys.argv[1:5]
warm_imports([f"openvino:{kind}"])
from modelserver.engines import make_engine
from modelserver.spec import build_model_spec
raw = {"task": kind, "path": path, "ov_config": json.loads(ov_config)}
if cache != "-":
    raw["cache_dir"] = cache
spec = build_model_spec("x", raw, base_dir=Path.cwd())
wall, cpu = time.perf_counter(), time.process_time()
make_engine(spec)
print(json.dumps({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}))
sys.stdout.flush()
os._exit(0)
"""


def load(kind: str, cache: Path | None, ov_config: str) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", CHILD, kind, str(ROOT / KINDS[kind]), str(cache or "-"), ov_config],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def blobs(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.rglob("*.blob")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kinds", nargs="*", default=list(KINDS))
    parser.add_argument("--ov-config", nargs="*", default=["{}"])
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cachekinds-"))
    cases = [(kind, i, config) for kind in args.kinds for i, config in enumerate(args.ov_config)]
    rewritten: dict[tuple[str, int], set[str]] = {(kind, i): set() for kind, i, _ in cases}
    results: dict[tuple[str, int], dict[str, list[dict[str, float]]]] = {
        (kind, i): {"cache": [], "none": []} for kind, i, _ in cases}
    for kind, i, config in cases:
        load(kind, tmp / f"{kind}{i}", config)  # writes the blobs
    loads = []
    for _ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for kind, i, config in cases:
            folder = tmp / f"{kind}{i}"
            before = blobs(folder)
            results[kind, i]["cache"].append(load(kind, folder, config))
            rewritten[kind, i] |= {name for name, mtime in blobs(folder).items() if before.get(name) != mtime}
            results[kind, i]["none"].append(load(kind, None, config))
    print(f"load average (1 min) per round: {', '.join(f'{x:.1f}' for x in loads)}")
    for kind, i, config in cases:
        sizes = {p.name: p.stat().st_size for p in (tmp / f"{kind}{i}").rglob("*.blob")}
        line = []
        for variant, rows in results[kind, i].items():
            wall = statistics.median(r["wall_s"] for r in rows)
            cpu = statistics.median(r["cpu_s"] for r in rows)
            line.append(f"{variant}: wall {wall:.3f} s cpu {cpu:.3f} s")
        again = ", ".join(f"{sizes.get(n, 0) / 2**20:.1f} MiB" for n in sorted(rewritten[kind, i])) or "none"
        print(f"{kind:14s} {config} {'; '.join(line)}; {len(sizes)} blobs, rewritten by warm loads: {again}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
