"""Repeat test files under CPU load to reproduce a rare crash (issue 25: a SIGSEGV around the reload tests).

    .venv/bin/python tools/crash_hunt.py --runs 20 --busy 1 tests/test_router_reload.py tests/test_router_process.py

Each run is a fresh ``pytest`` process (so tests/conftest.py gives it its own crash folder under
tests/crashes/, with faulthandler on in every process it starts); ``--busy`` busy-loop processes
compete for the CPUs meanwhile and stop with the hunt. Prints one line a run and a summary: the
exit codes, the runs killed by a signal, and every non-empty crash file. Exit 1 if any run crashed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--busy", type=int, default=1, help="busy-loop processes meanwhile (bounded by --max-s)")
    parser.add_argument("--max-s", type=float, default=1800, help="stop starting runs after this many seconds")
    args = parser.parse_args()
    started = time.monotonic()
    spinners = [multiprocessing.Process(target=_spin, args=(args.max_s + 600,), daemon=True) for _ in range(args.busy)]
    for spinner in spinners:
        spinner.start()
    codes: Counter[int] = Counter()
    crashed = []
    try:
        for run in range(1, args.runs + 1):
            if time.monotonic() - started > args.max_s:
                break
            t0 = time.monotonic()
            env = {k: v for k, v in os.environ.items() if k != "OVROUTER_FAULT_DIR"}  # each run its own folder
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.files],
                                  cwd=ROOT, env=env, capture_output=True, text=True)
            codes[proc.returncode] += 1
            tail = (proc.stdout.strip().splitlines() or ["?"])[-1]
            print(f"run {run}: rc={proc.returncode} {time.monotonic() - t0:.0f}s {tail}", flush=True)
            for line in proc.stdout.splitlines():  # which tests failed (the -ra summary), for a run that did not crash
                if line.startswith(("FAILED ", "ERROR ")):
                    print(f"  {line[:300]}", flush=True)
            if proc.returncode < 0 or proc.returncode > 128:
                crashed.append(run)
                print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", flush=True)
    finally:
        for spinner in spinners:
            spinner.terminate()
            spinner.join(5)
    files = sorted(p for p in (ROOT / "tests" / "crashes").glob("*/*") if p.stat().st_size) \
        if (ROOT / "tests" / "crashes").is_dir() else []
    print(f"runs: {sum(codes.values())}, exit codes: {dict(codes)}, killed by a signal: {crashed or 'none'}")
    for path in files:
        print(f"--- {path.relative_to(ROOT)}\n{path.read_text(errors='replace')[:4000]}")
    return 1 if crashed or files else 0


if __name__ == "__main__":
    raise SystemExit(main())
