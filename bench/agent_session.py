"""Agent session: time to first token of a turn that repeats the previous turn's ~3,000-token start.

An agent resends its whole conversation every turn. Two warm SmolLM2 servers behind one
router, the same model: ``smollm2`` with prefix caching (the default) and ``smollm2-nocache``
with ``scheduler.enable_prefix_caching: false``. Each round builds a fresh ~3,000-token
conversation (system prompt and history, unique per round so no earlier round is cached),
asks one question (the first turn), then the same conversation with a new last question
(the second); TTFT of each, streamed, through the router. The target: second <= 0.4x first
with prefix caching.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from bench.common import Context, Section, Table, median, ratio
from bench.realmodel import real_model as demo_model
from bench.realmodel import require_model, stream_chat
from bench.routerctl import router_config, start_router

__all__ = ["conversation", "run"]

log = logging.getLogger(__name__)

MODELS = {"smollm2": {}, "smollm2-nocache": {"scheduler": {"enable_prefix_caching": False}}}
TARGET = 0.4


def conversation(round_no: int, steps: int) -> list[dict[str, str]]:
    """A system prompt and an agent's history of ``steps`` tool-like turns (about 30 tokens each)."""
    system = f"Session {round_no}. You are a coding agent. Answer in one short sentence."
    history: list[dict[str, str]] = [{"role": "system", "content": system}]
    for i in range(steps):
        history.append({"role": "user", "content": f"Step {i}: read src/module_{round_no}_{i}.py."})
        history.append({"role": "assistant", "content": f"module_{round_no}_{i}.py defines f_{i}, which returns "
                                                        f"{i * 7 + round_no} and calls f_{max(i - 1, 0)}."})
    return history


def _payload(model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": model, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": 4, "temperature": 0, "ignore_eos": True}


async def _turns(url: str, model: str, round_no: int, steps: int) -> tuple[float, float]:
    """(first TTFT s, second TTFT s) for one fresh conversation."""
    history = conversation(round_no, steps)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        first = await stream_chat(session, url, _payload(model, [*history, {"role": "user", "content": "Which "
                                                                            "function returns the largest value?"}]))
        second = await stream_chat(session, url, _payload(model, [*history, {"role": "user", "content": "Which file "
                                                                             "did you read first?"}]))
    if first.status != 200 or second.status != 200:
        raise RuntimeError(f"{model}: turns answered {first.status}, {second.status}")
    return first.ttft_s, second.ttft_s


async def _usage(url: str, model: str, round_no: int, steps: int) -> dict[str, Any]:
    history = conversation(round_no, steps)
    body = {**_payload(model, [*history, {"role": "user", "content": "Which file did you read first?"}]),
            "stream": False}
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        usage: dict[str, Any] = (await resp.json())["usage"]
        return usage


def run(ctx: Context) -> Section:
    require_model()
    section = Section("agent_session", "Agent session: TTFT of a turn repeating a ~3,000-token start")
    tmp = ctx.section_tmp("agent_session")
    models = {name: demo_model(**extra) for name, extra in MODELS.items()}
    router = start_router(ctx.procs, tmp, router_config(ctx.model_state, models), name="agent-router")
    for name in models:
        router.load(name)
    url = router.url + "/v1/chat/completions"
    steps, rounds = ctx.count(55, 8), ctx.count(3, 1)
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    for round_no in range(rounds):
        for offset, name in enumerate(models):  # a fresh conversation per model and round: nothing cached before
            first, second = asyncio.run(_turns(url, name, round_no * 10 + offset, steps))
            figures[name].append((first, second))
            log.info("%s round %d: first %.3f s, second %.3f s", name, round_no, first, second)
    usage = asyncio.run(_usage(url, "smollm2", 0, steps))  # the cached conversation of round 0, asked once more
    rows: list[list[object]] = []
    ratios: dict[str, float] = {}
    for name, pairs in figures.items():
        first, second = median([p[0] for p in pairs]) * 1000, median([p[1] for p in pairs]) * 1000
        ratios[name] = ratio(second, first) or float("nan")
        rows.append([name, "on" if name == "smollm2" else "off", first, second, ratios[name]])
    section.tables.append(Table(["model", "prefix caching", "first turn TTFT ms", "second turn TTFT ms",
                                 "second / first"], rows))
    section.intro = (
        f"SmolLM2-135M on CPU through the router, warm; a conversation of {usage['prompt_tokens']:,} prompt tokens "
        f"(system + {steps} user/assistant turns), then the same with a new last question; streamed, greedy, "
        f"max_tokens 4; medians of {rounds} round(s), each with a conversation no earlier request saw. "
        f"The repeat of round 0 reported cached_tokens "
        f"{usage.get('prompt_tokens_details', {}).get('cached_tokens')} of {usage['prompt_tokens']}."
    )
    met = ratios["smollm2"] <= TARGET
    section.notes.append(f"Target second turn <= {TARGET}x the first with prefix caching: "
                         f"{'met' if met else 'MISSED'} ({ratios['smollm2']:.3f}x; without: "
                         f"{ratios['smollm2-nocache']:.3f}x).")
    section.data = {"ttft_s": figures, "ratios": ratios, "usage": usage}
    return section
