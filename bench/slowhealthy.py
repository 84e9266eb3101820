"""A slow but healthy real model is never killed: SmolLM2 under CPU load with the shipped defaults.

The request-level watchdog (router/edge/heartbeat.py) and the health probes call a process hung after the
same silence (10 s with the defaults). This runs the demo SmolLM2 behind a router with every supervision
setting at its default, adds ``--busy`` busy loops (un-niced, so the load average passes 10 on a small
machine), and keeps ``--clients`` clients sending non-streamed chats (long prompts, 200 new tokens) for
``--seconds``. It prints the requests by outcome, the slowest answer, the load average and the model's
restarts; it exits 1 when any request failed or the process was restarted (killed as hung).

``python -m bench.slowhealthy --seconds 90 --busy 8`` — loopback only, bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from bench.procs import Procs
from bench.realmodel import DEMO_GGUF
from bench.routerctl import router_config, start_router

PROMPT = ("Explain, step by step and in detail, how a river carves a canyon over millions of years, "
          "and what a geologist looks for in its walls. ") * 12  # ~300 tokens of prefill


def busy(until: float) -> None:
    while time.monotonic() < until:
        pass


async def client(session: aiohttp.ClientSession, url: str, until: float, outcomes: Counter[str],
                 slowest: list[float], index: int) -> None:
    while time.monotonic() < until:
        body = {"model": "smollm2", "max_tokens": 200, "temperature": 0,
                "messages": [{"role": "user", "content": f"{index}. {PROMPT}"}]}
        started = time.monotonic()
        try:
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                data: Any = await resp.json(content_type=None)
                ok = resp.status == 200 and bool(data["choices"][0]["message"]["content"])
                outcomes["ok" if ok else f"http {resp.status}: {str(data)[:120]}"] += 1
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
            outcomes[f"error {type(exc).__name__}"] += 1
        slowest.append(time.monotonic() - started)


async def load(url: str, seconds: float, clients: int) -> tuple[Counter[str], list[float]]:
    outcomes: Counter[str] = Counter()
    slowest: list[float] = []
    until = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        await asyncio.gather(*(client(session, url, until, outcomes, slowest, i) for i in range(clients)))
    return outcomes, slowest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.slowhealthy", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--busy", type=int, default=8, help="busy loops beside the model (un-niced)")
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args(argv)
    if not DEMO_GGUF.exists():
        print(f"no demo model at {DEMO_GGUF}: run make models")
        return 1
    with tempfile.TemporaryDirectory(prefix="ovrouter-slowhealthy-") as tmp, Procs(Path(tmp) / "logs") as procs:
        model = {"task": "llm", "path": str(DEMO_GGUF), "preload": True}
        config = router_config(Path(tmp) / "state", {"smollm2": model})
        config["defaults"].pop("health_interval_s")  # every supervision setting at its shipped default
        router = start_router(procs, Path(tmp), config)
        deadline = time.monotonic() + 300
        while router.state("smollm2") != "READY" and time.monotonic() < deadline:
            time.sleep(0.2)
        pid = router.pid("smollm2")
        until = time.monotonic() + args.seconds
        loops = [multiprocessing.Process(target=busy, args=(until,), daemon=True) for _ in range(args.busy)]
        for loop in loops:
            loop.start()
        outcomes, times = asyncio.run(load(router.url, args.seconds, args.clients))
        load_avg = os.getloadavg()
        for loop in loops:
            loop.join(5)
        entry = router.models()["smollm2"]
        procs.stop(router.proc, timeout_s=30)
    print(f"SmolLM2, shipped defaults, {args.busy} busy loops, {args.clients} clients, {args.seconds:g} s; "
          f"load average at the end {load_avg[0]:.1f} / {load_avg[1]:.1f}")
    print(f"requests: {dict(outcomes)}; slowest answer {max(times or [0]):.1f} s, median "
          f"{sorted(times)[len(times) // 2] if times else 0:.1f} s")
    print(f"restarts: {entry.get('restarts')}, pid {pid} -> {entry.get('pid')}, last_error: {entry.get('last_error')}")
    failed = sum(n for k, n in outcomes.items() if k != "ok") or entry.get("restarts") or entry.get("pid") != pid
    print("slowhealthy: " + ("FAILED" if failed else "passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
