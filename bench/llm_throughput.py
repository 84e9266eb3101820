"""LLM throughput: ``python -m modelserver`` vs the bare in-process ContinuousBatchingPipeline.

``python -m bench.llm_throughput [--quick]`` prints a markdown table; ``run(quick)`` returns
the numbers (``make bench`` renders them). Both sides get the same chat-templated prompts
and generate exactly ``tokens`` tokens per stream (``ignore_eos``, greedy), at 1, 4 and 8
concurrent streams:

- **bare**: this process adds the N requests to one pipeline and loops ``step()`` until all finish;
- **server**: N concurrent streamed ``/v1/chat/completions`` requests over HTTP to a model
  server process (one pipeline, its pump thread batching them), sent by aiohttp on uvloop:
  the client shares the cores with the server while the bare side has none, so it is kept as
  light as the other benches' load generators.

The rounds alternate (bare N=1, server N=1, bare N=4, ...; ``repeats`` times), so a noisy
neighbour on the CPU hits both sides alike; the median of the rounds is reported.

Aggregate tokens/s = N x tokens / wall time from the first request to the last token.
Targets: 8 streams >= 3.5x one stream; the server within 10% of the bare pipeline.
The two sides never run at the same time, but the CPU may be shared with other work: the
numbers are only as quiet as the machine was.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import uvloop

__all__ = ["main", "run"]

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
STREAMS = (1, 4, 8)
PROMPTS = [
    "Tell me a story about a dragon who learns to paint.",
    "Describe a walk through a forest in autumn.",
    "Explain how a steam engine works to a child.",
    "Write a letter from a lighthouse keeper to a friend.",
    "Describe the city of the future.",
    "Tell me about the life of a honey bee.",
    "Write a short tale about a lost robot finding home.",
    "Describe a storm at sea from a sailor's point of view.",
]


class Bare:
    """The pipeline in this process: N requests added at once, ``step()`` until all finish."""

    def __init__(self, model: Path, cache_dir: str) -> None:
        import openvino_genai as ov_genai

        self._ov = ov_genai
        self._pipe = ov_genai.ContinuousBatchingPipeline(
            str(model), ov_genai.SchedulerConfig(), "CPU", {"CACHE_DIR": cache_dir}
        )
        tokenizer = self._pipe.get_tokenizer()
        self._prompts = [
            tokenizer.encode(
                tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True),
                add_special_tokens=False,
            ).input_ids
            for p in PROMPTS
        ]
        self.round(1, 8)  # warm-up

    def round(self, n: int, tokens: int) -> float:
        config = self._ov.GenerationConfig()
        config.max_new_tokens = tokens
        config.ignore_eos = True
        started = time.perf_counter()
        handles = [self._pipe.add_request(i, ids, config) for i, ids in enumerate(self._prompts[:n])]
        while self._pipe.has_non_finished_requests():
            self._pipe.step()
        elapsed = time.perf_counter() - started
        generated = sum(len(out.generated_ids) for h in handles for out in h.read_all())
        assert generated == tokens * n, f"bare pipeline generated {generated} tokens"
        return generated / elapsed


async def _stream_one(client: aiohttp.ClientSession, prompt: str, tokens: int) -> int:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage = 0
    async with client.post("/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data: {") and b'"usage":{' in line:
                usage = json.loads(line[6:])["usage"]["completion_tokens"]
    return usage


async def _server_round(client: aiohttp.ClientSession, n: int, tokens: int) -> float:
    started = time.perf_counter()
    counts = await asyncio.gather(*(_stream_one(client, p, tokens) for p in PROMPTS[:n]))
    elapsed = time.perf_counter() - started
    assert sum(counts) == tokens * n, f"server generated {counts} tokens"
    return sum(counts) / elapsed


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """A ``python -m modelserver`` process and one HTTP client kept across rounds."""

    def __init__(self, model: Path, cache_dir: str, workdir: Path) -> None:
        port = _free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        self._log = workdir / "modelserver.log"
        spec = {"name": "bench-llm", "path": str(model), "cache_dir": cache_dir}
        env = {**os.environ, "OVROUTER_MODEL_SPEC": json.dumps(spec)}
        with self._log.open("wb") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "modelserver", "--model", "bench-llm", "--port", str(port)],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        try:
            self._wait_ready()
            self._client = self._runner.run(self._session())
            self.round(1, 8)  # warm-up
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"model server exited: {self._log.read_text(errors='replace')[-2000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError("model server not ready")

    async def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(base_url=self.base_url, timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=16))

    def round(self, n: int, tokens: int) -> float:
        return self._runner.run(_server_round(self._client, n, tokens))

    def close(self) -> None:
        if hasattr(self, "_client"):
            self._runner.run(self._client.close())
        self._runner.close()
        self._proc.terminate()
        try:
            self._proc.wait(15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def measure(model: Path, tokens: int, repeats: int) -> dict[str, dict[int, list[float]]]:
    """tok/s samples per side and stream count; the rounds of the two sides alternate, so noise hits both."""
    samples: dict[str, dict[int, list[float]]] = {"bare": {n: [] for n in STREAMS}, "server": {n: [] for n in STREAMS}}
    with tempfile.TemporaryDirectory(prefix="bench-llm-") as tmp:
        cache_dir = str(Path(tmp) / "ov-cache")
        bare = Bare(model, cache_dir)
        server = Server(model, cache_dir, Path(tmp))
        try:
            for _ in range(repeats):
                for n in STREAMS:
                    samples["bare"][n].append(bare.round(n, tokens))
                    samples["server"][n].append(server.round(n, tokens))
        finally:
            server.close()
    return samples


def run(quick: bool = False) -> dict[str, Any]:
    """Measure both sides; returns rows per stream count, the two targets and notes."""
    if not MODEL.is_file():
        raise FileNotFoundError(f"{MODEL} is missing: run `make models`")
    tokens, repeats = (16, 1) if quick else (64, 5)
    samples = measure(MODEL, tokens, repeats)
    bare = {n: statistics.median(values) for n, values in samples["bare"].items()}
    server = {n: statistics.median(values) for n, values in samples["server"].items()}
    rows = [
        {
            "streams": n,
            "bare tok/s": round(bare[n], 1),
            "server tok/s": round(server[n], 1),
            "server / bare": round(server[n] / bare[n], 3),
            "server scaling vs 1 stream": round(server[n] / server[1], 2),
            "bare range": f"{min(samples['bare'][n]):.1f}-{max(samples['bare'][n]):.1f}",
            "server range": f"{min(samples['server'][n]):.1f}-{max(samples['server'][n]):.1f}",
        }
        for n in STREAMS
    ]
    return {
        "rows": rows,
        "tokens_per_stream": tokens,
        "repeats (median)": repeats,
        "server_8_vs_1_stream": round(server[8] / server[1], 2),
        "target_8_streams_ge_3.5x": server[8] / server[1] >= 3.5,
        "server_vs_bare_worst": round(min(server[n] / bare[n] for n in STREAMS), 3),
        "target_server_within_10pct": all(server[n] >= 0.9 * bare[n] for n in STREAMS),
        "notes": [
            f"{tokens} tokens per stream (ignore_eos, greedy), SmolLM2-135M Q4_1 GGUF on CPU, default SchedulerConfig.",
            f"CPU: {os.cpu_count()} cores, shared with whatever else ran. Bare and server rounds alternate "
            f"(never at the same time); median of {repeats} rounds each.",
        ]
        + (["quick mode: 16 tokens, one repeat; the numbers mean little."] if quick else []),
    }


def markdown(result: dict[str, Any]) -> str:
    headers = list(result["rows"][0])
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(row[h]) for h in headers) + " |" for row in result["rows"]]
    lines.append("")
    lines.append(
        f"8 streams vs 1 stream (server): {result['server_8_vs_1_stream']}x (target >= 3.5x: "
        f"{'met' if result['target_8_streams_ge_3.5x'] else 'NOT met'})"
    )
    lines.append(
        f"worst server / bare: {result['server_vs_bare_worst']} (target >= 0.9: "
        f"{'met' if result['target_server_within_10pct'] else 'NOT met'})"
    )
    lines += [f"- {note}" for note in result["notes"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.llm_throughput", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    print(markdown(run(quick=args.quick)))


if __name__ == "__main__":
    main()
