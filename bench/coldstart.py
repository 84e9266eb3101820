"""Cold start: request -> first token for a stopped model through the router, vs the bare pipeline.

Set-up: the router loads smollm2 once (this converts the GGUF to IR under ``state_dir``
and fills ``cache_dir``), then unloads it. Each repetition then (a) streams a chat for
the stopped model through the router and times the first content delta — process spawn,
imports, pipeline load, readiness poll and prefill all included — and (b) runs
``bench/bare_pipeline.py`` in a fresh process on the same IR and ``CACHE_DIR``, timing
the pipeline construction and the first token in-process. Repetitions alternate (a)/(b).
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import time
from pathlib import Path

import aiohttp

from bench import plots
from bench.common import Context, Section, Table, median, ratio
from bench.procs import ROOT, die_with_parent
from bench.realmodel import DEMO_GGUF, MODEL, PROMPT, _payload, real_model, require_model, stream_chat
from bench.routerctl import Router, router_config, start_router

__all__ = ["run"]

log = logging.getLogger(__name__)

TARGET_RATIO = 1.3


def _cold_ttft(router: Router) -> float:
    """Seconds from sending the request to the first content delta, the model stopped beforehand."""
    import uvloop

    async def once() -> float:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            stats = await stream_chat(session, router.url + "/v1/chat/completions", _payload(MODEL, 4))
        if stats.status != 200:
            raise RuntimeError(f"cold request answered {stats.status}")
        return stats.ttft_s

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(once())


def _converted_ir(state_dir: Path) -> Path | None:
    found = sorted(state_dir.rglob("openvino_model.xml"))
    return found[0].parent if found else None


def _bare(ctx: Context, state_dir: Path) -> dict[str, float]:
    ir = _converted_ir(state_dir)
    argv = [ctx.python, "-m", "bench.bare_pipeline", "--cache-dir", str(state_dir / "ov-cache"), "--prompt", PROMPT]
    argv += ["--path", str(ir), "--tokenizer", str(DEMO_GGUF)] if ir else ["--path", str(DEMO_GGUF)]
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False, cwd=ROOT,
                          preexec_fn=die_with_parent)  # noqa: PLW1509 - only a prctl
    wall = time.perf_counter() - start
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("{")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"bare pipeline failed ({done.returncode}): {done.stderr.strip()[-600:]}")
    figures: dict[str, float] = {k: v for k, v in json.loads(line).items() if isinstance(v, float)}
    figures["process_s"] = wall
    figures["source_ir"] = 1.0 if ir else 0.0
    return figures


def run(ctx: Context) -> Section:
    require_model()
    section = Section("coldstart", "Cold start: request to first token for a stopped model")
    tmp = ctx.section_tmp("coldstart")
    state = ctx.model_state
    router = start_router(ctx.procs, tmp, router_config(state, {MODEL: real_model()}), name="coldstart-router")
    warm_started = time.perf_counter()
    router.load(MODEL)  # converts to IR and fills the cache: the first start ever is not a cold start
    first_load_s = time.perf_counter() - warm_started
    router.unload(MODEL)
    cold, bare = [], []
    for _ in range(ctx.count(3, 1)):
        cold.append(_cold_ttft(router))
        router.unload(MODEL)
        bare.append(_bare(ctx, state))
        log.info("cold %.3f s, bare load+first token %.3f s", cold[-1], bare[-1]["load_s"] + bare[-1]["first_token_s"])
    base = [b["load_s"] + b["first_token_s"] for b in bare]
    rows = [
        ["ovrouter: request -> first token (model stopped)", median(cold), min(cold), max(cold), ratio(median(cold),
                                                                                                      median(base))],
        ["bare: pipeline load + first token (in-process)", median(base), min(base), max(base), 1.0],
        ["bare: of which pipeline load", median([b["load_s"] for b in bare]), None, None, None],
        ["bare: of which first token", median([b["first_token_s"] for b in bare]), None, None, None],
        ["bare: import openvino_genai (not in baseline)", median([b["import_s"] for b in bare]), None, None, None],
        ["bare: whole fresh process (not in baseline)", median([b["process_s"] for b in bare]), None, None, None],
    ]
    section.tables.append(Table(["figure", "median s", "min s", "max s", "x baseline"], rows))
    value = ratio(median(cold), median(base))
    section.notes.append(f"Target <= {TARGET_RATIO}x the bare pipeline: "
                         f"{'met' if value is not None and value <= TARGET_RATIO else 'MISSED'} ({value or 0:.2f}x).")
    source = "the converted IR" if bare and bare[0]["source_ir"] else "the GGUF (no converted IR was found)"
    section.intro = (
        f"{len(cold)} alternating repetitions. Router config: `save_ov_model: true`, `cache_dir` set; the bare "
        f"baseline loads {source} with the same CACHE_DIR in a fresh process. The first load of the section "
        f"(GGUF -> IR conversion and cache fill unless an earlier section did them; not counted) took "
        f"{first_load_s:.1f} s."
    )
    groups = {"request -> first token": {"ovrouter (stopped model)": median(cold), "bare pipeline": median(base)}}
    section.plots.append(plots.bars(ctx.plot_path("coldstart"), "Cold start (median)", "seconds", groups))
    section.data = {"cold_s": cold, "bare": bare, "first_load_s": first_load_s}
    return section
