"""Embeddings per second for batches of 1, 16 and 64 short texts: bare pipeline vs model server vs router.

- **bare pipeline**: ``openvino_genai.TextEmbeddingPipeline`` in this process, ``embed_documents(batch)``;
- **model server**: ``python -m modelserver`` on TCP, ``POST /v1/embeddings`` with the batch as ``input``
  (``encoding_format: base64``, what the OpenAI SDK sends);
- **router**: ``ovrouter serve`` in front of the same model server (UDS to the backend).

Model: ``models/minilm-ov`` (all-MiniLM-L6-v2, built by ``make test-models``), mean pooling, CPU.
Each figure is the best of a few timed windows after a warm-up call; requests are sequential
(one client), so the figures compare per-request overheads, not concurrency.

``python -m bench.embeddings [--quick]`` prints the markdown table; ``make bench`` calls :func:`run`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.common import SectionSkipped
from bench.procs import ROOT, Procs, free_port, wait_http
from bench.routerctl import router_config, start_router

__all__ = ["main", "run"]

log = logging.getLogger(__name__)

MODEL_DIR = ROOT / "models" / "minilm-ov"
BATCHES = (1, 16, 64)
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


def bare_rates(window_s: float, windows: int) -> dict[int, float]:
    import openvino_genai as ov_genai

    config = ov_genai.TextEmbeddingPipeline.Config()
    config.pooling_type = ov_genai.TextEmbeddingPipeline.PoolingType.MEAN
    config.normalize = True
    pipe = ov_genai.TextEmbeddingPipeline(str(MODEL_DIR), "CPU", config)
    return {batch: rate(pipe.embed_documents, batch, window_s, windows) for batch in BATCHES}


def http_rates(url: str, model: str, window_s: float, windows: int) -> dict[int, float]:
    with httpx.Client(base_url=url, timeout=120) as client:

        def call(inputs: list[str]) -> object:
            body = {"model": model, "input": inputs, "encoding_format": "base64"}
            response = client.post("/v1/embeddings", json=body)
            response.raise_for_status()
            return response

        return {batch: rate(call, batch, window_s, windows) for batch in BATCHES}


def model_server_rates(procs: Procs, window_s: float, windows: int) -> dict[int, float]:
    from modelserver.spec import SPEC_ENV, build_model_spec

    spec = build_model_spec("minilm", {"task": "embeddings", "path": str(MODEL_DIR), "options": OPTIONS})
    port = free_port()
    proc = procs.spawn("modelserver-minilm", [sys.executable, "-m", "modelserver", "--model", "minilm", "--port",
                                              str(port)], env={SPEC_ENV: spec.to_env()})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc, timeout_s=120)
        return http_rates(url, "minilm", window_s, windows)
    finally:
        procs.stop(proc)


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


def run(quick: bool = False) -> dict[str, Any]:
    if not (MODEL_DIR / "openvino_model.xml").exists():
        raise SectionSkipped(f"{MODEL_DIR.relative_to(ROOT)} is missing: run `make test-models`")
    window_s, windows = (0.2, 1) if quick else (2.0, 3)
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-embeddings-") as folder, Procs(Path(folder) / "logs") as procs:
        bare = bare_rates(window_s, windows)
        server = model_server_rates(procs, window_s, windows)
        router: dict[int, float] | None = None
        try:
            router = router_rates(procs, Path(folder), window_s, windows)
        except (SectionSkipped, RuntimeError, TimeoutError, httpx.HTTPError) as exc:
            notes.append(f"router column skipped: {exc}".splitlines()[0])
    result = table(bare, server, router)
    if quick:
        notes.append("quick mode: one short window per figure; the numbers mean little")
    return {"intro": (__doc__ or "").split("\n\n")[1], "tables": [result], "markdown": "", "notes": notes,
            "raw": {"bare": bare, "model_server": server, "router": router}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.embeddings", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    result = run(args.quick)
    print(markdown(result["tables"][0]))
    for note in result["notes"]:
        print(f"\n- {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
