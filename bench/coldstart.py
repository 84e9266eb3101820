"""Cold start: request -> first token for a stopped model through the router, vs the bare pipeline.

Set-up: the router loads smollm2 once (this converts the GGUF to IR, tokenizer included,
under ``state_dir``), then unloads it. Each repetition then (a) streams a chat for the
stopped model through the router and times the first content delta — process spawn,
imports, pipeline load, readiness poll and prefill all included — and reads the model
server's start marks from ``/health`` (``modelserver/startup.py``) to split that time into
slices; and (b) runs ``bench/bare_pipeline.py`` in a fresh process on the same IR folder
with its own tokenizer (the best in-process load known: on CPU without ``CACHE_DIR``, which
the LLM pipeline cannot import there, as the model server does), timing the pipeline
construction and the first token in-process. Repetitions alternate (a)/(b), and (a) runs
twice each round: with a spare interpreter waiting (``router.spare_interpreters: 1``, the
default: the start takes a process already past its imports) and without (0, set by a reload
of the same router); every run waits until the spare behind it is ready, so no run shares
the CPU with a spare's imports. The other model kinds whose small models ``models/`` holds get
one row each, reported without a target (``bench/coldkinds.py``): stopped -> whole first answer
with a spare waiting and ``cache_dir`` warm, against the kind's bare load + first answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench import coldkinds, plots
from bench.common import Context, Section, Table, median, ratio
from bench.procs import ROOT, die_with_parent, wait_until
from bench.realmodel import DEMO_GGUF, MODEL, PROMPT, _payload, real_model, require_model, stream_chat
from bench.routerctl import Router, router_config, start_router, write_config

__all__ = ["run"]

log = logging.getLogger(__name__)

TARGET_RATIO = 1.10
#: The demo model again, without the stateful pipeline's first answers (engines/llm_first.py).
CB_ONLY = "smollm2-cb"
TARGET_S = 2.5

#: The slices of a cold start, in order, from the request's send time to its first token.
SLICES = (
    "router + spawn",
    "interpreter start",
    "server imports",
    "openvino import",
    "pipeline construction",
    "readiness noticed",
    "first token",
)


def _cold_ttft(router: Router, model: str = MODEL) -> tuple[float, dict[str, float]]:
    """(seconds from sending the request to the first content delta, the slices of it), model stopped before."""
    import uvloop

    async def once() -> tuple[float, float]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            sent = time.time()
            stats = await stream_chat(session, router.url + "/v1/chat/completions", _payload(model, 4))
        if stats.status != 200:
            raise RuntimeError(f"cold request answered {stats.status}")
        return sent, stats.ttft_s

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        sent, ttft = runner.run(once())
    marks = router.get(f"/upstream/{model}/health").get("startup") or {}
    return ttft, slices(sent, sent + ttft, marks)


def slices(sent: float, first_token: float, marks: dict[str, Any]) -> dict[str, float]:
    """The critical path of one cold start from the model server's marks; empty when it shows none."""
    needed = ("process", "interpreter", "imports", "load_start", "loaded", "first_request", "engine_load_s")
    if any(not isinstance(marks.get(name), (int, float)) for name in needed):
        return {}
    built_from = marks["loaded"] - marks["engine_load_s"]
    edges = [sent, marks["process"], marks["interpreter"], marks["imports"], built_from, marks["loaded"],
             marks["first_request"], first_token]
    # the loader starts right after the imports; the engine module's OpenVINO import runs before its own clock
    return {name: max(0.0, end - start) for name, start, end in zip(SLICES, edges, edges[1:], strict=False)}


def _set_spares(router: Router, count: int) -> None:
    """``router.spare_interpreters: count`` by a reload of the same router (no model restarts)."""
    config = yaml.safe_load(router.config_path.read_text())
    config["router"]["spare_interpreters"] = count
    write_config(router.config_path, config)
    status, body = router.post("/api/reload")
    if status != 200:
        raise RuntimeError(f"reload: {status} {body}")


def _spares_settled(router: Router, count: int) -> None:
    """Until the router holds ``count`` spares, each past its imports (a stopped model wants one)."""
    def settled() -> bool:
        spares = router.get("/api/status").get("spares") or {"spares": []}
        ready = [spare for spare in spares["spares"] if spare["ready"]]
        return len(ready) == len(spares["spares"]) == count
    wait_until(settled, 60, f"{count} spare interpreter(s) ready", interval_s=0.1)


def _spare_rss(router: Router) -> float | None:
    spares = (router.get("/api/status").get("spares") or {}).get("spares") or []
    return spares[0]["resident_bytes"] / 2**20 if spares else None


def _converted_ir(state_dir: Path) -> Path | None:
    found = sorted(state_dir.rglob("openvino_model.xml"))
    return found[0].parent if found else None


