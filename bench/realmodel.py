"""Real model: SmolLM2 tokens/s, direct to a model server vs through the router.

Two model servers with the same config run side by side: one launched by the router,
one by the bench on a TCP port (the "direct" baseline). Rounds alternate between them
(single stream, then 8 concurrent streams), so drift hits both. Tokens are the
``usage.completion_tokens`` the server reports in the final stream chunk.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from bench import plots
from bench.common import Context, Section, SectionSkipped, Table, median, ratio
from bench.procs import ROOT, free_port, http_get, wait_http, wait_until
from bench.routerctl import Router, router_config, start_router

__all__ = ["DEMO_GGUF", "StreamStats", "real_model", "require_model", "run", "stream_chat"]

log = logging.getLogger(__name__)

DEMO_GGUF = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = "smollm2"
PROMPT = "Write a long story about a robot who learns to paint. Use many details."
TARGET_RATIO = 0.98


def real_model(**extra: Any) -> dict[str, Any]:
    """The demo model as configured in config.yaml (IR conversion on, CACHE_DIR from the router)."""
    return {"task": "llm", "engine": "openvino", "path": str(DEMO_GGUF), "device": "CPU", "save_ov_model": True,
            **extra}


def require_model() -> None:
    if not DEMO_GGUF.exists():
        raise SectionSkipped(f"{DEMO_GGUF.relative_to(ROOT)} is missing (`make models` provisions it)")
    if importlib.util.find_spec("modelserver.__main__") is None:
        raise SectionSkipped("the model server (`python -m modelserver`) is not in this tree yet")


@dataclass(slots=True)
class StreamStats:
    """One streamed chat completion as the client saw it."""

    tokens: int
    seconds: float
    ttft_s: float
    status: int


def _payload(model: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "messages": [{"role": "user", "content": PROMPT}]}


async def stream_chat(session: aiohttp.ClientSession, url: str, payload: dict[str, Any]) -> StreamStats:
    """POST a streamed chat; time to the first content delta and the completion tokens from ``usage``."""
    start = time.perf_counter()
    ttft = float("nan")
    deltas = 0
    usage_tokens = None
    async with session.post(url, json=payload) as resp:
        if resp.status != 200:
            await resp.read()
            return StreamStats(0, time.perf_counter() - start, ttft, resp.status)
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices") or []):
                deltas += 1
                if deltas == 1:
                    ttft = time.perf_counter() - start
            if chunk.get("usage"):
                usage_tokens = int(chunk["usage"]["completion_tokens"])
    return StreamStats(usage_tokens if usage_tokens is not None else deltas, time.perf_counter() - start, ttft, 200)


async def _concurrent(url: str, streams: int, requests_each: int, max_tokens: int) -> tuple[float, list[StreamStats]]:
    """(aggregate tokens/s, every stream) for ``streams`` clients each sending ``requests_each`` in turn."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def client() -> list[StreamStats]:
            return [await stream_chat(session, url, _payload(MODEL, max_tokens)) for _ in range(requests_each)]

        start = time.perf_counter()
        batches = await asyncio.gather(*(client() for _ in range(streams)))
        elapsed = time.perf_counter() - start
    stats = [s for batch in batches for s in batch]
    failed = [s.status for s in stats if s.status != 200]
    if failed:
        raise RuntimeError(f"{url}: {len(failed)} of {len(stats)} streams failed with {sorted(set(failed))}")
    return sum(s.tokens for s in stats) / elapsed, stats


def measure(url: str, streams: int, requests_each: int, max_tokens: int) -> tuple[float, list[StreamStats]]:
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_concurrent(url, streams, requests_each, max_tokens))


def _pipeline(health_url: str) -> str | None:
    """The pipeline a model server's ``/health`` names ("" when it names none; None when it did not answer)."""
    status, body = http_get(health_url)
    return str(json.loads(body).get("pipeline", "")) if status == 200 else None


