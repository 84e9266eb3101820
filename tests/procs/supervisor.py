"""A supervising process for the kill -9 test: runs a ProcessManager with N stand-in backends.

    python supervisor.py RUNTIME_DIR N [--loop asyncio|uvloop]

Starts N backends, waits until all are READY, prints ``pids <p1> <p2> ...`` and then waits
forever. The test SIGKILLs this process and checks that the backends die with it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from procman import BackendSpec, ProcessManager

STANDIN = str(Path(__file__).resolve().parent / "standin.py")


async def supervise(runtime_dir: Path, count: int) -> None:
    manager = ProcessManager(runtime_dir)
    backends = [
        manager.add(BackendSpec(name=f"b{i}", argv=(sys.executable, STANDIN, "--uds", "${SOCKET}")))
        for i in range(count)
    ]
    await asyncio.gather(*(b.ensure_ready() for b in backends))
    print("pids", *(b.pid for b in backends), flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runtime_dir", type=Path)
    parser.add_argument("count", type=int)
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    args = parser.parse_args()
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(supervise(args.runtime_dir, args.count))
    else:
        asyncio.run(supervise(args.runtime_dir, args.count))


if __name__ == "__main__":
    main()
