"""Embeddings per second: bare pipeline vs model server vs router, by batch and by concurrent clients.

- **bare pipeline**: ``openvino_genai.TextEmbeddingPipeline`` in this process, ``embed_documents(batch)``;
- **model server**: ``python -m modelserver`` on TCP, ``POST /v1/embeddings`` with the batch as ``input``
  (``encoding_format: base64``, what the OpenAI SDK sends);
- **router**: ``ovrouter serve`` in front of the same model server (UDS to the backend).

Model: ``models/minilm-ov`` (all-MiniLM-L6-v2, built by ``make test-models``), mean pooling, CPU.
The first table sends batches of 1, 16 and 64 texts from one client (per-request overheads);
the second has 1, 4, 16 and 64 concurrent clients each sending one text per request, the way
RAG indexers and LangChain do, which the model server's dynamic batching gathers into shared
pipeline calls; its baseline is the bare pipeline fed batches of that many texts. The clients
are wrk's connections when wrk is installed (`make bench-deps`), else the bench's asyncio
generator; the model server's own CPU and the load generator's are counted apart (the bare
pipeline has no client to pay for). The first table's figures are the best of a few timed
windows after a warm-up; the second's the median of rounds in which bare and server windows
take turns.

``python -m bench.embeddings [--quick]`` prints the markdown table; ``make bench`` calls :func:`run`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench import deps
from bench.common import SectionSkipped
from bench.loadgen import LoadResult, Target, Tool, run_load
from bench.procs import ROOT, Procs, free_port, wait_http
from bench.routerctl import router_config, start_router

__all__ = ["main", "run"]

log = logging.getLogger(__name__)

MODEL_DIR = ROOT / "models" / "minilm-ov"
BATCHES = (1, 16, 64)
CLIENTS = (1, 4, 16, 64)
#: Issue 24's targets: 1 client x 1 text against batches of 1, and 16 clients against batches of 16.
TARGET_CLIENTS = {1: 0.8, 16: 0.8}
OPTIONS = {"pooling": "mean", "normalize": True}
TOPICS = ("cats", "the weather", "stock markets", "football", "cooking", "trains", "music", "the sea")


def texts(count: int) -> list[str]:
    return [f"Short sentence number {i} about {TOPICS[i % len(TOPICS)]}." for i in range(count)]


def rate(call: Callable[[list[str]], object], batch: int, window_s: float, windows: int) -> float:
    """Best embeddings/s over ``windows`` windows of at least ``window_s`` each, after one warm-up call."""
    inputs = texts(batch)
    call(inputs)
    best = 0.0
    for _ in range(windows):
        count, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < window_s or count == 0:
            call(inputs)
            count += batch
        best = max(best, count / elapsed)
    return best


def bare_pipeline() -> Any:
    import openvino_genai as ov_genai

    config = ov_genai.TextEmbeddingPipeline.Config()
    config.pooling_type = ov_genai.TextEmbeddingPipeline.PoolingType.MEAN
    config.normalize = True
    config.max_length = 256  # what the model's sentence_bert_config.json declares, as the model server reads it
    return ov_genai.TextEmbeddingPipeline(str(MODEL_DIR), "CPU", config)


def bare_rates(pipe: Any, window_s: float, windows: int, batches: tuple[int, ...] = BATCHES) -> dict[int, float]:
    return {batch: rate(pipe.embed_documents, batch, window_s, windows) for batch in batches}


@dataclass(frozen=True, slots=True)
class Window:
    """One timed window: embeddings done, wall seconds, CPU seconds of the process doing the work (the bare
    pipeline's, or the model server's), and the load generator's CPU seconds (none for the bare pipeline)."""

    count: int
    seconds: float
    cpu_s: float
    loadgen_cpu_s: float = 0.0

    @property
    def rate(self) -> float:
        return self.count / self.seconds

    @property
    def cpu_ms(self) -> float:
        return 1000 * self.cpu_s / max(1, self.count)

    @property
    def loadgen_cpu_ms(self) -> float:
        return 1000 * self.loadgen_cpu_s / max(1, self.count)

    @property
    def total_cpu_ms(self) -> float:
        return self.cpu_ms + self.loadgen_cpu_ms


def _cpu_s(pid: int | None = None) -> float:
    """CPU seconds of ``pid`` (with its threads), or of this process (the bare pipeline's threads) when None."""
    import psutil

    if pid is None:
        own = resource.getrusage(resource.RUSAGE_SELF)
        return own.ru_utime + own.ru_stime
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _bare_window(pipe: Any, batch: int, window_s: float) -> Window:
    inputs = texts(batch)
    pipe.embed_documents(inputs)
    count, started, cpu = 0, time.perf_counter(), _cpu_s()
    while time.perf_counter() - started < window_s or count == 0:
        pipe.embed_documents(inputs)
        count += batch
    return Window(count, time.perf_counter() - started, _cpu_s() - cpu)


def client_target(url: str, clients: int) -> Target:
    """``clients`` texts as one-text requests in base64 (what the OpenAI SDK asks for), sent in turn."""
    bodies = tuple(json.dumps({"model": "minilm", "input": text, "encoding_format": "base64"}).encode()
                   for text in texts(clients))
    return Target(url + "/v1/embeddings", bodies[0], bodies)


