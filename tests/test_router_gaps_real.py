"""The small client-facing gaps on the real SmolLM2 GGUF through the router: the context size that
``models.list()`` shows before and after a load (and that the loaded process enforces)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
        await client.close()