def _start_pair(ctx: Context) -> tuple[Router, str]:
    """The router with smollm2 loaded (it converts the IR once), then a direct model server on the same config."""
    tmp = ctx.section_tmp("model")
    router = start_router(ctx.procs, tmp, router_config(ctx.model_state, {MODEL: real_model()}), name="model-router")
    router.load(MODEL)
    port = free_port()
    argv = [ctx.python, "-m", "modelserver", "--config", str(router.config_path), "--model", MODEL, "--port", str(port)]
    proc = ctx.procs.spawn("model-direct", argv)
    health = f"http://127.0.0.1:{port}/health"
    try:
        wait_http(health, proc, timeout_s=300)
        # as Router.load does for the routed one: measured on the continuous-batching pipeline, not the first answers'
        wait_until(lambda: _pipeline(health) not in ("stateful", None), 300,
                   "the direct server on its continuous-batching pipeline", interval_s=0.1)
    except (RuntimeError, TimeoutError) as exc:
        raise RuntimeError(f"{exc}\n{ctx.procs.log_tail('model-direct')}") from None
    return router, f"http://127.0.0.1:{port}"


def run(ctx: Context) -> Section:
    require_model()
    section = Section("model", "Real model: tokens/s direct vs through the router")
    router, direct = _start_pair(ctx)
    targets = {"direct": direct + "/v1/chat/completions", "ovrouter": router.url + "/v1/chat/completions"}
    max_tokens = ctx.count(64, 8)
    rounds = ctx.count(4, 1)  # run-to-run swings here are ~10%: medians of 4 alternating rounds
    conditions = {"1 stream": (1, ctx.count(3, 1)), "8 streams": (8, ctx.count(2, 1))}
    for url in targets.values():
        measure(url, 1, 1, 4)  # warm-up
    tps: dict[tuple[str, str], list[float]] = {}
    ttft: dict[tuple[str, str], list[float]] = {}
    for round_no in range(rounds):
        order = list(targets.items()) if round_no % 2 == 0 else list(reversed(targets.items()))
        for cond, (streams, each) in conditions.items():
            for name, url in order:  # who goes first alternates, so neither gets the warmer slot
                value, stats = measure(url, streams, each, max_tokens)
                tps.setdefault((cond, name), []).append(value)
                ttft.setdefault((cond, name), []).extend(s.ttft_s * 1000 for s in stats)
                log.info("%s %s: %.1f tokens/s", cond, name, value)
    section.intro = (
        "SmolLM2-135M-Instruct (Q4_1 GGUF converted to OpenVINO IR) on CPU, greedy, streamed, "
        "`ignore_eos: true` (every request generates max_tokens), "
        f"max_tokens={max_tokens}, {rounds} alternating round(s); each single-stream figure is tokens over wall time "
        f"of {conditions['1 stream'][1]} requests in turn, each 8-stream one is 8 clients x "
        f"{conditions['8 streams'][1]} requests. Tokens/s = usage.completion_tokens / wall time."
    )
    rows: list[list[object]] = []
    ratios: dict[str, float] = {}
    for cond in conditions:
        base = median(tps[(cond, "direct")])
        for name in targets:
            value = median(tps[(cond, name)])
            rows.append([cond, name, value, median(ttft[(cond, name)]), ratio(value, base)])
        ratios[cond] = ratio(median(tps[(cond, "ovrouter")]), base) or 0.0
    section.tables.append(Table(["condition", "target", "tokens/s", "TTFT p50 ms", "x direct"], rows))
    met = all(value >= TARGET_RATIO for value in ratios.values())
    section.notes.append(f"Target router >= {TARGET_RATIO}x direct: {'met' if met else 'MISSED'} "
                         f"({', '.join(f'{cond}: {value:.3f}x' for cond, value in ratios.items())}).")
    groups = {cond: {name: median(tps[(cond, name)]) for name in targets} for cond in conditions}
    section.plots.append(plots.bars(ctx.plot_path("model_tokens"), "SmolLM2 tokens/s", "tokens/s", groups))
    section.data = {"tokens_per_s": {f"{c}|{n}": v for (c, n), v in tps.items()}}
    return section

