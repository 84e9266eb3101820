"""The official ``ollama`` client through the router to real OpenVINO model servers: SmolLM2 (chat and
generate text), the tiny tool model (a tool call from random weights, forced by ``options.tool_choice``;
a JSON-schema ``format``) and MiniLM (embed). Invariants only: "Paris", counts that add up, schema-valid
output, object arguments, vector sizes."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import jsonschema
import ollama
import pytest
from conftest import ROOT

from procman import State
from tests.router_helpers import running_router, write_config

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600)]

QWEN = ROOT / "models" / "qwen2-tools-tiny-ov"
MINILM = ROOT / "models" / "minilm-ov"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
PLAN = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}


def set_light(on: bool, dimmed: bool) -> str:
    """Switch the kitchen light (booleans only: random weights under the grammar always close the call).

    Args:
        on: whether it is on
        dimmed: whether it is dimmed
    """
    return "done"


async def test_ollama_client_on_real_models(tmp_path: Path, demo_gguf: Path) -> None:
    for folder in (QWEN, MINILM):
        if not (folder / "openvino_model.xml").exists():
            pytest.fail(f"{folder} is missing: run `make test-models`")
    settings = {"startup_timeout_s": 300, "default_max_tokens": 48}
    models = {"smollm2": {"task": "llm", "path": str(demo_gguf), **settings},
              "qwen": {"task": "llm", "path": str(QWEN), **settings},
              "minilm": {"task": "embeddings", "path": str(MINILM), "startup_timeout_s": 300}}
    path = write_config(tmp_path, models, router={"cache_dir": str(tmp_path / "ov-cache")})
    async with running_router(path) as router:
        client = ollama.AsyncClient(host=router.url + "/ollama", timeout=300)
        options: Any = {"temperature": 0, "num_predict": 24, "num_ctx": 8192.0}

        answer = await client.chat(model="smollm2", messages=FRANCE, options=options)
        assert "Paris" in (answer.message.content or "") and answer.done
        assert (answer.prompt_eval_count or 0) > 5 and 0 < (answer.eval_count or 0) <= 24
        assert (answer.load_duration or 0) > 0 and (answer.total_duration or 0) > (answer.eval_duration or 0)
        parts = [part async for part in await client.chat(model="smollm2:latest", messages=FRANCE, options=options,
                                                           stream=True)]
        assert "Paris" in "".join(p.message.content or "" for p in parts)
        assert [p.done for p in parts].count(True) == 1 and parts[-1].done
        assert parts[-1].eval_count == answer.eval_count, "the same greedy answer, streamed, counts the same"
        assert parts[-1].done_reason == answer.done_reason and parts[-1].load_duration == 0
        generated = await client.generate(model="smollm2", prompt="What is the capital of France?", options=options)
        assert "Paris" in generated.response and generated.done_reason in ("stop", "length")
        short = await client.generate(model="smollm2", prompt="Write a long story.", options={"num_predict": 3})
        assert short.done_reason == "length" and short.eval_count == 3

        shown = await client.show("qwen")
        assert "tools" in (shown.capabilities or []) and shown.modelinfo is not None
        assert shown.modelinfo["qwen2.context_length"] == 4096
        for stream in (False, True):
            kwargs: Any = {"model": "qwen", "messages": [{"role": "user", "content": "Light on?"}],
                           "tools": [set_light], "options": {"tool_choice": "required", "temperature": 1.0,
                                                               "seed": 3, "num_predict": 300}}
            if stream:
                calls = [c async for p in await client.chat(**kwargs, stream=True) for c in p.message.tool_calls or []]
            else:
                reply = await client.chat(**kwargs)
                calls = list(reply.message.tool_calls or [])
                assert calls, reply
            assert len(calls) == 1 and calls[0].function.name == "set_light"
            assert isinstance(calls[0].function.arguments, dict)
            assert {k: type(v) for k, v in calls[0].function.arguments.items()} == {"on": bool, "dimmed": bool}
        planned = await client.chat(model="qwen", messages=[{"role": "user", "content": "plan"}], format=PLAN,
                                    options={"temperature": 1.0, "seed": 5, "num_predict": 64})
        jsonschema.validate(json.loads(planned.message.content or ""), PLAN)

        embedded = await client.embed(model="minilm", input=["the cat sat", "a dog ran"])
        assert [len(v) for v in embedded.embeddings] == [384, 384] and (embedded.prompt_eval_count or 0) > 4
        with pytest.raises(ollama.ResponseError) as refused:
            await client.embed(model="minilm", input="x", dimensions=128)  # MiniLM is not Matryoshka-trained
        assert refused.value.status_code == 400 and "dimensions" in refused.value.error

        await client.chat(model="smollm2", messages=FRANCE, options={"num_predict": 1}, keep_alive=0)
        deadline = time.monotonic() + 60
        while router.backend("smollm2").state is not State.STOPPED:
            assert time.monotonic() < deadline, "keep_alive 0 did not stop the model"
            await asyncio.sleep(0.05)
        assert {m.model for m in (await client.ps()).models} == {"qwen:latest", "minilm:latest"}
