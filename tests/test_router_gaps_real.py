"""The small client-facing gaps on the real SmolLM2 GGUF through the router: the context size that
``models.list()`` shows before and after a load (and that the loaded process enforces), and
``/tokenize`` / ``/detokenize`` in llama.cpp's and vLLM's shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.router_helpers import running_router, write_config

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]


def smollm2(demo_gguf: Path, **extra: Any) -> dict[str, Any]:
    return {"task": "llm", "path": str(demo_gguf), "device": "CPU", "startup_timeout_s": 240, **extra}


async def test_models_list_shows_the_served_context_loaded_or_not(tmp_path: Path, demo_gguf: Path) -> None:
    models = {"smollm2": smollm2(demo_gguf), "smollm2-2k": smollm2(demo_gguf, options={"context_length": 2048})}
    path = write_config(tmp_path, models, router={"cache_dir": str(tmp_path / "ov-cache")})
    async with running_router(path) as router:
        client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=240)
        before = {m.id: m.model_extra or {} for m in (await client.models.list()).data}
        assert before["smollm2"]["max_model_len"] == 8192 and before["smollm2-2k"]["max_model_len"] == 2048
        assert before["smollm2"]["status"]["value"] == "unloaded"
        await client.completions.create(model="smollm2", prompt="Hello", max_tokens=2)
        after = {m.id: m.model_extra or {} for m in (await client.models.list()).data}
        assert after["smollm2"]["status"]["value"] == "loaded"
        assert after["smollm2"]["meta"] == {"n_ctx_train": 8192} and after["smollm2"]["context_length"] == 8192
        served = (await router.client.get("/upstream/smollm2/v1/models")).json()["data"][0]
        assert served["max_model_len"] == after["smollm2"]["max_model_len"], "the router says what the server enforces"
        await tokenize_round_trips(router.client, client)
        await client.close()


async def post(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Any:
    reply = await http.post(path, json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


async def tokenize_round_trips(http: httpx.AsyncClient, client: openai.AsyncOpenAI) -> None:
    text = "The capital of France is Paris, and café costs 3€."
    llama = (await post(http, "/tokenize", {"model": "smollm2", "content": text}))["tokens"]
    assert len(llama) > 5 and all(isinstance(i, int) for i in llama)
    assert (await post(http, "/detokenize", {"model": "smollm2", "tokens": llama}))["content"] == text
    pieces = (await post(http, "/tokenize", {"model": "smollm2", "content": "Paris", "with_pieces": True}))["tokens"]
    assert "".join(p["piece"] for p in pieces) == "Paris" and all(set(p) == {"id", "piece"} for p in pieces)
    vllm = await post(http, "/tokenize", {"model": "smollm2", "prompt": text, "add_special_tokens": False})
    assert (vllm["tokens"], vllm["count"], vllm["max_model_len"]) == (llama, len(llama), 8192)
    assert (await post(http, "/detokenize", {"model": "smollm2", "tokens": vllm["tokens"]}))["prompt"] == text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = await post(http, "/tokenize", {"model": "smollm2", "messages": messages})
    reply = await client.chat.completions.create(model="smollm2", messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert reply.usage is not None and chat["count"] == reply.usage.prompt_tokens, "the count is what generation reads"
    long = " ".join(f"word{i}" for i in range(4000))  # past the GGUF tokenizer's 8192-token cut
    counted = await post(http, "/tokenize", {"model": "smollm2", "prompt": long, "add_special_tokens": False})
    assert counted["count"] > 8192 and counted["count"] == len(counted["tokens"])
    assert (await post(http, "/detokenize", {"model": "smollm2", "tokens": counted["tokens"]}))["prompt"] == long
