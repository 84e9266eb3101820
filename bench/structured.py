"""Constrained decoding: what structured output and forced tool calls cost in tokens/s (SmolLM2 on CPU).

One model server (``python -m modelserver``, SmolLM2-135M GGUF) answers the same prompt
free, under ``response_format`` ``json_object``, under a ``json_schema`` compiled to the
server's compact grammar, under the same schema handed to XGrammar's own JSON-schema
compiler (one keyword the compact grammar does not cover sends it there), and as a forced
``tool_choice`` (Hermes structural tag; ``tool_choice: auto`` with the same tools is its
unconstrained baseline, as the tools make the prompt longer). Greedy, streamed; rounds alternate the order of
the modes. The answers differ in length, so the two costs are shown apart: time to the
first chunk (prompt + the grammar's compile, which XGrammar does per request) and the
decode rate after it, (usage.completion_tokens - 1) / (time from the first chunk to the
end). A tool call is sent once complete, so for it the first chunk is the role chunk the
server sends when the engine's first token arrives.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

import httpx

from bench.common import Context, Section, SectionSkipped, Table, median, ratio
from bench.procs import ROOT, free_port, wait_http

__all__ = ["run"]

log = logging.getLogger(__name__)

DEMO_GGUF = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "List three cats as JSON: for each its name, its age in years and its color."
CATS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "cats": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "age": {"type": "integer", "minimum": 0, "maximum": 30},
                    "color": {"type": "string", "enum": ["black", "white", "orange", "grey", "brown"]},
                },
                "required": ["name", "age", "color"],
            },
            "minItems": 1,
            "maxItems": 3,
        }
    },
    "required": ["cats"],
}
TOOL = {"type": "function", "function": {"name": "save_cats", "parameters": CATS}}
MODES: dict[str, dict[str, Any]] = {
    "free text": {},
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema (compact grammar)": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "cats", "schema": CATS}}
    },
    "json_schema (XGrammar's compiler)": {  # minProperties is outside the compact grammar's keywords
        "response_format": {"type": "json_schema", "json_schema": {"name": "cats", "schema": {**CATS,
                                                                                               "minProperties": 1}}}
    },
    "tools offered, tool_choice auto": {"tools": [TOOL], "tool_choice": "auto"},  # the same prompt, unconstrained
    "tool_choice required": {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False},
}


def _ask(client: httpx.Client, extra: dict[str, Any], max_tokens: int) -> tuple[int, float, float, str]:
    """(completion tokens, seconds to the first chunk, seconds from it to the end, finish_reason)."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}, **extra}
    start = time.perf_counter()
    first = end = float("nan")
    count, finish = 0, ""
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if first != first:  # NaN: this is the first chunk
                first = time.perf_counter() - start
            if line == "data: [DONE]":
                end = time.perf_counter() - start
                break
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                count = int(chunk["usage"]["completion_tokens"])
            for choice in chunk.get("choices") or ():
                finish = choice.get("finish_reason") or finish
    return count, first, end - first, finish


def _serve(ctx: Context) -> tuple[Any, str]:
    from modelserver.spec import SPEC_ENV, build_model_spec

    spec = build_model_spec("smollm2", {"path": str(DEMO_GGUF), "cache_dir": str(ctx.section_tmp("structured"))})
    port = free_port()
    argv = [sys.executable, "-m", "modelserver", "--model", "smollm2", "--port", str(port)]
    proc = ctx.procs.spawn("structured-smollm2", argv, env={SPEC_ENV: spec.to_env()})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc, timeout_s=300)
    except (RuntimeError, TimeoutError) as exc:
        raise RuntimeError(f"{exc}\n{ctx.procs.log_tail('structured-smollm2')}") from None
    return proc, url


def run(ctx: Context) -> Section:
    if not DEMO_GGUF.exists():
        raise SectionSkipped(f"{DEMO_GGUF.relative_to(ROOT)} is missing (`make models` provisions it)")
    section = Section("structured", "Constrained decoding: tokens/s with and without structured output")
    proc, url = _serve(ctx)
    max_tokens = ctx.count(96, 16)
    rounds = ctx.count(4, 1)
    samples: dict[str, list[tuple[int, float, float, str]]] = {mode: [] for mode in MODES}
    with httpx.Client(base_url=url, timeout=600) as client:
        for extra in MODES.values():
            _ask(client, extra, 4)  # warm-up
        for round_no in range(rounds):
            order = list(MODES.items()) if round_no % 2 == 0 else list(reversed(MODES.items()))
            for mode, extra in order:
                samples[mode].append(_ask(client, extra, max_tokens))
                log.info("%s: %d tokens, first chunk %.3f s, then %.2f s", mode, *samples[mode][-1][:3])
    ctx.procs.stop(proc)
    each = {mode: [(t - 1) / d for t, _, d, _ in samples[mode] if t > 1 and d > 0] for mode in MODES}
    rates = {mode: median(values) for mode, values in each.items()}
    best = {mode: max(values, default=float("nan")) for mode, values in each.items()}
    rows = [
        [mode, median([float(s[0]) for s in samples[mode]]), median([s[1] * 1000 for s in samples[mode]]),
         rates[mode], ratio(rates[mode], rates["free text"]), best[mode], ratio(best[mode], best["free text"]),
         ", ".join(sorted({s[3] for s in samples[mode]}))]
        for mode in MODES
    ]
    section.intro = (
        f"SmolLM2-135M-Instruct (Q4_1 GGUF) on CPU, one stream, greedy, streamed, max_tokens={max_tokens}, "
        f"{rounds} alternating round(s); medians. Prompt: {json.dumps(PROMPT)}."
    )
    section.tables.append(Table(
        ["mode", "tokens", "first chunk ms (prompt + compile)", "decode tokens/s", "x free text",
         "best decode tokens/s", "best x free text", "finish"], rows,
        "best = the fastest round: on a busy machine the least disturbed figure, closest to the constraint's own cost",
    ))
    section.data = {"decode_tokens_per_s": rates, "samples": samples}
    return section
