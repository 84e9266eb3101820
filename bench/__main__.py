"""``make bench``: ``python -m bench [--quick] [--only SECTION ...] [--out DIR]``.

Runs every section in order, each with its own processes, and writes
``bench/results/latest.md`` (+ ``latest.json`` and PNG plots). A section that cannot run
here (a component not built yet) is reported as skipped with the reason; one that fails
is reported with its error and makes the exit status 1. Everything started is stopped
at the end, on an error, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from bench import deps, report
from bench.common import Context, Section, SectionSkipped
from bench.loadgen import Tool
from bench.procs import ROOT, Procs

log = logging.getLogger("bench")

#: key -> (module, title). Order is run order: cheap CPU-bound proxy figures first, the model ones after.
SECTIONS: dict[str, tuple[str, str]] = {
    "overhead": ("bench.overhead", "Proxy overhead (trivial backend)"),
    "streaming": ("bench.streaming", "Streaming: time to first byte and inter-chunk gap"),
    "model": ("bench.realmodel", "Real model: tokens/s direct vs through the router"),
    "structured": ("bench.structured", "Constrained decoding: tokens/s with and without structured output"),
    "agent_session": ("bench.agent_session", "Agent session: TTFT of a turn repeating a ~3,000-token start"),
    "coldstart": ("bench.coldstart", "Cold start: request to first token for a stopped model"),
    "peer_llamacpp": ("bench.peer_llamacpp", "Peer: llama.cpp's server (llama-cpp-python), alone and through ovrouter"),
    "recovery": ("bench.recovery", "Recovery from a fatal error and from kill -9"),
    "ray": ("bench.raycluster", "Ray engine: cold start through Ray vs local, recovery after node loss"),
    "memory": ("bench.memory", "Memory: router and model servers, and what a stop gives back"),
    "memory_sched": ("bench.memory_sched", "Memory-aware loading vs max_loaded_models (skewed mix)"),
    "scale": ("bench.scale", "Scale: 100 configured models"),
    "hostile": ("bench.hostile", "Hostile load: large uploads and idle connections"),
    "llm_throughput": ("bench.external", "Model server vs bare pipeline (bench/llm_throughput.py)"),
    "embeddings": ("bench.external", "Embeddings and other tasks (bench/embeddings.py)"),
}
DEFAULT_OUT = ROOT / "bench" / "results"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description="ovrouter benchmarks -> latest.md")
    parser.add_argument("--quick", action="store_true", help="tiny smoke mode; its numbers mean little")
    parser.add_argument("--only", nargs="+", metavar="SECTION", choices=list(SECTIONS), help="run only these")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where latest.md, latest.json and plots go")
    parser.add_argument("--loadgen", choices=["auto", "wrk", "asyncio"], default="auto",
                        help="auto = wrk when installed, else the asyncio generator")
    parser.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (process logs, configs)")
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser.parse_args(argv)


def _loadgen(choice: str, tools: deps.Tools) -> Tool:
    if choice == "wrk" and not tools.wrk:
        raise SystemExit("--loadgen wrk: wrk is not installed (make bench-deps)")
    if choice == "asyncio" or not tools.wrk:
        return "asyncio"
    return "wrk"


def _loadgen_note(loadgen: Tool, choice: str) -> str:
    if loadgen == "wrk":
        return "wrk (one thread, `bench/wrk_post.lua` POSTs the body; percentiles from wrk's record of every request)"
    why = "chosen with --loadgen asyncio" if choice == "asyncio" else "wrk is not installed (`make bench-deps`)"
    return f"the bench's asyncio generator (uvloop + httptools, every request's latency kept), {why}"


def _sigterm_as_sigint(signum: int, frame: FrameType | None) -> None:
    """SIGTERM takes Ctrl-C's path: KeyboardInterrupt in sync code, task cancellation inside asyncio.Runner."""
    signal.raise_signal(signal.SIGINT)


def _run_section(key: str, ctx: Context) -> Section:
    module_name, title = SECTIONS[key]
    started = time.perf_counter()
    try:
        module = importlib.import_module(module_name)
        runner: Callable[..., Section] = module.run
        section = runner(ctx, key) if module_name == "bench.external" else runner(ctx)
    except SectionSkipped as exc:
        section = Section(key, title, status="skipped", notes=[f"Not run: {exc}"])
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - one broken section must not lose the others' figures
        log.error("section %s failed: %s", key, exc)
        log.debug("%s", traceback.format_exc())
        section = Section(key, title, status="failed", notes=[f"Failed: {type(exc).__name__}: {exc}"])
    finally:
        ctx.procs.stop_all()  # each section owns its processes; none survive into the next
    section.seconds = time.perf_counter() - started
    log.info("section %s: %s in %.1f s", key, section.status, section.seconds)
    return section


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request drowns the progress log
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in the background (SIG_IGN)
    signal.signal(signal.SIGTERM, _sigterm_as_sigint)
    tools = deps.detect()
    loadgen = _loadgen(args.loadgen, tools)
    if loadgen == "asyncio" and args.loadgen == "auto":
        log.warning("wrk not found (make bench-deps installs it): using the asyncio load generator")
    machine = report.machine_info(tools)
    machine["loadgen"] = _loadgen_note(loadgen, args.loadgen)
    keys = args.only or list(SECTIONS)
    tmp = Path(tempfile.mkdtemp(prefix="ovr-bench-"))
    sections: list[Section] = []
    started = time.perf_counter()
    interrupted = False
    try:
        with Procs(tmp / "logs") as procs:
            ctx = Context(quick=args.quick, out_dir=args.out, tmp_dir=tmp, procs=procs, tools=tools, loadgen=loadgen)
            args.out.mkdir(parents=True, exist_ok=True)
            for key in keys:
                log.info("section %s", key)
                sections.append(_run_section(key, ctx))
    except KeyboardInterrupt:
        interrupted = True
        if len(sections) < len(keys):
            key = keys[len(sections)]
            sections.append(Section(key, SECTIONS[key][1], status="failed", notes=["Interrupted (Ctrl-C or SIGTERM)."]))
        log.warning("interrupted: every process was stopped; writing what was measured")
    finally:
        machine["loadavg_end"] = os.getloadavg()
        shown = " ".join(sys.argv[1:] if argv is None else argv)
        path = report.write(args.out, machine, sections, shown, time.perf_counter() - started)
        print(f"report: {path}")
        failed = [s.key for s in sections if s.status == "failed"]
        if args.keep_tmp or failed or interrupted:
            print(f"process logs and configs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 130 if interrupted else (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
