"""End to end on the real SmolLM2 GGUF: the OpenAI SDK through the router to a real
OpenVINO model server it cold-starts (converted to IR once under state_dir), beside a fake
model, then an unload that gives the process back."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from procman import State
from tests.router_helpers import fake_model, running_router, write_config
from tests.test_router_proxy import alive

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600)]


async def test_sdk_through_the_router_to_the_real_model(tmp_path: Path, demo_gguf: Path) -> None:
    models = {
        "smollm2": {"task": "llm", "engine": "openvino", "path": str(demo_gguf), "device": "CPU",
                    "aliases": ["gpt-4o-mini"], "save_ov_model": True, "startup_timeout_s": 300},
        "tiny-fake": fake_model(),
    }
    path = write_config(tmp_path, models, router={"cache_dir": str(tmp_path / "ov-cache")})
    async with running_router(path) as router:
        client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=300)
        reply = await client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0,
        )
        assert "Paris" in (reply.choices[0].message.content or "")
        assert reply.usage is not None and reply.usage.prompt_tokens > 5 and reply.usage.completion_tokens > 0
        stream = await client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Count from one to five."}],
            max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},  # the length is what is tested: no CPU's EOS may end it sooner
        )
        chunks = [chunk async for chunk in stream]
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
        fake = await client.chat.completions.create(model="tiny-fake", messages=[{"role": "user", "content": "hi"}])
        assert fake.choices[0].message.content == "hi"
        converted = list((tmp_path / "state").rglob("*.xml"))
        assert converted, "save_ov_model stored an OpenVINO IR under state_dir"
        pid = router.backend("smollm2").pid
        unloaded = (await router.client.post("/api/models/smollm2/unload")).json()
        assert unloaded["state"] == "stopped" and not alive(pid)
        assert router.backend("tiny-fake").state is State.READY
        again = await client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0,
        )
        assert "Paris" in (again.choices[0].message.content or ""), "the cold start from the converted IR answers"
        await client.close()
