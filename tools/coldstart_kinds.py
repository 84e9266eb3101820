"""Per model kind: assignment -> ready with a spare interpreter and without, warm ``cache_dir`` or none.

Drives ``python -m modelserver`` the way procman does (a readiness token, the ready line read
from stdout) on the small models in ``models/``, in fresh processes, interleaved round by
round, and prints the medians with the slices from the model server's ``/health`` start marks:

    assigned/spawned -> interpreter -> imports (server modules) -> load_start
    -> engine imports (load_start .. pipeline construction began) -> pipeline -> ready line

Usage: ``PYTHONPATH=$PWD .venv/bin/python tools/coldstart_kinds.py [--rounds 3] [--kinds embeddings ...]
[--warm ENGINE:TASK,...] [--modes spare,spare-kind,fresh,nocache]``. Modes: ``spare`` is told ``--warm``
(none: the spare's default, the llm engine), ``spare-kind`` is told the model's own engine, ``fresh`` starts
a fresh process, all three with a warm ``cache_dir``; ``nocache`` is a fresh process without one.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench import coldkinds

ROOT = Path(__file__).resolve().parent.parent
KINDS = {"llm": "models/SmolLM2-135M-Instruct.Q4_1.gguf",
         **{kind.task: f"models/{kind.folder}" for kind in coldkinds.KINDS}}
READY = "ovrouter-ready "
SPARE_READY = "ovrouter-spare-ready"


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_line(proc: subprocess.Popen[str], prefix: str, deadline_s: float = 300) -> float:
    assert proc.stdout is not None
    end = time.time() + deadline_s
    while time.time() < end:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"process exited ({proc.wait()}) before {prefix!r}")
        if line.startswith(prefix):
            return time.time()
    raise RuntimeError(f"no {prefix!r} within {deadline_s} s")


def _health(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as reply:
        return dict(json.load(reply))


def one(kind: str, mode: str, cache: Path | None, warm: str | None) -> dict[str, float]:
    port = _port()
    token = secrets.token_hex(4)
    argv = [sys.executable, "-m", "modelserver", "--task", kind, "--path", str(ROOT / KINDS[kind]),
            "--port", str(port), "--log-level", "warning"]
    if cache is not None:
        argv += ["--cache-dir", str(cache)]
    env = {**os.environ, "OVROUTER_READY_TOKEN": token, "PYTHONUNBUFFERED": "1"}
    if mode.startswith("spare"):
        spare_argv = [sys.executable, "-m", "modelserver", "--spare"] + (["--warm", warm] if warm else [])
        if mode == "spare-kind":  # a spare told the model's own engine
            spare_argv = [sys.executable, "-m", "modelserver", "--spare", "--warm", f"openvino:{kind}"]
        proc = subprocess.Popen(spare_argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                cwd=ROOT)
        _wait_line(proc, SPARE_READY)
        rss = _rss(proc.pid)
        assert proc.stdin is not None
        start = time.time()
        proc.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": str(ROOT)}) + "\n")
        proc.stdin.flush()
    else:
        rss = 0.0
        start = time.time()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        ready = _wait_line(proc, READY + token)
        marks = _health(port)["startup"]
    finally:
        proc.terminate()
        proc.wait(30)
    built = marks["loaded"] - (marks.get("engine_load_s") or 0.0)
    return {"total": ready - start, "interpreter": marks["interpreter"] - start,
            "server imports": marks["imports"] - marks["interpreter"],
            "to load_start": marks["load_start"] - marks["imports"],
            "engine imports": built - marks["load_start"], "pipeline": marks.get("engine_load_s") or 0.0,
            "ready line": ready - marks["loaded"], "spare_rss_mib": rss}


def _rss(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", nargs="*", default=[k for k in KINDS if k != "llm"])
    parser.add_argument("--modes", default="spare,fresh")
    parser.add_argument("--warm", default=None)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="coldkinds-"))
    caches = {kind: tmp / kind for kind in args.kinds}
    modes = args.modes.split(",")
    for kind in args.kinds:  # write each kind's blobs once
        one(kind, "fresh", caches[kind], None)
    results: dict[str, dict[str, list[dict[str, float]]]] = {k: {m: [] for m in modes} for k in args.kinds}
    loads = []
    for _ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for kind in args.kinds:
            for mode in modes:
                cache = None if mode == "nocache" else caches[kind]
                results[kind][mode].append(one(kind, mode if mode.startswith("spare") else "fresh", cache,
                                               args.warm))
    blobs = {kind: sorted(p.name for p in caches[kind].rglob("*.blob")) for kind in args.kinds}
    print(f"load average (1 min) per round: {', '.join(f'{x:.1f}' for x in loads)}")
    for kind in args.kinds:
        print(f"{kind}: {len(blobs[kind])} blobs in cache_dir")
        for mode in modes:
            rows = results[kind][mode]
            med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
            parts = " ".join(f"{k}={v:.3f}" for k, v in med.items() if k not in ("total", "spare_rss_mib"))
            rss = f" spare_rss={med['spare_rss_mib']:.0f}MiB" if med["spare_rss_mib"] else ""
            print(f"  {mode:8s} total={med['total']:.3f} s (min {min(r['total'] for r in rows):.3f}) {parts}{rss}")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "loads": loads, "blobs": blobs}))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
