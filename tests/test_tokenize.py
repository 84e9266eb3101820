"""``/tokenize`` and ``/detokenize``: llama.cpp's and vLLM's bodies on the fake engine in process, and
through a router (routing by ``model``, and a llama.cpp body without one)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from modelserver.app import build_app
from modelserver.engines.fake import FakeTextGenerator
from modelserver.spec import build_model_spec
from procman import State
from tests.router_helpers import fake_model, running_router, write_config

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def fake() -> AsyncIterator[httpx.AsyncClient]:
    spec = build_model_spec("m", {"engine": "fake", "options": {"context_length": 512}})
    transport = httpx.ASGITransport(app=build_app(spec, FakeTextGenerator(spec)))
    async with httpx.AsyncClient(transport=transport, base_url="http://m") as client:
        yield client


async def post(client: httpx.AsyncClient, path: str, body: dict[str, Any], status: int = 200) -> Any:
    reply = await client.post(path, json=body)
    assert reply.status_code == status, reply.text
    return reply.json()


async def test_llama_cpp_shape_round_trips_with_and_without_pieces(fake: httpx.AsyncClient) -> None:
    ids = (await post(fake, "/tokenize", {"content": "the cat sat on the mat"}))["tokens"]
    assert len(ids) == 6 and ids[0] == ids[4] and all(isinstance(i, int) for i in ids)
    special = (await post(fake, "/tokenize", {"content": "the cat", "add_special": True}))["tokens"]
    assert special == [0, ids[0], ids[1]]
    pieces = (await post(fake, "/tokenize", {"content": "the cat", "with_pieces": True}))["tokens"]
    assert pieces == [{"id": ids[0], "piece": "the"}, {"id": ids[1], "piece": "cat"}]
    back = await post(fake, "/detokenize", {"tokens": ids})
    assert back == {"content": "the cat sat on the mat", "prompt": "the cat sat on the mat"}


async def test_vllm_shape_counts_a_prompt_and_a_chat(fake: httpx.AsyncClient) -> None:
    prompt = await post(fake, "/tokenize", {"model": "m", "prompt": "one two three", "return_token_strs": True})
    assert (prompt["count"], prompt["max_model_len"], prompt["token_strs"]) == (4, 512, ["<s>", "one", "two", "three"])
    assert prompt["tokens"][0] == 0  # add_special_tokens defaults to true for a prompt
    chat = await post(fake, "/tokenize", {"model": "m", "messages": [{"role": "user", "content": "one two"}]})
    assert chat["count"] == len(chat["tokens"]) == 4 and chat["token_strs"] is None  # user: one two assistant:
    bare = await post(fake, "/tokenize", {"messages": [{"role": "user", "content": "one"}],
                                          "add_generation_prompt": False})
    assert bare["count"] == 2
    back = await post(fake, "/detokenize", {"model": "m", "tokens": prompt["tokens"][1:]})
    assert back["prompt"] == "one two three"


@pytest.mark.parametrize(("path", "body", "needle"), [
    ("/tokenize", {}, "send one of `content`"),
    ("/tokenize", {"content": "a", "prompt": "b"}, "got content, prompt"),
    ("/tokenize", {"content": "a", "parse_special": False}, "parse_special"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/detokenize", {"tokens": [10_000]}, "tokens[0]: 10000 is not a token id of this model"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
])
async def test_bad_bodies_are_400_naming_the_field(fake: httpx.AsyncClient, path: str, body: dict[str, Any],
                                                   needle: str) -> None:
    error = (await post(fake, path, body, 400))["error"]
    assert needle in error["message"], error


async def test_the_router_routes_by_model_and_a_body_without_one_to_the_only_text_model(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"a": fake_model(), "emb": fake_model(task="embeddings")})
    async with running_router(path) as router:
        ids = await post(router.client, "/tokenize", {"content": "hello there"})  # llama.cpp: no model
        assert len(ids["tokens"]) == 2
        assert (await post(router.client, "/detokenize", {"tokens": ids["tokens"]}))["content"] == "hello there"
        named = await post(router.client, "/tokenize", {"model": "a", "prompt": "hello there"})
        assert named["tokens"][1:] == ids["tokens"]
        wrong = await post(router.client, "/tokenize", {"model": "emb", "prompt": "x"}, 400)
        assert "/tokenize needs task llm or vlm" in wrong["error"]["message"]
        assert (await router.client.post("/tokenize", json={"model": "nope", "prompt": "x"})).status_code == 404


async def test_with_several_text_models_a_body_without_model_goes_to_the_only_loaded_one(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"a": fake_model(), "b": fake_model()})
    async with running_router(path) as router:
        refused = await post(router.client, "/tokenize", {"content": "x"}, 400)
        assert refused["error"]["param"] == "model" and "a, b" in refused["error"]["message"]
        assert (await post(router.client, "/tokenize", {"model": "b", "content": "warm up"}))["tokens"] == [1, 2]
        assert (await post(router.client, "/tokenize", {"content": "up"}))["tokens"] == [2]  # b's vocabulary
        assert router.backend("a").state is State.STOPPED
