"""``make soak``: ``SOAK_MINUTES`` (default 30) of ``make chaos``'s mixed load and faults, with the router's and the
long-lived model servers' resident memory, open files and threads sampled every minute; fails on growth past the
bounds below once warmed up, and on anything ``make chaos`` fails on.

The load and the faults are bench/chaos.py's (six clients, streamed and not, over fake models and the demo
SmolLM2; ``kill -9``, SIGSTOP, fault markers, config edits, unloads and restarts of ``alpha`` and ``beta``).
The processes measured are the ones nothing restarts: the router, ``calm`` (a fake model) and ``smollm2``
(the real pipeline, under load the whole time). After ``--warmup`` minutes (default: a fifth of the run, at
least one minute), the highest figure of the last third of the samples may exceed the highest of the first
third (highs against highs: open files swing with the connections) by at most:

======================  ============  ===================================================
figure                  bound          why
======================  ============  ===================================================
router RSS              +48 MiB        allocator high-water marks settle during warm-up
model server RSS        +64 MiB        the KV cache and the allocator's arenas too
open files (each)       +16            sockets come and go with the load; a leak climbs
threads (each)          +8             thread pools are bounded
model processes (all)   <= 2 a model   one, plus a new one beside it in a rolling change
======================  ============  ===================================================

SmolLM2's KV cache is sized to :data:`KV_CACHE_BLOCKS` blocks (~8k tokens) here: with prefix caching on (the default for
``llm``) the cache keeps the blocks of past prompts until it is full, so the process grows by up to the
cache's size whatever else happens, and the default 1 GB would take most of a 30-minute run to fill.

Loopback only; bounded by ``--minutes`` (at most 240).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from bench import chaos
from bench.procs import Procs
from bench.routerctl import Router, router_config, start_router

log = logging.getLogger("soak")

MIB = 1024 * 1024
WATCHED = ("router", "calm", "smollm2")
#: SmolLM2's KV cache in the soak, in blocks of 32 tokens (256: ~8k tokens, ~100-200 MB): the prefix cache keeps
#: every block until the cache is full, so the process grows up to this size whatever the load; the default
#: (1 GB on CPU, ``cache_size`` takes whole GB) would fill over most of a 30-minute run.
KV_CACHE_BLOCKS = 256
#: Growth allowed over the baseline (see the module doc): RSS MiB, open files, threads.
ROUTER_BOUNDS = (48.0, 16, 8)
MODEL_BOUNDS = (64.0, 16, 8)


@dataclass(frozen=True, slots=True)
class Sample:
    minute: float
    figures: dict[str, tuple[float, int, int]]  # process -> (rss MiB, open files, threads)
    model_processes: int


def figures(pid: int | None) -> tuple[float, int, int] | None:
    if pid is None:
        return None
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return proc.memory_info().rss / MIB, proc.num_fds(), proc.num_threads()
    except psutil.Error:
        return None


def sample(router: Router, state_dir: Path, started: float) -> Sample:
    pids: dict[str, int | None] = {"router": router.proc.pid}
    for name in WATCHED[1:]:
        with contextlib.suppress(Exception):
            pids[name] = router.pid(name)
    found = {name: f for name, pid in pids.items() if (f := figures(pid)) is not None}
    return Sample((time.monotonic() - started) / 60, found, len(chaos.model_processes(state_dir)))


async def sampler(router: Router, state_dir: Path, every_s: float, samples: list[Sample], started: float) -> None:
    while True:
        taken = await asyncio.to_thread(sample, router, state_dir, started)
        samples.append(taken)
        cells = "  ".join(f"{n} {r:.0f}MiB/{f}fd/{t}thr" for n, (r, f, t) in sorted(taken.figures.items()))
        log.info("minute %.1f: %s  model processes %d", taken.minute, cells, taken.model_processes)
        await asyncio.sleep(every_s)


def growth(samples: list[Sample], warmup_min: float, models: int) -> list[str]:
    """The bounds exceeded after warm-up (empty: none), per process and figure."""
    after = [s for s in samples if s.minute >= warmup_min]
    problems = [f"{s.model_processes} model processes at minute {s.minute:.0f} (at most {2 * models})"
                for s in samples if s.model_processes > 2 * models]
    if len(after) < 2:
        return problems + [f"only {len(after)} sample(s) after the {warmup_min:g} min warm-up: run longer"]
    for name in WATCHED:
        series = [s.figures[name] for s in after if name in s.figures]
        if len(series) < 2:
            continue
        third = max(1, len(series) // 3)  # highs against highs: open files swing with the connections
        bounds = ROUTER_BOUNDS if name == "router" else MODEL_BOUNDS
        for i, (label, bound) in enumerate(zip(("RSS MiB", "open files", "threads"), bounds, strict=True)):
            base, peak = max(v[i] for v in series[:third]), max(v[i] for v in series[-third:])
            if peak - base > bound:
                problems.append(f"{name} {label} grew {base:.0f} -> {peak:.0f} (bound +{bound})")
    return problems


def _cell(values: tuple[float, int, int] | None) -> str:
    return "-" if values is None else f"{values[0]:.0f}/{values[1]}/{values[2]}"


def table(samples: list[Sample]) -> str:
    lines = [f"{'min':>5} " + " ".join(f"{n + ' MiB/fd/thr':>22}" for n in WATCHED) + "  procs"]
    for s in samples:
        cells = " ".join(f"{_cell(s.figures.get(n)):>22}" for n in WATCHED)
        lines.append(f"{s.minute:>5.1f} {cells}  {s.model_processes:>5}")
    return "\n".join(lines)


async def run(router: Router, config: dict[str, Any], state_dir: Path, minutes: float, sample_s: float,
              seed: int) -> tuple[chaos.Tally, list[Sample]]:
    samples: list[Sample] = []
    started = time.monotonic()
    task = asyncio.create_task(sampler(router, state_dir, sample_s, samples, started))
    try:
        tally = await chaos.soak(router, config, minutes * 60, 2.0, seed)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    samples.append(await asyncio.to_thread(sample, router, state_dir, started))
    return tally, samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=float(os.environ.get("SOAK_MINUTES", "30")))
    parser.add_argument("--warmup", type=float, help="minutes before the baseline (default: a fifth, at least 1)")
    parser.add_argument("--sample-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--keep-logs", type=Path, help="copy the router's and model servers' logs here at the end "
                        "(each clean failure is listed with the time it was sent: find it there)")
    parser.add_argument("--no-real", action="store_true", help="fake models only")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("chaos").setLevel(logging.WARNING)  # one line a chaos action is too many for 30 minutes
    minutes = min(args.minutes, 240.0)
    warmup = args.warmup if args.warmup is not None else max(1.0, minutes / 5)
    with tempfile.TemporaryDirectory(prefix="ovrouter-soak-") as tmp, Procs(Path(tmp) / "logs") as procs:
        state_dir = Path(tmp) / "state"
        chosen = chaos.models(not args.no_real, wrapped=False)
        if "smollm2" in chosen:  # a KV cache full within the warm-up (see the module doc)
            chosen["smollm2"]["scheduler"] = {"num_kv_blocks": KV_CACHE_BLOCKS}
        config = router_config(state_dir, chosen, {"health_interval_s": 1, "health_failures": 2,
                                                   "request_timeout_s": 50})
        router = start_router(procs, Path(tmp), config)
        tally, samples = asyncio.run(run(router, config, state_dir, minutes, args.sample_s, args.seed))
        procs.stop(router.proc, timeout_s=30)
        reasons = chaos.report(tally, chaos.reap_orphans(state_dir), minutes * 60)
        chaos.keep_logs(Path(tmp), args.keep_logs)
    print(f"\nsamples (every {args.sample_s:g} s; baseline at minute {warmup:g}):\n{table(samples)}")
    return chaos.verdict("soak", reasons + growth(samples, warmup, len(chosen) + 1))


if __name__ == "__main__":
    sys.exit(main())