def server_window(load: LoadResult, server_cpu_s: float) -> Window:
    """A model server's window from the load generator's record; a failed request fails the bench."""
    if load.error_count:
        raise RuntimeError(f"embeddings requests failed during the window: {load.errors}")
    return Window(load.ok, load.duration_s, server_cpu_s, load.cpu_s or 0.0)


def _clients_window(tool: Tool, url: str, server_pid: int, clients: int, window_s: float) -> Window:
    """``clients`` closed-loop clients (wrk's connections, or the asyncio generator's), one text per request."""
    target = client_target(url, clients)
    cpu = _cpu_s(server_pid)
    load = run_load(tool, target, clients, window_s)
    return server_window(load, _cpu_s(server_pid) - cpu)


def interleaved_client_windows(pipe: Any, servers: dict[str, tuple[str, int]], window_s: float, rounds: int,
                               tool: Tool) -> dict[str, dict[int, list[Window]]]:
    """Windows per target and client count; bare and servers take turns window by window (same load)."""
    samples: dict[str, dict[int, list[Window]]] = {name: {n: [] for n in CLIENTS} for name in ["bare", *servers]}
    for url, _ in servers.values():  # warm-up: connections, the batcher's first batches
        run_load(tool, client_target(url, 4), 4, 0.3)
    for clients in CLIENTS:
        for _ in range(rounds):
            samples["bare"][clients].append(_bare_window(pipe, clients, window_s))
            for name, (url, pid) in servers.items():
                samples[name][clients].append(_clients_window(tool, url, pid, clients, window_s))
    return samples


def start_model_server(procs: Procs, name: str, options: dict[str, Any] | None = None) -> tuple[str, int]:
    from modelserver.spec import SPEC_ENV, build_model_spec

    raw = {"task": "embeddings", "path": str(MODEL_DIR), "options": {**OPTIONS, **(options or {})}}
    spec = build_model_spec("minilm", raw)
    port = free_port()
    proc = procs.spawn(name, [sys.executable, "-m", "modelserver", "--model", "minilm", "--port", str(port)],
                       env={SPEC_ENV: spec.to_env()})
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc, timeout_s=120)
    return url, proc.pid


def http_rates(url: str, model: str, window_s: float, windows: int) -> dict[int, float]:
    with httpx.Client(base_url=url, timeout=120) as client:

        def call(inputs: list[str]) -> object:
            body = {"model": model, "input": inputs, "encoding_format": "base64"}
            response = client.post("/v1/embeddings", json=body)
            response.raise_for_status()
            return response

        return {batch: rate(call, batch, window_s, windows) for batch in BATCHES}


def router_rates(procs: Procs, tmp: Path, window_s: float, windows: int) -> dict[int, float]:
    model = {"task": "embeddings", "path": str(MODEL_DIR), "options": OPTIONS}
    router = start_router(procs, tmp / "router", router_config(tmp / "state", {"minilm": model}))
    try:
        return http_rates(router.url, "minilm", window_s, windows)
    finally:
        procs.stop(router.proc)


def _ratio(value: float | None, base: float) -> str:
    return f"{value / base:.2f}" if value else "-"


def table(bare: dict[int, float], server: dict[int, float], router: dict[int, float] | None) -> dict[str, Any]:
    headers = ["batch", "bare pipeline (emb/s)", "model server (emb/s)", "router (emb/s)", "server / bare",
               "router / bare"]
    rows = []
    for batch in BATCHES:
        via_router = router.get(batch) if router else None
        rows.append([batch, round(bare[batch], 1), round(server[batch], 1),
                     round(via_router, 1) if via_router else "-", _ratio(server[batch], bare[batch]),
                     _ratio(via_router, bare[batch])])
    return {"headers": headers, "rows": rows, "caption": "all-MiniLM-L6-v2 on CPU, sequential requests"}


def markdown(spec: dict[str, Any]) -> str:
    lines = ["| " + " | ".join(spec["headers"]) + " |", "|" + "---|" * len(spec["headers"])]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in spec["rows"]]
    return "\n".join(lines)


def clients_table(samples: dict[str, dict[int, list[Window]]], health: dict[str, Any], tool: Tool) -> dict[str, Any]:
    headers = ["clients x 1 text", "target", "emb/s", "x bare (median of rounds)", "CPU ms / embedding",
               "x bare by CPU", "load generator CPU ms / embedding", "x bare by CPU with the load generator"]
    rows = []
    for n in CLIENTS:
        bare = samples["bare"][n]
        for name in samples:
            windows = samples[name][n]
            label = {"bare": f"bare pipeline, batches of {n}", "server": "model server (batch_wait_ms 2)",
                     "no-wait": "model server, batch_wait_ms 0"}.get(name, name)
            loadgen = "-" if name == "bare" else round(median([w.loadgen_cpu_ms for w in windows]), 3)
            with_loadgen = "-" if name == "bare" else round(cpu_ratio(windows, bare, with_loadgen=True), 2)
            rows.append([n, label, round(median([w.rate for w in windows]), 1), round(rate_ratio(windows, bare), 2),
                         round(median([w.cpu_ms for w in windows]), 2), round(cpu_ratio(windows, bare), 2),
                         loadgen, with_loadgen])
    caption = (f"closed-loop clients ({LOADGEN_NAMES[tool]}), one text per request in base64; bare / server / "
               "no-wait server windows take turns. CPU ms / embedding = the bare process's, or the model server's "
               "own (every thread); the load generator's CPU is its own column, and the last column adds it to the "
               "server's. The default server ran "
               f"{health.get('batches')} pipeline calls in all, the largest of {health.get('largest_batch')} texts")
    return {"headers": headers, "rows": rows, "caption": caption}