def _bare(ctx: Context, state_dir: Path) -> dict[str, float]:
    ir = _converted_ir(state_dir)
    argv = [ctx.python, "-m", "bench.bare_pipeline", "--prompt", PROMPT]
    if ir is None:
        argv += ["--path", str(DEMO_GGUF)]
    elif (ir / "openvino_tokenizer.xml").is_file():
        argv += ["--path", str(ir)]  # the folder with its own tokenizer
    else:
        argv += ["--path", str(ir), "--tokenizer", str(DEMO_GGUF)]
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


def _median_slices(samples: list[dict[str, float]]) -> dict[str, float]:
    complete = [sample for sample in samples if sample]
    return {name: median([sample[name] for sample in complete]) for name in SLICES} if complete else {}


def _bare_slices(bare: list[dict[str, float]]) -> dict[str, float]:
    """The bare process's time in the same terms (what is not import, load or first token: interpreter and exit)."""
    parts = {
        "interpreter start": median([b["process_s"] - b["import_s"] - b["load_s"] - b["first_token_s"] for b in bare]),
        "openvino import": median([b["import_s"] for b in bare]),
        "pipeline construction": median([b["load_s"] for b in bare]),
        "first token": median([b["first_token_s"] for b in bare]),
    }
    return {name: parts.get(name, 0.0) for name in SLICES}


def _breakdown_rows(cold: dict[str, float], bare: dict[str, float]) -> list[list[object]]:
    return [[f"slice: {name}", cold.get(name), bare.get(name) or None] for name in SLICES]


Samples = dict[str, dict[str, list[float]]]


def _other_kinds(ctx: Context, router: Router, kinds: list[coldkinds.Kind], tmp: Path) -> Samples:
    """Per kind, rounds of: a cold request through the router (a spare waiting), then the bare pipeline."""
    samples: Samples = {kind.task: {"cold_s": [], "start_s": [], "bare_s": [], "bare_load_s": []} for kind in kinds}
    for kind in kinds:  # the bare side's blobs, written once (not counted)
        coldkinds.bare(ctx.python, kind, tmp / "bare-cache" / kind.task)
    for _ in range(ctx.count(3, 1)):
        for kind in kinds:
            _spares_settled(router, 1)
            samples[kind.task]["cold_s"].append(coldkinds.first_answer(router.url, kind))
            marks = router.get(f"/upstream/{kind.name}/health").get("startup") or {}
            if isinstance(marks.get("loaded"), float) and isinstance(marks.get("process"), float):
                samples[kind.task]["start_s"].append(marks["loaded"] - marks["process"])
            router.unload(kind.name)
            figures = coldkinds.bare(ctx.python, kind, tmp / "bare-cache" / kind.task)
            samples[kind.task]["bare_s"].append(figures["load_s"] + figures["first_s"])
            samples[kind.task]["bare_load_s"].append(figures["load_s"])
            log.info("cold %s: %.3f s through the router, bare load + first answer %.3f s", kind.task,
                     samples[kind.task]["cold_s"][-1], samples[kind.task]["bare_s"][-1])
    return samples


