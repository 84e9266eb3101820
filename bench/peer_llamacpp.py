"""Peer: llama.cpp's server (llama-cpp-python) on the same GGUF, alone and as a `command:` model of ovrouter.

Runs where a Python with ``llama_cpp.server`` is found: ``OVROUTER_BENCH_LLAMA_PYTHON`` (the
interpreter of a venv with ``llama-cpp-python[server]``), else the bench's own. Skipped
otherwise: the package is a source build (cmake, a C++ compiler, many minutes on a small
machine), so ``make bench-deps`` does not install it. The server runs as the recipe in docs/recipes.md
has it (``--interrupt_requests false``; through the router ``health_path: /v1/models``,
``health_interval_s: 0``, ``max_concurrency: 1``).

Per mode, alternating: a cold start (process spawn to the first content delta of a
streamed chat: the server alone, polled on ``/v1/models`` like the router does; through the
router, the request for the stopped model), then warm single streams (time to first token,
decode tokens/s from the content deltas after the first). One stream at a time: the server
answers one request at a time.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import Context, Section, SectionSkipped, Table, median, ratio
from bench.procs import free_port, wait_http
from bench.realmodel import DEMO_GGUF, PROMPT, StreamStats, stream_chat
from bench.routerctl import Router, router_config, start_router

__all__ = ["run", "server_argv"]

ENV_PYTHON = "OVROUTER_BENCH_LLAMA_PYTHON"
NAME = "llama"


def _python(ctx: Context) -> str:
    python = os.environ.get(ENV_PYTHON) or ctx.python
    probe = subprocess.run([python, "-c", "import llama_cpp.server"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise SectionSkipped(f"no llama_cpp.server in {python} (pip install 'llama-cpp-python[server]', a source "
                             f"build, in a venv, and point {ENV_PYTHON} at its python)")
    return python


def server_argv(python: str, port: str) -> list[str]:
    return [python, "-m", "llama_cpp.server", "--model", str(DEMO_GGUF), "--host", "127.0.0.1", "--port", port,
            "--interrupt_requests", "false", "--n_ctx", "2048", "--verbose", "false"]


def _payload(max_tokens: int) -> dict[str, Any]:
    return {"model": NAME, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": PROMPT}]}


def _stream(url: str, max_tokens: int) -> StreamStats:
    async def once() -> StreamStats:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            return await stream_chat(session, url + "/v1/chat/completions", _payload(max_tokens))

    stats = asyncio.run(once())
    if stats.status != 200:
        raise RuntimeError(f"{url}: a stream answered {stats.status}")
    return stats


def _decode_tps(stats: StreamStats) -> float | None:
    decode_s = stats.seconds - stats.ttft_s
    return (stats.tokens - 1) / decode_s if stats.tokens > 1 and decode_s > 0 else None


def _alone_cold(ctx: Context, python: str, max_tokens: int) -> tuple[float, str, subprocess.Popen[bytes]]:
    port = str(free_port())
    started = time.perf_counter()
    proc = ctx.procs.spawn("llama-alone", server_argv(python, port))
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/v1/models", proc, timeout_s=300)
    stats = _stream(url, max_tokens)
    return time.perf_counter() - started - (stats.seconds - stats.ttft_s), url, proc


def _router_cold(router: Router, max_tokens: int) -> float:
    stats = _stream(router.url, max_tokens)
    return stats.ttft_s


def run(ctx: Context) -> Section:
    python = _python(ctx)
    if not DEMO_GGUF.exists():
        raise SectionSkipped(f"{DEMO_GGUF.name} is missing (`make models` provisions it)")
    cold_reps, warm_reps, max_tokens = ctx.count(3, 1), ctx.count(5, 2), ctx.count(128, 16)
    model = {"command": server_argv(python, "${PORT}"), "health_path": "/v1/models", "health_interval_s": 0,
             "max_concurrency": 1, "idle_timeout_s": 0, "startup_timeout_s": 300}
    router = start_router(ctx.procs, ctx.section_tmp("peer_llamacpp"), router_config(ctx.model_state, {NAME: model}),
                          name="peer-router")
    cold: dict[str, list[float]] = {"alone": [], "router": []}
    warm: dict[str, list[StreamStats]] = {"alone": [], "router": []}
    for _ in range(cold_reps):
        seconds, url, proc = _alone_cold(ctx, python, max_tokens)
        cold["alone"].append(seconds)
        warm["alone"] += [_stream(url, max_tokens) for _ in range(warm_reps)]
        ctx.procs.stop(proc)
        cold["router"].append(_router_cold(router, max_tokens))
        warm["router"] += [_stream(router.url, max_tokens) for _ in range(warm_reps)]
        router.unload(NAME)
    return _section(cold, warm, max_tokens)


def _section(cold: dict[str, list[float]], warm: dict[str, list[StreamStats]], max_tokens: int) -> Section:
    rows = []
    for mode in ("alone", "router"):
        ttft = median([s.ttft_s for s in warm[mode]])
        tps = [t for t in (_decode_tps(s) for s in warm[mode]) if t is not None]
        rows.append([mode, median(cold[mode]), ttft * 1000, median(tps) if tps else None,
                     median([float(s.tokens) for s in warm[mode]])])
    cold_ratio = ratio(rows[1][1], rows[0][1])
    tps_ratio = ratio(rows[1][3], rows[0][3])
    section = Section("peer_llamacpp", "Peer: llama.cpp's server (llama-cpp-python), alone and through ovrouter")
    section.intro = (f"SmolLM2-135M {DEMO_GGUF.name} on CPU, greedy, max_tokens {max_tokens}; medians of "
                     f"{len(cold['alone'])} cold starts and {len(warm['alone'])} warm streams per mode.")
    section.tables = [Table(["mode", "cold start to first token (s)", "warm TTFT (ms)", "decode tokens/s",
                             "tokens"], rows)]
    section.notes = [f"Through ovrouter / alone: cold start x{cold_ratio:.2f}, decode tokens/s x{tps_ratio:.2f}."
                     if cold_ratio is not None and tps_ratio is not None else "No ratio: a figure is missing."]
    section.data = {"cold_s": cold, "warm": {m: [[s.ttft_s, s.tokens, s.seconds] for s in v] for m, v in warm.items()},
                    "max_tokens": max_tokens, "server": str(Path(DEMO_GGUF).name)}
    return section