LOADGEN_NAMES = {"wrk": "wrk, one thread, N connections", "asyncio": "the bench's asyncio generator"}


def verdict(clients: int, target: float, windows: list[Window], bare: list[Window]) -> str:
    """The target's line: judged on emb/s and the model server's own CPU per embedding; the figure with the load
    generator's CPU added is shown beside it."""
    value, by_cpu = rate_ratio(windows, bare), cpu_ratio(windows, bare)
    met = "met" if min(value, by_cpu) >= target else "MISSED"
    return (f"Target {clients} client(s) x 1 text >= {target}x the bare pipeline fed batches of {clients}, judged by "
            f"emb/s and by the model server's own CPU per embedding: {met} ({value:.2f}x by emb/s, {by_cpu:.2f}x by "
            f"server CPU per embedding; {cpu_ratio(windows, bare, with_loadgen=True):.2f}x by CPU with the load "
            "generator's added).")


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def rate_ratio(windows: list[Window], bare: list[Window]) -> float:
    return median([w.rate / b.rate for w, b in zip(windows, bare, strict=True)])


def cpu_ratio(windows: list[Window], bare: list[Window], with_loadgen: bool = False) -> float:
    """Bare CPU per embedding over this target's: what the throughput ratio is when the CPU is the limit."""
    return median([b.cpu_ms / (w.total_cpu_ms if with_loadgen else w.cpu_ms)
                   for w, b in zip(windows, bare, strict=True)])


def run(quick: bool = False, loadgen: Tool | None = None) -> dict[str, Any]:
    """The section; ``loadgen`` drives the clients table (None: wrk when installed, else the asyncio generator)."""
    if not (MODEL_DIR / "openvino_model.xml").exists():
        raise SectionSkipped(f"{MODEL_DIR.relative_to(ROOT)} is missing: run `make test-models`")
    tool: Tool = loadgen or ("wrk" if deps.detect().wrk else "asyncio")
    window_s, windows = (0.2, 1) if quick else (2.0, 3)
    notes: list[str] = [f"load average at the section's start: {os.getloadavg()[0]:.2f}"]
    with tempfile.TemporaryDirectory(prefix="bench-embeddings-") as folder, Procs(Path(folder) / "logs") as procs:
        pipe = bare_pipeline()
        servers = {"server": start_model_server(procs, "minilm"),
                   "no-wait": start_model_server(procs, "minilm-nowait", {"batch_wait_ms": 0})}
        bare = bare_rates(pipe, window_s, windows)
        server = http_rates(servers["server"][0], "minilm", window_s, windows)
        clients_s = max(1, round(window_s)) if tool == "wrk" else window_s * 0.75  # wrk counts whole seconds
        samples = interleaved_client_windows(pipe, servers, clients_s, 1 if quick else 3, tool)
        health = httpx.get(servers["server"][0] + "/health").json()
        procs.stop_all()  # the two model servers; the router starts its own
        router: dict[int, float] | None = None
        try:
            router = router_rates(procs, Path(folder), window_s, windows)
        except (SectionSkipped, RuntimeError, TimeoutError, httpx.HTTPError) as exc:
            notes.append(f"router column skipped: {exc}".splitlines()[0])
    result = table(bare, server, router)
    concurrent = clients_table(samples, health, tool)
    for clients, target in TARGET_CLIENTS.items():
        notes.append(verdict(clients, target, samples["server"][clients], samples["bare"][clients]))
    notes.append(f"load average at the section's end: {os.getloadavg()[0]:.2f}")
    if quick:
        notes.append("quick mode: one short window per figure; the numbers mean little")
    return {"intro": (__doc__ or "").split("\n\n")[1], "tables": [result, concurrent], "markdown": "",
            "notes": notes, "raw": {"bare": bare, "model_server": server, "router": router,
                                    "loadgen": tool,
                                    "clients": {name: {n: [(w.count, w.seconds, w.cpu_s, w.loadgen_cpu_s)
                                                           for w in windows]
                                                       for n, windows in by_n.items()}
                                                for name, by_n in samples.items()}}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.embeddings", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--loadgen", choices=["wrk", "asyncio"], help="the clients' generator (default: wrk if any)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    result = run(args.quick, args.loadgen)
    for spec in result["tables"]:
        print(markdown(spec) + "\n")
    for note in result["notes"]:
        print(f"\n- {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