def run(ctx: Context) -> Section:
    require_model()
    section = Section("coldstart", "Cold start: request to first token for a stopped model")
    tmp = ctx.section_tmp("coldstart")
    state = ctx.model_state
    kinds = coldkinds.present()  # the other kinds' rows (no target): their models are in the config too
    config = router_config(state, {MODEL: real_model(), CB_ONLY: real_model(options={"first_answer": False}),
                                   **coldkinds.model_entries(kinds)})
    config["router"]["spare_interpreters"] = 1
    router = start_router(ctx.procs, tmp, config, name="coldstart-router")
    warm_started = time.perf_counter()
    router.load(MODEL)  # converts to IR (tokenizer included): the first start ever is not a cold start
    first_load_s = time.perf_counter() - warm_started
    router.unload(MODEL)
    for name in (MODEL, CB_ONLY, *(kind.name for kind in kinds)):  # compiled blobs into cache_dir (the stateful
        router.load(name)  # pipeline's and the other kinds'); CB_ONLY's conversion
        router.unload(name)
    cold: list[float] = []
    cold_slices: list[dict[str, float]] = []
    fresh: list[float] = []
    cb_only: list[float] = []
    before: list[float] = []
    bare: list[dict[str, float]] = []
    loads: list[float] = []
    spare_rss: list[float] = []
    for _ in range(ctx.count(5, 1)):
        loads.append(os.getloadavg()[0])
        _spares_settled(router, 1)
        spare_rss += [rss] if (rss := _spare_rss(router)) is not None else []
        ttft, parts = _cold_ttft(router)
        cold.append(ttft)
        cold_slices.append(parts)
        router.unload(MODEL)
        _spares_settled(router, 1)
        cb_only.append(_cold_ttft(router, CB_ONLY)[0])
        router.unload(CB_ONLY)
        _set_spares(router, 0)
        _spares_settled(router, 0)
        fresh.append(_cold_ttft(router)[0])
        router.unload(MODEL)
        before.append(_cold_ttft(router, CB_ONLY)[0])  # neither a spare nor the stateful pipeline: as before
        router.unload(CB_ONLY)
        _set_spares(router, 1)
        _spares_settled(router, 1)
        bare.append(_bare(ctx, state))
        log.info("cold %.3f s (spare), %.3f s (spare, continuous batching only), %.3f s (fresh process), "
                 "%.3f s (neither), bare load+first token %.3f s", cold[-1], cb_only[-1], fresh[-1], before[-1],
                 bare[-1]["load_s"] + bare[-1]["first_token_s"])
    kind_samples = _other_kinds(ctx, router, kinds, tmp)
    base = [b["load_s"] + b["first_token_s"] for b in bare]
    rows: list[list[object]] = [
        ["ovrouter: request -> first token (model stopped, a spare interpreter waiting)", median(cold), min(cold),
         max(cold), ratio(median(cold), median(base))],
        ["ovrouter: the same, continuous batching only (options: {first_answer: false})", median(cb_only),
         min(cb_only), max(cb_only), ratio(median(cb_only), median(base))],
        ["ovrouter: the same without a spare (spare_interpreters: 0)", median(fresh), min(fresh), max(fresh),
         ratio(median(fresh), median(base))],
        ["ovrouter: neither (no spare, continuous batching only: before issue 24)", median(before), min(before),
         max(before), ratio(median(before), median(base))],
        ["bare: pipeline load + first token (in-process)", median(base), min(base), max(base), 1.0],
        ["bare: of which pipeline load", median([b["load_s"] for b in bare]), None, None, None],
        ["bare: of which first token", median([b["first_token_s"] for b in bare]), None, None, None],
        ["bare: import openvino_genai (not in baseline)", median([b["import_s"] for b in bare]), None, None, None],
        ["bare: whole fresh process (not in baseline)", median([b["process_s"] for b in bare]), None, None, None],
    ]
    section.tables.append(Table(["figure", "median s", "min s", "max s", "x baseline"], rows))
    breakdown, bare_parts = _median_slices(cold_slices), _bare_slices(bare)
    if breakdown:
        section.tables.append(Table(["where the time goes (median s)", "ovrouter cold start", "bare fresh process"],
                                    _breakdown_rows(breakdown, bare_parts),
                                    "ovrouter slices from the model server's /health start marks (critical path)"))
    if coldkinds.rows(kind_samples):
        section.tables.append(Table(
            ["other kind (no target)", "ovrouter median s", "ovrouter min-max s", "of which assigned -> loaded s",
             "bare load + first answer s", "of which bare load s", "x bare"], coldkinds.rows(kind_samples),
            "ovrouter: a stopped model's request -> its whole answer through the router, a spare interpreter "
            "waiting and cache_dir warm (assigned -> loaded: the model server's start marks, the spare's "
            "assignment to its engine loaded); bare: the kind's pipeline built in a fresh process with the "
            "properties the model server gives it, then the same request in-process (bench/coldkinds.py)"))
    value = ratio(median(cold), median(base))
    met = value is not None and value <= TARGET_RATIO and median(cold) <= TARGET_S
    section.notes.append(f"Target <= {TARGET_S} s and <= {TARGET_RATIO}x the bare pipeline: "
                         f"{'met' if met else 'MISSED'} ({median(cold):.2f} s, {value or 0:.2f}x).")
    section.notes.append(f"Load average (1 min) at each repetition: {', '.join(f'{x:.1f}' for x in loads)}; "
                         f"the spare interpreter's resident memory: "
                         f"{median(spare_rss) if spare_rss else 0:.0f} MiB (VmRSS once past its imports).")
    source = "the converted IR folder" if bare and bare[0]["source_ir"] else "the GGUF (no converted IR was found)"
    section.intro = (
        f"{len(cold)} alternating repetitions. Router config: `save_ov_model: true`, `cache_dir` set (the LLM's "
        f"stateful pipeline imports its blob from it; the continuous-batching one on CPU cannot); the bare "
        f"baseline loads {source} with its own tokenizer in a fresh process. The first "
        f"load of the section (GGUF -> IR conversion unless an earlier section did it; not counted) took "
        f"{first_load_s:.1f} s."
    )
    bars = {"ovrouter: request -> first token (spare)": breakdown or {"total": median(cold)},
            "bare: fresh process": bare_parts}
    section.plots.append(plots.stacked(ctx.plot_path("coldstart"), "Cold start, where the time goes (median)",
                                       "seconds", bars))
    section.data = {"cold_s": cold, "cb_only_s": cb_only, "fresh_s": fresh, "before_s": before,
                    "cold_slices": cold_slices, "bare": bare,
                    "first_load_s": first_load_s, "load_average": loads, "spare_rss_mib": spare_rss,
                    "other_kinds": kind_samples}
    return section
